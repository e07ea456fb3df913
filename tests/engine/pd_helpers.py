"""Helpers of the PD tests: in-process prefill/decode pairs, router-style dual dispatch, and the
monolithic reference tokens."""
from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from yarl import URL

from engine.pd.config import PDConfig
from engine.pd.decode import DECODE_KEY, create_decode_app
from engine.pd.prefill import PREFILL_KEY
from engine.pd.prefill_app import create_prefill_app
from engine.runner import build_scheduler, run_to_completion
from engine.sampling import SamplingParams
from engine.scheduler import Request
from engine.serve_config import EngineServerConfig
from kvatlas.etcd_proc import free_port
from transfer import TransferConfig


def fast_transfer(**over: Any) -> TransferConfig:
    return TransferConfig(**{"bootstrap_timeout_s": 15.0, "waiting_timeout_s": 15.0,
                             "connect_timeout_s": 3.0, "heartbeat_interval_s": 0.3, **over})


def pd_config(mode: str, *, bootstrap_port: int | None = None, model: str = "tiny",
              page_size: int = 16, num_pages: int = 512, transfer: TransferConfig | None = None,
              **over: Any) -> PDConfig:
    eng = EngineServerConfig(mode=mode, model=model, page_size=page_size, num_pages=num_pages,
                             port=free_port(), max_batch_tokens=256)
    return PDConfig(engine=eng, bootstrap_port=bootstrap_port or free_port(),
                    transfer=transfer or fast_transfer(), **over)


def monolithic(prompts: list[list[int]], max_new: list[int], model: str = "tiny"
               ) -> list[list[int]]:
    """Greedy tokens of the one-process engine (the reference)."""
    from engine.config import get_model_config

    sched = build_scheduler(get_model_config(model), num_pages=2048)
    reqs = [Request(f"m{i}", list(p), SamplingParams(max_new_tokens=n, temperature=0.0,
                                                     ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, max_new))]
    done = run_to_completion(sched, reqs)
    return [done[r.rid].output_ids for r in reqs]


_rooms = random.Random(12345)


def new_room() -> int:
    return _rooms.randrange(1, 2**63 - 1)


def pd_body(ids: list[int], max_new: int, bport: int, room: int | None = None,
            stream: bool = False) -> dict[str, Any]:
    return {"input_ids": ids, "stream": stream,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0,
                                "ignore_eos": True},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bport,
            "bootstrap_room": room if room is not None else new_room()}


async def dual(session: Any, prefill_url: str, decode_url: str, body: dict[str, Any]
               ) -> tuple[tuple[int, Any], tuple[int, Any]]:
    """What the router does: the same body to prefill and decode at once."""
    async def post(url: str) -> tuple[int, Any]:
        async with session.post(url + "/generate", json=body) as r:
            if body.get("stream") and r.status == 200 and url == decode_url:
                return r.status, await r.text()
            return r.status, await r.json()
    p, d = await asyncio.gather(post(prefill_url), post(decode_url))
    return p, d


class Pair:
    def __init__(self, prefill: TestServer, decode: TestServer, bport: int) -> None:
        self.prefill, self.decode, self.bport = prefill, decode, bport
        self.p_url = str(prefill.make_url("")).rstrip("/")
        self.d_url = str(decode.make_url("")).rstrip("/")

    @property
    def ps(self) -> Any:
        return self.prefill.app[PREFILL_KEY]

    @property
    def ds(self) -> Any:
        return self.decode.app[DECODE_KEY]


class PlainServer:
    """An app behind aiohttp's default runner (``web.AppRunner``), which, unlike TestServer,
    does not cancel a handler whose client hung up."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.port = free_port()
        self._runner = web.AppRunner(app)

    async def start_server(self) -> None:
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def make_url(self, path: str) -> URL:
        return URL(f"http://127.0.0.1:{self.port}{path}")

    async def close(self) -> None:
        await self._runner.cleanup()


async def start_pair(decode_over: dict[str, Any] | None = None,
                     prefill_over: dict[str, Any] | None = None,
                     plain_runner: bool = False) -> Pair:
    pcfg = pd_config("prefill", **(prefill_over or {}))
    dcfg = pd_config("decode", **(decode_over or {}))
    if plain_runner:
        prefill: Any = PlainServer(create_prefill_app(pcfg))
        decode: Any = PlainServer(create_decode_app(dcfg))
    else:
        prefill = TestServer(create_prefill_app(pcfg), host="127.0.0.1")
        decode = TestServer(create_decode_app(dcfg), host="127.0.0.1")
    await prefill.start_server()
    await decode.start_server()
    return Pair(prefill, decode, pcfg.bootstrap_port)


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    p = await start_pair()
    try:
        yield p
    finally:
        await p.decode.close()
        await p.prefill.close()
