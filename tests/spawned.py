"""Real processes for tests, each in its own process group with its log in a temporary file:
``Spawned`` (any ``python -m kvatlas`` command) and ``Router`` (``kvatlas router serve``
finding its workers through etcd). Ports are free loopback ports; ``stop`` leaves nothing."""
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

from kvatlas.etcd_proc import free_port

ROOT = Path(__file__).resolve().parents[1]


def kvatlas_env() -> dict[str, str]:
    """The environment a spawned kvatlas process runs in: this checkout first on its path,
    warnings and worse logged unless the caller's environment says otherwise."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("KVATLAS_LOG_LEVEL", "WARNING")
    return env


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
        self.log = tempfile.NamedTemporaryFile(prefix=f"kvatlas-{name}-", suffix=".log",
                                               delete=False)
        program = program or [sys.executable, "-m", "kvatlas"]
        self.proc = subprocess.Popen([*program, *args], cwd=ROOT,
                                     env=kvatlas_env(), stdout=self.log, stderr=subprocess.STDOUT,
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


class Router(Spawned):
    """``kvatlas router serve`` (kv_aware) finding its workers through etcd; ``extra`` args
    come last, so they override the defaults."""

    def __init__(self, etcd: str, prefix: str, *extra: str, block_size: int = 16) -> None:
        self.port = free_port()
        super().__init__("router", [
            "router", "serve", "--host", "127.0.0.1", "--port", str(self.port), "--etcd", etcd,
            "--etcd-prefix", prefix, "--policy", "kv_aware", "--block-size", str(block_size),
            "--health-check-interval-secs", "1", "--request-timeout-secs", "30", *extra])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until ``/readiness`` is 200: a prefill and a decode (or an aggregated worker) were
        found in etcd."""
        self.wait_http(f"{self.url}/readiness", timeout)
