"""Real ``kvatlas engine serve --mode prefill|decode`` processes for the PD tests (``Spawned``):
each in its own process group (its rank processes included), killed on teardown."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from spawned import Spawned

from kvatlas.etcd_proc import free_ports

ROOT = Path(__file__).resolve().parents[2]


class Proc(Spawned):
    """``kvatlas engine serve --mode prefill|decode`` on free loopback ports."""

    def __init__(self, mode: str, *extra: str, model: str = "tiny") -> None:
        self.mode = mode
        self.port, bport = free_ports(2)
        self.bport = bport if mode == "prefill" else None
        args = ["engine", "serve", "--mode", mode, "--model", model, "--host", "127.0.0.1",
                "--port", str(self.port), "--num-pages", "1024",
                "--transfer-heartbeat-interval", "0.3", "--transfer-waiting-timeout", "30",
                "--transfer-bootstrap-timeout", "30"]
        if self.bport:
            args += ["--bootstrap-port", str(self.bport)]
        super().__init__(mode, [*args, *extra])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 90) -> None:
        if self.bport:
            self.wait_http(f"http://127.0.0.1:{self.bport}/ready", timeout)
        self.wait_http(self.url + "/health", timeout)


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
