"""A PD request as items: one per prompt, each with its own bootstrap room.

A ``/generate`` carries one prompt or a batch; an OpenAI request (``/v1/completions``,
``/v1/chat/completions``) carries one prompt, as on SGLang's PD servers.

SGLang's router sends a batch to both halves with a list of ``bootstrap_room`` (and of host and
port, or one of each), one per prompt. A room binds one KV transfer, so each prompt is served
exactly like a single-prompt request of its own. Every item is validated before any starts;
they then run concurrently, and the answer is the list of their answers in order, or, when one
failed, that item's error naming its index: a batch answer is all or nothing.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from engine.errors import BadRequest
from engine.http_common import error_status, json_error, read_body, state
from engine.pd.common import Bootstrap, bootstrap_fields
from engine.protocol import (
    GenInput,
    check_model,
    include_usage,
    parse_chat,
    parse_completion,
    parse_generate,
)

PER_ITEM = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "rid")


@dataclass
class PDItem:
    """One prompt of a PD request, with its own bootstrap room."""

    body: dict[str, Any]
    """A single-prompt body (what a DP forward sends on)."""
    boot: Bootstrap
    gen: GenInput
    stream: bool


async def read_pd_items(request: web.Request) -> tuple[list[PDItem], bool]:
    """(items, is_batch) of a PD ``/generate``; BadRequest naming the field (and the batch
    item) when any item is malformed."""
    body = await read_body(request)
    st = state(request)
    bodies = split_batch(body)
    if bodies is None:
        return [_item(body, st.model, st.tokenizer)], False
    items = []
    for i, one in enumerate(bodies):
        try:
            items.append(_item(one, st.model, st.tokenizer))
        except BadRequest as exc:
            raise BadRequest(f"batch item {i}: {exc.field}", exc.reason) from None
    return items, True


async def read_openai_item(request: web.Request, chat: bool,
                           boot_of: Callable[[dict[str, Any]], Bootstrap] = bootstrap_fields
                           ) -> tuple[PDItem, bool]:
    """(the item, whether its stream wants a usage chunk) of a PD OpenAI request; ``boot_of``
    reads the transfer's bootstrap from the body (SGLang's fields, or vLLM's params)."""
    body = await read_body(request)
    boot = boot_of(body)
    st = state(request)
    gen, stream = (parse_chat if chat else parse_completion)(body, st.model, st.tokenizer)
    check_model(body, st.config.model_names)
    return PDItem(body, boot, gen, stream), include_usage(body) if stream else False


def split_batch(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The single-prompt bodies of a batch, or None when ``body`` carries one prompt."""
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list):
        key, prompts = "text", text
    elif isinstance(ids, list) and ids and isinstance(ids[0], list):
        key, prompts = "input_ids", ids
    else:
        return None
    if text is not None and ids is not None:
        raise BadRequest("text", "give exactly one of text or input_ids")
    n = len(prompts)
    if not n:
        raise BadRequest(key, "batch must not be empty")
    if body.get("stream") is True:
        raise BadRequest("stream", "streaming is supported for a single prompt only")
    rooms = body.get("bootstrap_room")
    if not isinstance(rooms, list):
        raise BadRequest("bootstrap_room", f"a batch of {n} prompts needs a list of {n} rooms: "
                         "one room binds one KV transfer")
    rid = body.get("rid")
    if rid is not None and not (isinstance(rid, list) and all(isinstance(r, str) and r
                                                             for r in rid)):
        # One id per prompt, as the monolithic server requires; an id given twice is a 409
        # when the worker claims the batch's ids (AsyncEngine.claim)
        raise BadRequest("rid", "for a batch, must be a list of distinct ids, one per prompt")
    lists = {k: body[k] for k in PER_ITEM if isinstance(body.get(k), list)}
    for k, values in lists.items():
        if len(values) != n:
            raise BadRequest(k, f"a batch of {n} prompts needs {n} values, got {len(values)}")
    try:
        distinct = len(set(rooms)) == n
    except TypeError:  # unhashable: the item's own check names the bad value
        distinct = True
    if not distinct:
        raise BadRequest("bootstrap_room", "every prompt of a batch needs its own room")
    out = []
    for i, prompt in enumerate(prompts):
        one = {**body, key: prompt}
        for k, values in lists.items():
            one[k] = values[i]
        out.append(one)
    return out


def _item(body: dict[str, Any], model: Any, tok: Any) -> PDItem:
    boot = bootstrap_fields(body)
    inputs, batch, stream = parse_generate(body, model, tok)
    if batch:  # a list nested in a batch item
        raise BadRequest("text", "a batch item carries one prompt")
    return PDItem(body, boot, inputs[0], stream)


def item_ids(items: Sequence[PDItem], fresh: Callable[[], str] = lambda: uuid.uuid4().hex
             ) -> list[str]:
    """Each item's rid, filled in with ``fresh()`` where the client gave none (to claim them)."""
    for item in items:
        item.gen.rid = item.gen.rid or fresh()
    return [item.gen.rid for item in items]


async def answer_batch(calls: Sequence[Awaitable[web.StreamResponse]]) -> web.Response:
    """Run the items' calls together; their answers as one list, or the first failure's."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    answers: list[Any] = []
    for i, res in enumerate(results):
        if isinstance(res, BaseException) and (code := error_status(res)) is not None:
            return json_error(code, f"batch item {i}: {res}", item=i)
        if isinstance(res, BaseException):
            raise res
        assert isinstance(res, web.Response) and isinstance(res.body, bytes)
        doc = json.loads(res.body)
        if res.status != 200:
            detail = doc.pop("error", "failed") if isinstance(doc, dict) else "failed"
            extra = {k: v for k, v in doc.items() if k != "item"} if isinstance(doc, dict) else {}
            return json_error(res.status, f"batch item {i}: {detail}", item=i, **extra)
        answers.append(doc)
    return web.json_response(answers)
