"""Retries of a decode's timeouts (408, 504): a new pair and a new room each attempt; and none
once a stream's first byte went to the client."""
from __future__ import annotations

from typing import Any

import pytest


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status", [408, 504])
async def test_a_decode_timeout_is_retried_on_a_fresh_pair_and_room(
        status: int, stream: bool, stubs: Any, make_router: Any) -> None:
    prefills, decodes = await stubs("prefill", 2), await stubs("decode", 2)
    for d in decodes:
        d.statuses = [status]  # each decode times out once
    client = await make_router(prefills, decodes)
    resp = await client.post("/generate", json={"text": "late", "stream": stream})
    assert resp.status == 200
    data = await resp.read()
    assert data.endswith(b"data: [DONE]\n\n") if stream else b"from decode" in data
    # The decode that failed was avoided by the next attempt: both were asked, three times
    # in all, each attempt with its own room, the same on both halves of the pair.
    assert sorted(len(d.bodies) for d in decodes) == [1, 2]
    decode_rooms = [r for d in decodes for r in d.rooms]
    prefill_rooms = [r for p in prefills for r in p.rooms]
    assert len(set(decode_rooms)) == 3 and set(prefill_rooms) == set(decode_rooms)
    assert await client.metric_lines("kvatlas_router_retries_total") == [
        'kvatlas_router_retries_total{route="/generate"} 2.0']


async def test_no_retry_once_a_stream_has_begun(stubs: Any, make_router: Any) -> None:
    (p,), decodes = await stubs("prefill"), await stubs("decode", 2)
    for d in decodes:
        d.fail_stream_after_first = True
    client = await make_router([p], decodes)
    resp = await client.post("/generate", json={"text": "cut", "stream": True})
    assert resp.status == 200
    try:
        data = await resp.content.read()
    except Exception:  # noqa: BLE001 - a cut stream may surface as a payload error
        data = b""
    assert b"tok1" not in data and b"[DONE]" not in data
    assert sum(len(d.bodies) for d in decodes) == 1 and len(p.bodies) == 1
    assert await client.metric_lines("kvatlas_router_retries_total") == []
    # A decode that breaks its stream did fail (unlike a client hanging up).
    assert await client.metric_lines("kvatlas_router_upstream_errors_total") == [
        'kvatlas_router_upstream_errors_total{reason="stream",role="decode"} 1.0']
