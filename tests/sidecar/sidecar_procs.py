"""Real processes for the sidecar tests: kvatlas engines in standalone mode (as SGLang runs: the
bootstrap directory in the prefill process, KV events published over ZMQ, no etcd of their
own), a ``kvatlas sidecar`` beside each, and a router that finds them through etcd.

Every process runs in its own process group (an engine's rank processes included) and is killed
on teardown; ports are free loopback ports.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from waiting import wait_until_sync

from kvatlas.etcd_proc import free_port, free_ports

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
PAGE = 16


def get_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (urllib.error.URLError, OSError):
        return None


class Spawned:
    """One process (group) with its log in a temporary file."""

    def __init__(self, name: str, args: list[str], program: list[str] | None = None) -> None:
        """``program``: what runs ``args`` (default ``python -m kvatlas``)."""
        self.name = name
        self.args = args
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("KVATLAS_LOG_LEVEL", "WARNING")
        self.log = tempfile.NamedTemporaryFile(prefix=f"kvatlas-{name}-", suffix=".log",
                                               delete=False)
        program = program or [sys.executable, "-m", "kvatlas"]
        self.proc = subprocess.Popen([*program, *args], cwd=ROOT,
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def output(self, tail: int = 6000) -> str:
        path = Path(self.log.name)
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_http(self, url: str, timeout: float = 90.0) -> None:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n"
                                     f"{self.output()}")
            return get_status(url) == 200

        wait_until_sync(up, what=f"{self.name} answers 200 at {url}", timeout=timeout,
                        interval=0.2, detail=self.output)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def stop(self) -> None:
        """SIGTERM the group (a clean shutdown), then make sure nothing is left."""
        self.kill(signal.SIGTERM)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


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


class Router(Spawned):
    def __init__(self, etcd: str, prefix: str, *extra: str) -> None:
        self.port = free_port()
        super().__init__("router", [
            "router", "serve", "--host", "127.0.0.1", "--port", str(self.port), "--etcd", etcd,
            "--etcd-prefix", prefix, "--policy", "kv_aware", "--block-size", str(PAGE),
            "--health-check-interval-secs", "1", "--request-timeout-secs", "30", *extra])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
