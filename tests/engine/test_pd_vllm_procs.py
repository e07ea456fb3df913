"""vLLM's PD contract on real ``kvatlas engine serve`` processes: vLLM's own test proxy
(``toy_proxy_server.py``, fetched unchanged) drives a pull pair. Greedy output through a pair
driven by kvatlas's router process, and the records that say ``pd_protocol``:
test_pd_vllm_router.py."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp
import pytest
from engine_helpers import shared_prefix_prompts
from pd_helpers import monolithic
from pd_procs import proc_pair
from spawned import Spawned
from vllm_pd_client import at_rest, body_of, texts_of
from waiting import wait_until

from kvatlas.etcd_proc import free_port
from tests.peers.vllm_proxy import fetch as fetch_proxy

pytestmark = pytest.mark.timeout(300)


async def test_vllms_toy_proxy_drives_a_pull_pair() -> None:
    proxy: Path = fetch_proxy()  # make test fetches it; never skipped
    prompts = shared_prefix_prompts(8, seed=33, n_bases=2, base_len=(20, 40))
    want = monolithic(prompts, [4] * len(prompts))
    with proc_pair("--pd-protocol", "vllm") as (p, d):
        port = free_port()
        toy = Spawned("vllm-toy-proxy", [
            "--port", str(port), "--prefiller-hosts", "127.0.0.1", "--prefiller-ports",
            str(p.port), "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(d.port)],
            program=[sys.executable, str(proxy)])
        try:
            url = f"http://127.0.0.1:{port}"
            toy.wait_http(f"{url}/healthcheck", 60)
            async with aiohttp.ClientSession() as s:
                async def one(ids: list[int]) -> str:
                    async with s.post(url + "/v1/completions", json=body_of(ids, 4)) as r:
                        doc = await r.json(content_type=None)
                        assert r.status == 200, doc
                    return str(doc["choices"][0]["text"])
                got = await asyncio.gather(*(one(ids) for ids in prompts))
                assert got == texts_of(want)
                chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                        "temperature": 0, "stream": True}
                async with s.post(url + "/v1/chat/completions", json=chat) as r:
                    raw = await r.text()
                    assert r.status == 200 and raw.rstrip().endswith("data: [DONE]"), raw
                await wait_until(lambda: at_rest(s, p.url, d.url), what="both halves at rest")
        finally:
            toy.stop()
