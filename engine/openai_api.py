"""OpenAI-compatible endpoints: ``/v1/completions``, ``/v1/chat/completions`` (SSE streams end
with ``data: [DONE]``) and ``/v1/models``."""
from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from engine.http_common import (
    check_fits,
    collect_outputs,
    read_body,
    sse_end,
    sse_response,
    sse_send,
    state,
    until_disconnected,
)
from engine.protocol import check_model, include_usage, parse_chat, parse_completion
from engine.scheduler import RequestOutput


def finish_reason(out: RequestOutput) -> str:
    kind = (out.finish_reason or {}).get("type")
    return {"stop": "stop", "length": "length"}.get(str(kind), "abort")


def matched_stop(out: RequestOutput) -> int | str | None:
    return (out.finish_reason or {}).get("matched")  # type: ignore[return-value]


def usage(out: RequestOutput) -> dict[str, Any]:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    st = state(request)
    body = await read_body(request)
    gi, stream = (parse_chat if chat else parse_completion)(body, st.model, st.tokenizer)
    check_model(body, st.config.model_names)
    check_fits(st, gi)
    rid = gi.rid = openai_rid(chat)
    return await respond(request, st.engine.generate(gi.prompt, gi.params, rid), rid=rid,
                         model=st.config.model_name, stream=stream,
                         with_usage=include_usage(body) if stream else False, chat=chat)


def openai_rid(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


async def respond(request: web.Request, outputs: AsyncIterator[RequestOutput], *,
                  rid: str, model: str, stream: bool, with_usage: bool, chat: bool
                  ) -> web.StreamResponse:
    """An OpenAI answer (one JSON object, or an SSE stream) from a request's ``outputs``,
    whichever engine path makes them: the monolithic engine's, or a PD decode's."""
    base = {"id": rid, "created": int(time.time()), "model": model}
    if stream:
        return await _stream(request, outputs, base, with_usage, chat)
    ids, text, out = await until_disconnected(request, collect_outputs(outputs))
    if chat:
        choice: dict[str, Any] = {"index": 0,
                                  "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": finish_reason(out),
                                  "matched_stop": matched_stop(out)}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None,
                  "finish_reason": finish_reason(out), "matched_stop": matched_stop(out)}
        obj = "text_completion"
    return web.json_response({**base, "object": obj, "choices": [choice], "usage": usage(out)})


async def _stream(request: web.Request, outputs: AsyncIterator[RequestOutput],
                  base: dict[str, Any], with_usage: bool, chat: bool) -> web.StreamResponse:
    resp = await sse_response(request)
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | dict[str, Any], reason: str | None) -> dict[str, Any]:
        if chat:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}
        return {**base, "object": obj, "choices": [choice]}

    if chat:
        await sse_send(resp, chunk({"role": "assistant", "content": ""}, None))
    last: RequestOutput | None = None
    async with contextlib.aclosing(outputs) as gen:
        async for out in gen:
            last = out
            if out.error:
                await sse_send(resp, {"error": {"message": out.error, "type": "server_error"}})
                break
            reason = finish_reason(out) if out.finished else None
            if out.text_delta or reason:
                delta: str | dict[str, Any] = (
                    ({"content": out.text_delta} if out.text_delta else {}) if chat
                    else out.text_delta)
                await sse_send(resp, chunk(delta, reason))
    if with_usage and last is not None:
        await sse_send(resp, {**base, "object": obj, "choices": [], "usage": usage(last)})
    await sse_end(resp)
    return resp


async def models(request: web.Request) -> web.Response:
    st = state(request)
    return web.json_response({"object": "list", "data": [{
        "id": st.config.model_name, "object": "model", "created": int(st.started),
        "owned_by": "kvatlas", "root": st.model_path, "max_model_len": st.model.max_positions}]})
