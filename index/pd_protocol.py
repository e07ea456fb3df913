"""The PD protocol of a prefill or decode instance: how a router tells the pair to move KV.

Two protocols are in wide use, and a router drives a pair only when both halves speak the same:

- ``sglang`` (the default, a record field ``pd_protocol: null``): SGLang's bootstrap. The router
  sends both halves the same body with ``bootstrap_host``/``bootstrap_port``/``bootstrap_room``;
  the decode finds the prefill's ranks through its bootstrap server, keyed by the room.
- ``vllm``: vLLM's ``kv_transfer_params`` (NixlConnector), in one of two modes that refuse each
  other, so a pair's halves must also agree on the mode:

  - ``pull``: the router sends the prefill ``do_remote_decode`` and waits for its answer, whose
    ``kv_transfer_params`` (engine id, block ids, side channel, TP size) it passes to the
    decode, which reads the blocks;
  - ``push``: both requests go at once; the decode's names the prefill in advance
    (``remote_engine_id``, ``remote_host``/``remote_port``, ``tp_size``), so the router must know
    them before it sends: they are this record's ``engine_id``, ``host``, ``port``, ``tp_size``.

For vLLM, ``host``/``port`` are the NIXL side channel (``VLLM_NIXL_SIDE_CHANNEL_HOST`` and
``_PORT``), not the HTTP port; for kvatlas's reference engine they are its bootstrap server,
where decodes find its transfer ranks. JSON form::

    {"name": "vllm", "mode": "push", "engine_id": "...", "host": "...", "port": 5600,
     "tp_size": 1}
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from index.errors import IndexLayerError

SGLANG, VLLM = "sglang", "vllm"
PROTOCOLS = (SGLANG, VLLM)
PULL, PUSH = "pull", "push"
VLLM_MODES = (PULL, PUSH)

# --- vLLM's wire, as every kvatlas part that speaks it (router, engine, doctor) writes it -----
KV_PARAMS = "kv_transfer_params"
"""The request and answer field vLLM's connector reads and writes."""
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""What a prefill is told, in both modes: compute the prompt and keep its blocks for a remote
decode (vLLM's own proxy sends exactly these)."""
CONNECTORS = {PULL: "NixlConnector", PUSH: "NixlPushConnector"}
"""The engine's ``kv_connector`` of each mode (``--kv-transfer-config``)."""
NIXL_PORT = 5600
"""vLLM's default side-channel port (``VLLM_NIXL_SIDE_CHANNEL_PORT``)."""


class ProtocolFieldError(IndexLayerError, ValueError):
    """One of a ``PDProtocol``'s fields is bad: ``field`` names it, so that a caller can name
    its own flag or key for it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class PDProtocol:
    """One instance's PD protocol (see the module docstring)."""

    name: str = SGLANG
    """``sglang`` or ``vllm``."""
    mode: str | None = None
    """vLLM only: ``pull`` (the default) or ``push``."""
    engine_id: str | None = None
    """vLLM prefill: its connector's engine id (``remote_engine_id``)."""
    host: str | None = None
    """vLLM prefill: where decodes reach its transfer side channel (``remote_host``)."""
    port: int | None = None
    """vLLM prefill: the side channel's port (``remote_port``)."""
    tp_size: int | None = None
    """vLLM prefill: the TP size decodes map their ranks onto (``tp_size``)."""

    def __post_init__(self) -> None:
        if self.name not in PROTOCOLS:
            raise ValueError(f"name must be one of {list(PROTOCOLS)}, got {self.name!r}")
        if self.name == SGLANG:
            if any(v is not None for v in (self.mode, self.engine_id, self.host, self.port,
                                           self.tp_size)):
                raise ValueError("sglang's bootstrap takes no mode, engine_id, host, port or "
                                 "tp_size (they are vLLM's)")
            return
        mode = PULL if self.mode is None else self.mode
        if mode not in VLLM_MODES:
            raise ValueError(f"mode must be one of {list(VLLM_MODES)}, got {mode!r}")
        object.__setattr__(self, "mode", mode)
        for name in ("engine_id", "host"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ProtocolFieldError(name, f"{name} must be a non-empty string or null, "
                                         f"got {v!r}")
        for name, lo, hi in (("port", 1, 65535), ("tp_size", 1, 1 << 16)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)
                                  or not lo <= v <= hi):
                raise ProtocolFieldError(name, f"{name} must be an integer in [{lo}, {hi}] "
                                         f"or null, got {v!r}")

    @property
    def pair_key(self) -> tuple[str, str | None]:
        """A prefill and a decode form a pair only when their keys are equal."""
        return self.name, self.mode

    @property
    def label(self) -> str:
        """``sglang``, ``vllm-pull`` or ``vllm-push``: for metrics, explanations and the CLI."""
        return self.name if self.mode is None else f"{self.name}-{self.mode}"

    def push_params(self, remote_request_id: str, pp_size: int = 1) -> dict[str, Any]:
        """A push-mode decode's ``kv_transfer_params`` naming this prefill before it has
        computed anything; ``remote_request_id``: the prefill's base request id
        (``cmpl-<X-Request-Id>``)."""
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.engine_id, "remote_host": self.host,
                "remote_port": self.port, "tp_size": self.tp_size,
                "remote_request_id": remote_request_id, "pp_size": pp_size}

    def missing_identity(self) -> list[str]:
        """What a push-mode prefill still lacks for a router to name it in advance."""
        if self.name != VLLM or self.mode != PUSH:
            return []
        return [n for n in ("engine_id", "host", "port", "tp_size") if getattr(self, n) is None]

    def to_dict(self) -> dict[str, Any] | None:
        """The record's JSON value: None for SGLang's bootstrap (what every older record
        means)."""
        if self.name == SGLANG:
            return None
        return {"name": self.name, "mode": self.mode, "engine_id": self.engine_id,
                "host": self.host, "port": self.port, "tp_size": self.tp_size}

    @classmethod
    def from_dict(cls, doc: Any) -> PDProtocol:
        """The record's value parsed; ValueError saying what is wrong."""
        if doc is None:
            return SGLANG_BOOTSTRAP
        if not isinstance(doc, dict):
            raise ValueError(f"must be an object or null, got {type(doc).__name__}")
        # Fields a newer writer added are not refused (nor kept): the pair is driven on these.
        known = ("name", "mode", "engine_id", "host", "port", "tp_size")
        return cls(**{k: doc.get(k) for k in known if k != "name"},
                   name=doc.get("name", SGLANG))

    @classmethod
    def parse(cls, text: str) -> PDProtocol:
        """A command line's value: ``sglang``, ``vllm`` (pull), ``vllm-pull`` or
        ``vllm-push``; ValueError naming the choices."""
        name, _, mode = text.partition("-")
        try:
            return cls(name, mode or None)
        except ValueError:
            raise ValueError(f"PD protocol must be sglang, vllm, vllm-pull or vllm-push, "
                             f"got {text!r}") from None


SGLANG_BOOTSTRAP = PDProtocol()
CHOICES = ("sglang", "vllm", "vllm-pull", "vllm-push")
"""What ``PDProtocol.parse`` takes (for argparse ``choices``)."""
