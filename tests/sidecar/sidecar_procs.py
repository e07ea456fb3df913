"""Real processes for the sidecar tests: kvatlas engines in standalone mode (as SGLang runs: the
bootstrap directory in the prefill process, KV events published over ZMQ, no etcd of their
own) and a ``kvatlas sidecar`` beside each; the router that finds them through etcd is
``spawned.Router``.

Every process runs in its own process group (an engine's rank processes included) and is killed
on teardown; ports are free loopback ports.
"""
from __future__ import annotations

from pathlib import Path

from spawned import Router, Spawned

from kvatlas.etcd_proc import free_ports

__all__ = ["MODEL", "PAGE", "ROOT", "Engine", "Router", "Spawned", "sidecar"]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
PAGE = 16


class Engine(Spawned):
    """A standalone kvatlas prefill or decode (no etcd)."""

    def __init__(self, mode: str, name: str, *extra: str) -> None:
        self.mode = mode
        http, bport, events, replay = free_ports(4)
        self.port = http
        self.bport = bport if mode == "prefill" else None
        self.events = f"tcp://127.0.0.1:{events}" if mode == "prefill" else None
        # With replay, events a sidecar missed (ZMQ's slow joiner) are asked for again rather
        # than taken as lost, as a deployment should run it.
        self.replay = f"tcp://127.0.0.1:{replay}" if mode == "prefill" else None
        args = ["engine", "serve", "--mode", mode, "--model", MODEL, "--host", "127.0.0.1",
                "--port", str(self.port), "--num-pages", "1024", "--page-size", str(PAGE),
                "--instance-id", name, "--transfer-heartbeat-interval", "0.3",
                "--transfer-waiting-timeout", "20", "--transfer-bootstrap-timeout", "20"]
        if mode == "prefill":
            args += ["--bootstrap-port", str(self.bport), "--kv-events", str(self.events),
                     "--kv-events-replay", str(self.replay)]
        super().__init__(name, [*args, *extra])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def bootstrap_url(self) -> str:
        return f"http://127.0.0.1:{self.bport}"

    def wait_ready(self, timeout: float = 90.0) -> None:
        if self.bport is not None:
            self.wait_http(f"{self.bootstrap_url}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
                           "&target_tp_rank=-1&target_pp_rank=-1", timeout)
        self.wait_http(f"{self.url}/health", timeout)


def sidecar(engine: Engine, etcd: str, prefix: str, *extra: str) -> Spawned:
    """``kvatlas sidecar`` beside ``engine`` (its KV events bound where the engine connects)."""
    args = ["sidecar", "--instance-id", engine.name, "--role", engine.mode, "--engine-url",
            engine.url, "--model", MODEL, "--etcd", etcd, "--etcd-prefix", prefix,
            "--lease-ttl", "3", "--unhealthy-grace", "2"]
    if engine.mode == "prefill":
        args += ["--bootstrap-url", engine.bootstrap_url, "--kv-events", str(engine.events),
                 "--replay", str(engine.replay)]
    return Spawned(f"sidecar-{engine.name}", [*args, *extra])
