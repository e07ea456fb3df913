"""vLLM's PD contract end to end through a real ``kvatlas router serve`` process: the reference
engines serve ``--pd-protocol vllm-pull|vllm-push`` and register with ``--etcd`` (the prefill's
record naming the NIXL identity a push router needs), the router finds them only through etcd,
and greedy output equals monolithic for TP (1,1) and (2,1), shared prefixes, many in flight;
the index holds the prefill's blocks from its KV events."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from engine_helpers import shared_prefix_prompts, wait_indexed
from pd_helpers import monolithic
from pd_procs import proc_pair
from spawned import Router
from vllm_pd_client import at_rest, body_of, texts_of
from waiting import wait_until

from index.keys import KeyLayout
from index.record import InstanceRecord

pytestmark = pytest.mark.timeout(300)


@contextlib.contextmanager
def router_proc(etcd: str, prefix: str) -> Iterator[str]:
    """A ``kvatlas router serve`` finding its workers through etcd only; its URL once ready."""
    router = Router(etcd, prefix, "--request-timeout-secs", "120")
    try:
        router.wait_ready(60)
        yield router.url
    finally:
        router.stop()


# One 100-prompt, 40-in-flight run per mode (TP (2,1)); TP (1,1) with a smaller set.
@pytest.mark.parametrize("mode", ["vllm-pull", "vllm-push"])
@pytest.mark.parametrize("tp,n,flight", [(1, 12, 6), (2, 100, 40)])
async def test_pair_through_the_router_equals_monolithic(
        etcd_endpoint: str, key_prefix: str, etcd: Any, mode: str, tp: int, n: int,
        flight: int) -> None:
    prompts = shared_prefix_prompts(n, seed=7 + tp, n_bases=4, base_len=(20, 60))
    max_new = [2 + i % 4 for i in range(n)]
    want = monolithic(prompts, max_new)
    iid = f"pre-{mode}-{tp}"
    common = ("--pd-protocol", mode, "--etcd", etcd_endpoint, "--etcd-prefix", key_prefix,
              "--lease-ttl", "5")
    with proc_pair(*common, prefill_extra=("--tp", str(tp), "--instance-id", iid),
                   decode_extra=("--instance-id", f"dec-{mode}-{tp}")) as (p, d), \
            router_proc(etcd_endpoint, key_prefix) as url:
        # The router found the pair through these: each record says the protocol, a push
        # prefill's with the identity the router names to the decode.
        layout = KeyLayout(prefix=key_prefix)
        pre, dec = [InstanceRecord.from_json((await etcd.get(layout.instance(i))).value)
                    for i in (iid, f"dec-{mode}-{tp}")]
        short = mode.split("-")[1]
        assert (pre.pd_protocol.name, pre.pd_protocol.mode) == ("vllm", short), pre
        if short == "push":
            assert pre.pd_protocol.to_dict() == {
                "name": "vllm", "mode": "push", "engine_id": iid, "host": "127.0.0.1",
                "port": p.bport, "tp_size": tp}
        assert dec.pd_protocol.to_dict() == {"name": "vllm", "mode": short, "engine_id": None,
                                             "host": None, "port": None, "tp_size": None}
        gate = asyncio.Semaphore(flight)
        async with aiohttp.ClientSession() as s:
            async def one(ids: list[int], k: int) -> str:
                async with gate, s.post(url + "/v1/completions", json=body_of(ids, k)) as r:
                    doc = await r.json(content_type=None)
                    assert r.status == 200, (doc, p.output(), d.output())
                return str(doc["choices"][0]["text"])
            got = await asyncio.gather(*(one(ids, k) for ids, k in zip(prompts, max_new)))
            assert got == texts_of(want)
            # The router drove the protocol (not a fallback): its vLLM PD counter saw each
            # request in this mode with the prefill's params (pull) or identity (push).
            async with s.get(url + "/metrics") as r:
                metrics = await r.text()
            label = f'mode="{short}",params="given"'
            counted = [line for line in metrics.splitlines()
                       if line.startswith("kvatlas_router_vllm_pd_requests_total")
                       and label in line]
            assert counted and sum(float(x.rsplit(" ", 1)[1]) for x in counted) == n, metrics
            await wait_until(lambda: at_rest(s, p.url, d.url), what="both halves at rest")
        # The prefill computed the prompts: its KV events put their blocks in the index.
        await wait_indexed(etcd, layout, iid, max(prompts, key=len))
