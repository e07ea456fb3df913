"""Real ``kvatlas engine serve --mode prefill|decode`` processes for the PD tests: each in its own
process group (its rank processes included), killed on teardown."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests_shim as http

from kvatlas.etcd_proc import free_ports

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("KVATLAS_LOG_LEVEL", "WARNING")
    return env


class Proc:
    def __init__(self, mode: str, *extra: str, model: str = "tiny") -> None:
        self.mode = mode
        self.port, bport = free_ports(2)
        self.bport = bport if mode == "prefill" else None
        args = [sys.executable, "-m", "kvatlas", "engine", "serve", "--mode", mode,
                "--model", model, "--host", "127.0.0.1", "--port", str(self.port),
                "--num-pages", "1024", "--transfer-heartbeat-interval", "0.3",
                "--transfer-waiting-timeout", "30", "--transfer-bootstrap-timeout", "30"]
        if self.bport:
            args += ["--bootstrap-port", str(self.bport)]
        self.log = tempfile.NamedTemporaryFile(prefix=f"kvatlas-{mode}-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen([*args, *extra], cwd=ROOT, env=_env(), stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        path = Path(self.log.name)
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.bport}/ready" if self.bport else self.url + "/health"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.mode} exited with {self.proc.returncode}:\n"
                                     f"{self.output()}")
            if http.get_status(url) == 200 and http.get_status(self.url + "/health") == 200:
                return
            time.sleep(0.2)
        raise AssertionError(f"{self.mode} not ready within {timeout} s:\n{self.output()}")

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


@contextlib.contextmanager
def proc_pair(*extra: str, prefill_extra: tuple[str, ...] = (),
              decode_extra: tuple[str, ...] = ()) -> Iterator[tuple[Proc, Proc]]:
    """A ready prefill and decode process (``extra`` flags for both), stopped on exit."""
    prefill = Proc("prefill", *extra, *prefill_extra)
    decode = Proc("decode", *extra, *decode_extra)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


async def internal_states(session: Any, url: str) -> dict[str, Any]:
    """The worker's scheduler and pool accounting, as its /server_info reports it."""
    async with session.get(url + "/server_info") as r:
        return (await r.json())["internal_states"][0]


async def assert_at_rest(session: Any, *urls: str) -> None:
    """Nothing queued, running or held, no page in use or referenced, on every worker."""
    for url in urls:
        st = await internal_states(session, url)
        assert (st["running"], st["waiting"], st["kv_pages_used"], st["kv_page_refs"],
                st["held_requests"]) == (0, 0, 0, 0, 0), (url, st)
