"""Configuration of one engine worker (``kvatlas engine serve``)."""
from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass

from bootstrap.http_limits import READ_TIMEOUT_S, check_read_timeout
from engine.checkpoint import ModelSpec, check_tp, resolve_model, supported_models
from engine.config import ModelConfig
from index.events.endpoints import parse_tcp

DEFAULT_KV_BYTES = 1 << 30
DEFAULT_MAX_PAGES = 4096
MODES = ("monolithic", "prefill", "decode")
"""Serving modes: prefill and decode run the PD data plane (``engine.pd``)."""


@dataclass
class EngineServerConfig:
    """One worker: model, KV pool, scheduler limits, HTTP address and KV-event publishing."""

    mode: str = "monolithic"
    """Serving mode: ``monolithic`` (prefill and decode in one process), ``prefill`` or
    ``decode`` (disaggregated; see ``engine.pd.config.PDConfig``)."""
    model: str | None = None
    """What to serve: a seeded config (``tiny``, the default without ``model_path``;
    ``tiny-kv4``, ``bench``), ``smollm2-135m`` (or its served name
    ``HuggingFaceTB/SmolLM2-135M-Instruct``: the bundled GGUF), or a checkpoint path."""
    model_seed: int = 0
    """Weight seed of a seeded config; every worker of one deployment must use the same one."""
    served_model_name: str | None = None
    """Model name in OpenAI responses and /v1/models; defaults to the checkpoint's (a seeded
    config's name)."""
    model_path: str | None = None
    """A checkpoint to serve when ``model`` is not a seeded config: a Llama/Qwen2/Qwen3
    directory (config.json + *.safetensors) or a GGUF. With a seeded config: an existing local
    directory reported as model_path (its config.json is written there when missing); None
    creates one under a temporary run directory for the server's lifetime."""
    dtype: str | None = None
    """Compute (and KV) dtype override; None: the seeded config's, float32 for a checkpoint."""
    device: str = "cpu"
    """Torch device of weights and KV pool (``cpu``, ``cuda``, ``cuda:N``)."""
    torch_threads: int | None = 1
    """torch intra-op threads (None: torch's default, one per core). 1 by default: the
    reference models gain little from more, and when several engines (or other processes) share
    a few cores, OpenMP's spinning threads slow every forward down 10-30x."""
    host: str = "127.0.0.1"
    """HTTP listen address (loopback unless configured)."""
    port: int = 30000
    """HTTP port."""
    page_size: int = 16
    """Tokens per KV page (= prefix-cache block size)."""
    num_pages: int | None = None
    """KV pool capacity in pages; None: as many as fit in 1 GiB, at most 4096 (tiny: 4096 pages
    = 64 MiB; bench: 512 pages = 8192 tokens of 128 KiB)."""
    max_batch_tokens: int = 512
    """Token budget of one scheduler step (decode tokens plus prefill chunks)."""
    max_running: int = 256
    """Requests admitted at once."""
    enable_prefix_cache: bool = True
    """Reuse cached prefix blocks (and publish KV events about them)."""
    host_pages: int = 0
    """The prefix cache's host tier in blocks: evicted blocks are copied to host memory and back
    on a hit, and published with medium ``CPU`` (0: evicted blocks are dropped)."""
    kv_events: str | None = None
    """KV-event PUB endpoint (e.g. tcp://127.0.0.1:5557); None disables publishing."""
    kv_events_replay: str | None = None
    """KV-event replay ROUTER endpoint (always bound); None disables replay."""
    kv_events_topic: str = ""
    """Topic frame of KV-event messages."""
    max_request_bytes: int = 8 << 20
    """Largest HTTP request body accepted (413 beyond). A few MiB covers any prompt the models'
    positions allow; a bigger limit only lets one client make the server buffer and parse more."""
    read_timeout_s: float = READ_TIMEOUT_S
    """Seconds a client may take to send a request head, and then its body (408 beyond): a
    slower one (slowloris) is cut off. Also the prefill's bootstrap server's bound."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not available; choose one of {list(MODES)}")
        if self.model is None and self.model_path is None:
            self.model = "tiny"
        _ = self.spec  # resolves the name or path now: a bad one fails at start, naming it
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.torch_threads == 0:
            self.torch_threads = None
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1 (or 0 for torch's default), got "
                             f"{self.torch_threads}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.num_pages is None:
            page_bytes = self.model_config.kv_bytes_per_token * self.page_size
            self.num_pages = max(1, min(DEFAULT_MAX_PAGES, DEFAULT_KV_BYTES // page_bytes))
        if self.host_pages < 0:
            raise ValueError(f"host_pages must be >= 0, got {self.host_pages}")
        for name in ("page_size", "num_pages", "max_batch_tokens", "max_running",
                     "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for ep in (self.kv_events, self.kv_events_replay):
            if ep is not None:
                parse_tcp(ep)
        check_read_timeout(self.read_timeout_s)

    @property
    def spec(self) -> ModelSpec:
        """The resolved model (geometry, checkpoint, served name, tokenizer source)."""
        return _resolve(self.model, self.model_path, self.model_seed, self.dtype)

    @property
    def model_config(self) -> ModelConfig:
        return self.spec.config

    def check_tp(self, tp: int) -> None:
        """ValueError unless ``tp`` ranks can split the model's KV heads."""
        check_tp(self.model_config, tp)

    @property
    def kv_pages(self) -> int:
        """The pool capacity in pages (``num_pages`` after defaults were applied)."""
        assert self.num_pages is not None
        return self.num_pages

    @property
    def model_name(self) -> str:
        """The name clients see and the etcd record carries."""
        return self.served_model_name or self.spec.served_name

    @property
    def model_names(self) -> frozenset[str]:
        """Names an OpenAI request may give in ``model``: the served name, the checkpoint's and
        the name or alias it was started with."""
        names = {self.model_name, self.spec.served_name, self.spec.config.name}
        if self.model is not None:
            names.add(self.model)
        return frozenset(names)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        d = cls
        parser.add_argument("--mode", default=d.mode, choices=["monolithic", "prefill", "decode"],
                            help="serving mode (prefill/decode: PD data plane)")
        parser.add_argument("--model", default=None,
                            help=f"what to serve (default tiny): {supported_models()}")
        parser.add_argument("--model-seed", type=int, default=d.model_seed,
                            help="weight seed of a seeded config")
        parser.add_argument("--served-model-name", default=None,
                            help="name clients use (default: the checkpoint's)")
        parser.add_argument("--model-path", default=None,
                            help="checkpoint to serve (a Llama/Qwen2/Qwen3 directory with "
                                 "config.json and *.safetensors, or a .gguf); with a seeded "
                                 "--model, the directory reported as model_path")
        parser.add_argument("--dtype", default=None,
                            help="compute and KV dtype (default: float32 for a checkpoint)")
        parser.add_argument("--device", default=d.device, help="torch device: cpu, cuda, cuda:N")
        parser.add_argument("--torch-threads", type=int, default=d.torch_threads,
                            help="torch intra-op threads (default 1; 0 = torch's default)")
        parser.add_argument("--host", default=d.host, help="HTTP listen address")
        parser.add_argument("--port", type=int, default=d.port, help="HTTP port")
        parser.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
        parser.add_argument("--num-pages", type=int, default=None,
                            help="KV pool pages (default: what fits in 1 GiB, at most 4096)")
        parser.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens,
                            help="token budget per scheduler step")
        parser.add_argument("--max-running", type=int, default=d.max_running,
                            help="requests admitted at once")
        parser.add_argument("--host-pages", type=int, default=0,
                            help="prefix-cache host tier in blocks: evicted blocks move to host "
                                 "memory and come back on a hit (default 0: off)")
        parser.add_argument("--disable-prefix-cache", action="store_true",
                            help="never reuse cached prefix blocks")
        parser.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                            help="publish KV events on this ZMQ endpoint (vLLM wire format)")
        parser.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                            help="KV-event replay ROUTER endpoint")
        parser.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                            help="largest HTTP request body accepted (413 beyond)")
        parser.add_argument("--kv-events-topic", default=d.kv_events_topic,
                            help="KV-event topic frame")
        parser.add_argument("--read-timeout", type=float, default=d.read_timeout_s,
                            help="seconds a client may take to send a request head, and then "
                                 f"its body (default {d.read_timeout_s:g})")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineServerConfig:
        return cls(mode=args.mode, model=args.model, model_seed=args.model_seed,
                   served_model_name=args.served_model_name, model_path=args.model_path,
                   dtype=args.dtype,
                   device=args.device, torch_threads=args.torch_threads, host=args.host,
                   port=args.port, page_size=args.page_size, num_pages=args.num_pages,
                   max_batch_tokens=args.max_batch_tokens, max_running=args.max_running,
                   enable_prefix_cache=not args.disable_prefix_cache, kv_events=args.kv_events,
                   host_pages=args.host_pages,
                   kv_events_replay=args.kv_events_replay, kv_events_topic=args.kv_events_topic,
                   max_request_bytes=args.max_request_bytes,
                   read_timeout_s=args.read_timeout)


@functools.lru_cache(maxsize=16)
def _resolve(model: str | None, model_path: str | None, seed: int, dtype: str | None
             ) -> ModelSpec:
    # cached: configs are copied (dataclasses.replace) and asked for their model often, and a
    # checkpoint's metadata is read from disk
    return resolve_model(model, model_path, seed=seed, dtype=dtype)
