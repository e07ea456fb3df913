"""A minimal client of vLLM's PD wire contract (what a router does), for the vLLM-mode tests:
pull sends the prefill first and hands its ``kv_transfer_params`` to the decode; push sends both
at once, naming the prefill in advance. Also the bodies and checks those tests share."""
from __future__ import annotations

import asyncio
import uuid
from typing import Any

from pd_procs import assert_at_rest

from index.pd_protocol import PREFILL_PARAMS


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in body.items()
           if k not in ("stream_options", "min_tokens", "min_completion_tokens")}
    out.update(kv_transfer_params=dict(PREFILL_PARAMS), stream=False, max_tokens=1)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


async def post(session: Any, url: str, body: dict[str, Any], rid: str) -> tuple[int, Any]:
    async with session.post(url, json=body, headers={"X-Request-Id": rid}) as r:
        if body.get("stream") and r.status == 200:
            return r.status, await r.text()
        return r.status, await r.json()


async def pull(session: Any, p_url: str, d_url: str, body: dict[str, Any], chat: bool = False,
               rid: str | None = None) -> tuple[tuple[int, Any], tuple[int, Any]]:
    """(prefill's answer, decode's answer) of one request in pull mode."""
    rid = rid or uuid.uuid4().hex
    path = "/v1/chat/completions" if chat else "/v1/completions"
    p = await post(session, p_url + path, prefill_body(body), rid)
    if p[0] != 200:
        return p, (0, None)
    d = await post(session, d_url + path, {**body, "kv_transfer_params": p[1][
        "kv_transfer_params"]}, rid)
    return p, d


async def push(session: Any, p_url: str, d_url: str, body: dict[str, Any], *, engine_id: str,
               host: str, port: int, tp_size: int, chat: bool = False
               ) -> tuple[tuple[int, Any], tuple[int, Any]]:
    """(prefill's answer, decode's answer) of one request in push mode (both at once)."""
    rid = uuid.uuid4().hex
    path = "/v1/chat/completions" if chat else "/v1/completions"
    kv = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
          "remote_host": host, "remote_port": port, "tp_size": tp_size,
          "remote_request_id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "pp_size": 1}
    p, d = await asyncio.gather(post(session, p_url + path, prefill_body(body), rid),
                                post(session, d_url + path, {**body, "kv_transfer_params": kv},
                                     rid))
    return p, d


def body_of(ids: list[int], n: int, **more: Any) -> dict[str, Any]:
    """A greedy OpenAI completion body of ``n`` new tokens for prompt ``ids``."""
    return {"prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True, **more}


def texts_of(want: list[list[int]]) -> list[str]:
    """The monolithic tokens as the tiny model's tokenizer writes them (OpenAI answers are
    text)."""
    from engine.protocol import default_tokenizer
    tok = default_tokenizer()
    return [tok.decode(w) for w in want]


async def at_rest(s: Any, *urls: str) -> bool:
    """Whether every worker at ``urls`` is at rest (``pd_procs.assert_at_rest``), to wait on."""
    try:
        await assert_at_rest(s, *urls)
    except AssertionError:
        return False
    return True
