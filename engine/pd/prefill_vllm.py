"""A prefill's OpenAI requests, under SGLang's bootstrap or vLLM's ``kv_transfer_params``.

A body with ``kv_transfer_params.do_remote_decode: true`` (``--pd-protocol vllm-pull|vllm-push``)
is bound to its request id: the room is ``room_of`` its base id (``engine.pd.vllm_params``),
which the decode derives from the same X-Request-Id.

- push: as SGLang's flow (wait for the decode to ask for the room, compute holding the pages,
  send, release), then the one-token OpenAI answer with vLLM's ``kv_transfer_params``;
- pull: compute at once holding the pages and answer at once with the params the decode needs
  (``remote_host``/``remote_port``: this instance's bootstrap server); in the background, hold
  the pages until the decode asked for the room and the KV was sent, or until ``kv_lease_s``
  passed, then release them and the request id's claim.

Any other body is SGLang's bootstrap request, served as ever (``prefill.prefill_items``).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from aiohttp import web

from engine.errors import BadRequest
from engine.http_common import until_disconnected
from engine.pd.batch import PDItem, read_openai_item
from engine.pd.common import Bootstrap, bootstrap_fields
from engine.pd.prefill import (
    PREFILL_KEY,
    PrefillState,
    abort_and_release,
    compute_held,
    prefill_and_send,
    prefill_items,
    send_all_ranks,
    wait_for_decode,
)
from engine.pd.vllm_params import (
    base_request_id,
    engine_rid,
    prefill_answer,
    room_of,
    transfer_params,
    wants_remote_decode,
)
from index.pd_protocol import PUSH
from transfer import TransferError

logger = logging.getLogger(__name__)


async def completions(request: web.Request) -> web.StreamResponse:
    return await prefill_openai(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await prefill_openai(request, chat=True)


async def prefill_openai(request: web.Request, chat: bool) -> web.StreamResponse:
    ps = request.app[PREFILL_KEY]
    cfg = ps.cfg
    rid = engine_rid(request, chat)
    vllm = False

    def boot_of(body: dict[str, Any]) -> Bootstrap:
        nonlocal vllm
        if not wants_remote_decode(body, cfg.pd_protocol):
            return bootstrap_fields(body)
        vllm = True
        # Its own bootstrap server, as its answers name it (``PrefillState.identity``).
        me = ps.identity
        assert me.host is not None and me.port is not None
        return Bootstrap(me.host, me.port, room_of(base_request_id(rid)))

    item, _ = await read_openai_item(request, chat, boot_of)
    if not vllm:
        return await prefill_items(request, [item], False)
    item.gen.rid = rid
    ps.engine.scheduler.check_fits(len(item.gen.prompt), 1)
    # the base id is claimed too: a second request under the same X-Request-Id would share
    # the room (a 409 while the first holds it)
    ids = [rid, base_request_id(rid)]
    if cfg.pd_protocol.mode == PUSH:
        with ps.engine.claim(ids):
            sent = await until_disconnected(request, prefill_and_send(
                ps, item.gen.prompt, item.gen.params, rid, item.boot))
        if isinstance(sent, web.Response):
            return sent
        return answer(ps, item, rid, chat, *sent, [])
    # pull: the claim outlives this handler, until the lease ends
    claim = contextlib.ExitStack()
    claim.enter_context(ps.engine.claim(ids))
    try:
        return await until_disconnected(request, compute_and_hold(ps, item, rid, chat, claim))
    except BaseException:
        claim.close()
        raise


def answer(ps: PrefillState, item: PDItem, rid: str, chat: bool, first: int, cached: int,
           pages: list[int]) -> web.Response:
    cfg = ps.cfg
    params = transfer_params(ps.identity, rid=rid, pages=pages,
                             prompt_tokens=len(item.gen.prompt))
    return web.json_response(prefill_answer(
        rid=rid, model=cfg.engine.model_name, chat=chat,
        text=ps.replica.tokenizer.decode([first]), prompt_tokens=len(item.gen.prompt),
        cached_tokens=cached, params=params))


async def compute_and_hold(ps: PrefillState, item: PDItem, rid: str, chat: bool,
                           claim: contextlib.ExitStack) -> web.Response:
    """Pull: compute the prompt holding its pages, start the lease that sends or releases them,
    and answer with the params; the claim passes to the lease once it starts."""
    room, engine, gi = item.boot.room, ps.engine, item.gen
    try:
        ps.sender.create(room)
    except TransferError as exc:  # the same X-Request-Id twice, while the first is held
        raise BadRequest("X-Request-Id", f"{exc.reason}: send a fresh id per attempt") from None
    computed = await compute_held(ps, gi.prompt, gi.params, rid, room)
    if isinstance(computed, web.Response):
        return computed
    first, cached = computed
    try:
        pages = await engine.call(lambda: list(ps.replica.held[rid]))
    except BaseException:
        ps.sender.abort(room, "prefill was cancelled")
        await asyncio.shield(engine.call(ps.replica.release_held, rid))
        raise
    lease = asyncio.create_task(hold_for_decode(ps, room, rid, pages, first, cached,
                                                claim.pop_all()), name=f"kv-lease-{rid}")
    ps.leases.add(lease)
    lease.add_done_callback(ps.leases.discard)
    return answer(ps, item, rid, chat, first, cached, pages)


async def hold_for_decode(ps: PrefillState, room: int, rid: str, pages: list[int], first: int,
                          cached: int, claim: contextlib.ExitStack) -> None:
    """Pull: the held pages wait for their decode at most ``kv_lease_s``; they are sent once it
    asked for the room, and given back on every path (sent, failed, expired, cancelled at a
    stop), with the request id's claim."""
    engine, lease_s = ps.engine, ps.cfg.kv_lease_s
    released = False
    try:
        try:
            await asyncio.wait_for(wait_for_decode(ps, room), lease_s)
        except TimeoutError:
            reason = f"no decode fetched the KV within the lease ({lease_s:g} s)"
            ps.stats["expired"] += 1
            logger.warning("room %d (%s): %s; pages released", room, rid, reason)
            ps.sender.abort(room, reason)
            released = True
            await asyncio.shield(engine.call(abort_and_release, ps, room, reason, rid))
            return
        await send_all_ranks(ps, room, pages, first, cached)
        ps.stats["sent"] += 1
    except TransferError as exc:
        ps.stats["failed"] += 1
        logger.warning("room %d (%s): KV not sent: %s", room, rid, exc)
    except BaseException as exc:  # cancelled at a stop: no rank may read the pages after this
        reason = f"prefill stopped: {type(exc).__name__}"
        ps.sender.abort(room, reason)
        released = True
        await asyncio.shield(engine.call(abort_and_release, ps, room, reason, rid))
        raise
    finally:
        try:
            if not released:
                await asyncio.shield(engine.call(ps.replica.release_held, rid))
        finally:
            claim.close()
