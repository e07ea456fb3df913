"""A sidecar-attached vLLM PD pair behind a real ``kvatlas router serve`` process: two stub vLLM
halves (tests/vllm_stub.py producer + consumer), a ``kvatlas sidecar --engine vllm --role
prefill|decode`` beside each writing their records to etcd, and the router finding them there.
Pull: the consumer is sent the producer's answered params (no recompute); push: the identity the
prefill's sidecar flags declared. The index holds the producer's blocks from its KV events."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from sidecar_procs import Router
from test_vllm_sidecar_pd import MODEL, PROMPT, PDProcs, records, seen, wait_prompt_indexed
from waiting import wait_until

from index.etcd import EtcdClient, EtcdSettings

pytestmark = pytest.mark.timeout(180)
ENGINE_ID = "prefill-engine-r"


@pytest.fixture
def stack(etcd_endpoint: str) -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for p in reversed(made):
        p.stop()


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_router_drives_a_sidecar_attached_vllm_pair(
        etcd_endpoint: str, etcd_settings: EtcdSettings, stack: list[Any], mode: str) -> None:
    flags = ("--pd-protocol", f"vllm-{mode}")
    p = PDProcs(etcd_endpoint, mode=mode, engine_id=ENGINE_ID, side_port=5621,
                prefill_car=(*flags, "--nixl-engine-id", ENGINE_ID, "--nixl-port", "5621",
                             "--tp-size", "1"),
                decode_car=flags)
    stack.append(p)
    async with EtcdClient(etcd_settings) as etcd:
        await wait_until(lambda: records(etcd, p), what="both sidecars write records",
                         detail=p.output)
        router = Router(etcd_endpoint, p.prefix, "--tokenizer", "byte")
        stack.append(router)
        router.wait_http(f"{router.url}/readiness", 60)

        n = 4
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            for i in range(n):
                body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5 + i,
                        "temperature": 0}
                async with s.post(router.url + "/v1/completions", json=body) as r:
                    doc = await r.json(content_type=None)
                    assert r.status == 200, (doc, router.output(), p.output())
                # The stub echoes the prompt: the decode's answer, relayed whole.
                assert doc["choices"][0]["text"] == PROMPT[:5 + i], doc

        produced = [r for r in await seen(p.purl) if r["path"] == "/v1/completions"]
        consumed = [r for r in await seen(p.durl) if r["path"] == "/v1/completions"]
        assert len(produced) == len(consumed) == n, (produced, consumed)
        for pre, dec in zip(produced, consumed):
            # One fresh request id per request, the same on both halves.
            assert pre["x_request_id"] == dec["x_request_id"], (pre, dec)
            assert pre["body"]["max_tokens"] == 1 and pre["body"]["stream"] is False
            assert pre["body"]["kv_transfer_params"]["do_remote_decode"] is True
            params = dec["body"]["kv_transfer_params"]
            assert params["do_remote_prefill"] is True and not dec["recomputed"], dec
            assert (params["remote_engine_id"], params["remote_host"],
                    params["remote_port"]) == (ENGINE_ID, "127.0.0.1", 5621), params
            if mode == "push":
                # Named in advance from the prefill's record (its sidecar's flags).
                assert params["tp_size"] == 1 and params["pp_size"] == 1, params
                assert params["remote_request_id"] == f"cmpl-{pre['x_request_id']}", params
            else:
                # The producer's answered params, verbatim: its own request id and blocks.
                assert params["remote_request_id"] == pre["request_id"], (params, pre)
                assert params["remote_block_ids"], params
                assert "remote_blocks_expiry_time" in params, params

        await wait_prompt_indexed(etcd, p, "vLLM producer")
