"""The decode instance's leader: takes PD requests, fetches their KV from the prefill named by
``bootstrap_host``/``bootstrap_port``/``bootstrap_room``, validates it, generates and streams.
A request with ``X-Kvatlas-Prefill: local`` and no bootstrap fields it serves whole, as the
monolithic engine does (``engine.pd.local``).

Per room it records the furthest stage reached (``engine.pd.rooms``), readable at
``GET /debug/rooms/{room}``. Pages are reserved on every TP rank (replicated scheduler call) before
the transfer and given back on any failure, so a failed or abandoned transfer leaves the pool as
it was. A heartbeat per prefill instance (its bootstrap ``/health`` plus a data-plane ping of each
connected rank) fails that prefill's in-flight rooms after ``heartbeat_max_misses`` misses. With
etcd, a prefill restarted under the same address is noticed from its instance record
(``engine.pd.restarts``) and its cached topology, ranks and connections are dropped at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from bootstrap.client import BootstrapClient, BootstrapClientConfig
from engine import openai_api
from engine import server as mono
from engine.errors import BadRequest
from engine.http_common import json_error, sse_end, sse_response, sse_send, until_disconnected
from engine.pd.batch import PDItem, answer_batch, item_ids, read_openai_item, read_pd_items
from engine.pd.common import Bootstrap, start_group_leader, worker_app
from engine.pd.config import PDConfig
from engine.pd.fetch import DecodeRank, FetchError
from engine.pd.local import wants_local_prefill
from engine.pd.registration_decode import DecodeRecord
from engine.pd.restarts import PrefillRestarts
from engine.pd.rooms import RoomLog, RoomRecord
from engine.pd.state import CFG_KEY, RANKS_KEY, RankContext, once, start_engine
from engine.pd.vllm_params import decode_boot_of, engine_rid
from engine.ranks.replica import ReplicatedScheduler
from engine.ranks.uplink import UplinkServer
from engine.registration import index_blocks, served_fields
from engine.runner import AsyncEngine
from engine.scheduler import Request
from transfer import HeartbeatMonitor, ReceiveResult, create_receiver

logger = logging.getLogger(__name__)


@dataclass
class DecodeState:
    cfg: PDConfig
    ranks: RankContext
    engine: AsyncEngine
    replica: ReplicatedScheduler
    rank: DecodeRank
    uplink: UplinkServer | None
    rooms: RoomLog
    monitors: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0})
    reserving: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by the one room trying to reserve pages; the rest queue on it in arrival order."""


DECODE_KEY = web.AppKey("pd_decode", DecodeState)


Answer = Callable[[Request, list[int], ReceiveResult, float], Awaitable[web.StreamResponse]]
"""Writes a request's answer once its KV arrived: (request, its pages, the transfer's result,
start time) -> response. /generate's and OpenAI's differ only here."""


async def generate(request: web.Request) -> web.StreamResponse:
    ds = request.app[DECODE_KEY]
    if await wants_local_prefill(request, ds.cfg):
        return await mono.generate(request)
    items, batch = await read_pd_items(request)
    for item in items:  # all refused before any room opens
        check_item(ds, item)
    # a duplicate id is refused before any page is reserved (409), and the claim lasts until
    # the reservation is settled: the replica tracks reservations by id
    with ds.engine.claim(item_ids(items)):
        if not batch:
            return await until_disconnected(request, decode_item(request, ds, items[0]))
        return await until_disconnected(request, answer_batch(
            [decode_item(request, ds, item) for item in items]))


async def completions(request: web.Request) -> web.StreamResponse:
    return await serve_openai(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await serve_openai(request, chat=True)


async def serve_openai(request: web.Request, chat: bool) -> web.StreamResponse:
    """An OpenAI request of the pair: the decode answers it in OpenAI's shape."""
    ds = request.app[DECODE_KEY]
    if await wants_local_prefill(request, ds.cfg):
        return await (openai_api.chat_completions if chat else openai_api.completions)(request)
    proto = ds.cfg.pd_protocol
    item, with_usage = await read_openai_item(request, chat, decode_boot_of(proto))
    check_item(ds, item)
    # vLLM's pairing names the request after X-Request-Id, as the prefill named its own
    rids = item_ids([item], (lambda: engine_rid(request, chat)) if proto.name == "vllm"
                    else lambda: openai_api.openai_rid(chat))

    async def answer(req: Request, pages: list[int], result: ReceiveResult,
                     started: float) -> web.StreamResponse:
        outputs = ds.engine.generate_prefilled(req, pages, result.first_token)
        return await openai_api.respond(request, outputs, rid=req.rid,
                                        model=ds.cfg.engine.model_name, stream=item.stream,
                                        with_usage=with_usage, chat=chat)

    with ds.engine.claim(rids):
        return await until_disconnected(request, decode_item(request, ds, item, answer))


def check_item(ds: DecodeState, item: PDItem) -> None:
    """Refuse an item that can never fit or whose room this decode has already used."""
    ds.engine.scheduler.check_fits(len(item.gen.prompt), item.gen.params.max_new_tokens)
    if ds.rooms.get(item.boot.room) is not None:
        raise BadRequest("bootstrap_room", f"room {item.boot.room} was already used on this "
                         "decode; the router must draw a new room for every attempt")


async def decode_item(request: web.Request, ds: DecodeState, item: PDItem,
                      answer: Answer | None = None) -> web.StreamResponse:
    gi, boot = item.gen, item.boot
    rid = gi.rid
    assert rid is not None  # given by the handler, which claims it
    rec = ds.rooms.open(boot.room, rid, boot.addr)
    if answer is None:
        async def answer(req: Request, pages: list[int], result: ReceiveResult,
                         started: float) -> web.StreamResponse:
            if item.stream:
                return await stream_out(request, ds, req, pages, result, started)
            return await collect_out(ds, req, pages, result, started)
    try:
        return await serve_room(request, ds, gi, rid, boot, rec, answer)
    finally:
        if rec.state == "in_flight":  # cancelled (the client left) before an outcome
            ds.rooms.close(rec, error={"stage": rec.stage, "rank": ds.rank.rank,
                                       "reason": "the request was cancelled"})


async def serve_room(request: web.Request, ds: DecodeState, gi: Any, rid: str, boot: Bootstrap,
                     rec: RoomRecord, answer: Answer) -> web.StreamResponse:
    started = time.monotonic()
    pages = await reserve(ds, len(gi.prompt), gi.params.max_new_tokens, rec)
    if pages is None:
        ds.rooms.close(rec, error={"stage": "registered", "rank": ds.rank.rank,
                                   "reason": "no free KV pages"})
        return json_error(503, f"room {boot.room}: no free KV pages within "
                               f"{ds.cfg.transfer.waiting_timeout_s} s", room=boot.room)
    # the prefill sends the prompt's pages; the rest of the reservation is for the output
    prompt_pages = pages[:-(-len(gi.prompt) // ds.cfg.engine.page_size)]
    try:
        result = await fetch_all_ranks(ds, boot, prompt_pages, rec)
    except FetchError as exc:
        ds.stats["failed"] += 1
        await release(ds, boot, pages, exc.reason)
        ds.rooms.close(rec, error=exc.doc())
        return json_error(502, str(exc), room=boot.room, stage=exc.stage, rank=exc.rank,
                          peer=exc.peer)
    except BaseException:  # cancelled (client left): the pages go back, the prefill is told
        await asyncio.shield(release(ds, boot, pages, "the decode request was cancelled"))
        raise
    req = Request(rid, list(gi.prompt), gi.params)
    req.cached_tokens = result.cached_tokens
    rec.reach("consumed")
    ds.stats["ok"] += 1
    try:
        resp = await answer(req, pages, result, started)
        ds.rooms.close(rec)
        return resp
    finally:
        # whoever owns the reservation now (the scheduler, or still this request) frees it
        await asyncio.shield(ds.engine.call(ds.replica.settle_reservation, rid, pages))


async def reserve(ds: DecodeState, prompt_len: int, max_new: int, rec: RoomRecord
                  ) -> list[int] | None:
    """The room's pages, or None when they were not free within the waiting timeout. Rooms
    wait in arrival order (FIFO, as the scheduler admits: a large room is not starved by
    small ones) and hold no page while they wait; only the first tries, again each time the
    engine frees pages (woken by it, not polling), so a release wakes one reserve, not all."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ds.cfg.transfer.waiting_timeout_s
    try:
        await asyncio.wait_for(ds.reserving.acquire(), ds.cfg.transfer.waiting_timeout_s)
    except TimeoutError:
        return None
    try:
        while True:
            mark, pages = await reserve_once(ds, prompt_len, max_new)
            if pages is not None:
                rec.ranks["pages"] = len(pages)  # type: ignore[assignment]
                return pages
            if not await ds.engine.wait_freed(mark, deadline - loop.time()):
                return None
    finally:
        ds.reserving.release()


def try_reserve(ds: DecodeState, prompt_len: int, max_new: int
                ) -> tuple[int, list[int] | None]:
    """Engine thread: (the engine's freed-pages mark, the pages or None when not free now);
    the mark is read in the same call, so no page freed after the attempt goes unnoticed."""
    return ds.engine.freed_mark, ds.replica.reserve(prompt_len, max_new)


async def reserve_once(ds: DecodeState, prompt_len: int, max_new: int
                       ) -> tuple[int, list[int] | None]:
    """One reservation attempt: ``try_reserve``'s answer. The engine thread finishes a reserve
    it has begun whatever happens to this task, so a cancellation (the client hung up) waits
    for its outcome and gives the pages back: dropped with the task, they would stay taken
    until a restart."""
    call = asyncio.ensure_future(ds.engine.call(try_reserve, ds, prompt_len, max_new))
    try:
        return await asyncio.shield(call)  # type: ignore[return-value]
    except asyncio.CancelledError:
        await asyncio.shield(give_back_reservation(ds, call))
        raise


async def give_back_reservation(ds: DecodeState, call: asyncio.Future[object]) -> None:
    try:
        _, pages = await call  # type: ignore[misc]
    except Exception:  # refused (CapacityError): nothing was taken
        return
    if pages:
        await ds.engine.call(ds.replica.release_reserved, pages)


async def release(ds: DecodeState, boot: Bootstrap, pages: list[int], reason: str) -> None:
    if ds.ranks.info.tp_size > 1:
        await ds.engine.call(ds.replica.transfer, ("abort", boot.room, reason))
    await ds.engine.call(ds.replica.release_reserved, pages)


async def fetch_all_ranks(ds: DecodeState, boot: Bootstrap, pages: list[int],
                          rec: RoomRecord) -> ReceiveResult:
    tp = ds.ranks.info.tp_size
    ensure_monitor(ds, boot)
    if tp > 1:
        await ds.engine.call(ds.replica.transfer, ("receive", boot.host, boot.port, boot.room,
                                                   pages))
    result = await ds.rank.fetch(boot, pages, lambda stage, info: rec.reach(stage, **info))
    if tp > 1 and ds.uplink is not None:
        timeout = ds.cfg.transfer.waiting_timeout_s + 30
        reports = await ds.uplink.wait("receive", boot.room, tp - 1, timeout)
        for rep in sorted(reports, key=lambda r: r["rank"]):
            if not rep["ok"]:
                raise FetchError(boot.room, rep.get("stage") or "verified", f"tp{rep['rank']}",
                                 rep["error"], rep.get("peer"))
            if rep.get("first_token") != result.first_token:
                raise FetchError(boot.room, "verified", f"tp{rep['rank']}",
                                 f"first token {rep.get('first_token')} differs from rank 0's "
                                 f"{result.first_token}")
        if len(reports) < tp - 1:
            raise FetchError(boot.room, "verified", "tp?", f"only {len(reports)} of {tp - 1} "
                             "other decode ranks reported within the waiting timeout")
        rec.reach("verified", ranks_verified=tp)
    return result


def ensure_monitor(ds: DecodeState, boot: Bootstrap) -> None:
    addr = boot.addr
    task = ds.monitors.get(addr)
    if task is not None and not task.done():
        return
    client, receiver, cfg = ds.rank.client, ds.rank.receiver, ds.cfg.transfer

    async def probe() -> bool:
        if not await client.health(boot.host, boot.port):
            return False
        eps = list(ds.rank.endpoints.get(addr, ()))
        pings = await asyncio.gather(*(receiver.ping(ep, cfg.heartbeat_interval_s) for ep in eps))
        return all(pings)

    async def dead(reason: str) -> None:
        rooms = ds.rank.fail_prefill(addr, f"prefill {addr} declared dead: {reason}")
        logger.warning("prefill %s declared dead (%s); failed rooms %s", addr, reason, rooms)
        if ds.ranks.info.tp_size > 1:
            await ds.engine.call(ds.replica.transfer, ("fail_prefill", addr, reason))

    mon = HeartbeatMonitor(addr, probe, dead, cfg)
    ds.monitors[addr] = asyncio.create_task(mon.run(), name=f"heartbeat-{addr}")


async def forget_prefill(ds: DecodeState, addr: str, reason: str) -> None:
    """The process behind bootstrap ``addr`` changed: drop what every decode rank cached."""
    rooms = ds.rank.fail_prefill(addr, f"prefill {addr} restarted: {reason}")
    if rooms:
        logger.warning("prefill %s restarted (%s); failed rooms %s", addr, reason, rooms)
    if ds.ranks.info.tp_size > 1:
        await ds.engine.call(ds.replica.transfer, ("fail_prefill", addr, reason))


def meta(rid: str, out: Any, started: float, room: int) -> dict[str, Any]:
    return {**mono.meta_info(rid, out, started), "bootstrap_room": room}


async def collect_out(ds: DecodeState, req: Request, pages: list[int], result: ReceiveResult,
                      started: float) -> web.Response:
    ids: list[int] = []
    text = ""
    last = None
    async with contextlib.aclosing(ds.engine.generate_prefilled(req, pages, result.first_token)
                                   ) as gen:
        async for out in gen:
            ids.extend(out.new_ids)
            text += out.text_delta
            last = out
    assert last is not None
    if last.error:
        return json_error(500, last.error, room=result.room)
    return web.json_response({"text": text, "output_ids": ids,
                              "meta_info": meta(req.rid, last, started, result.room)})


async def stream_out(request: web.Request, ds: DecodeState, req: Request, pages: list[int],
                     result: ReceiveResult, started: float) -> web.StreamResponse:
    resp = await sse_response(request)
    ids: list[int] = []
    text = ""
    async with contextlib.aclosing(ds.engine.generate_prefilled(req, pages, result.first_token)
                                   ) as gen:
        async for out in gen:
            ids.extend(out.new_ids)
            text += out.text_delta
            if out.error:
                await sse_send(resp, {"error": out.error})
                break
            await sse_send(resp, {"text": text, "output_ids": list(ids),
                                  "meta_info": meta(req.rid, out, started, result.room)})
    await sse_end(resp)
    return resp


async def room_get(request: web.Request) -> web.Response:
    ds = request.app[DECODE_KEY]
    raw = request.match_info["room"]
    if not raw.isdigit():
        return json_error(400, f"room must be a non-negative integer, got {raw!r}")
    rec = ds.rooms.get(int(raw))
    if rec is None:
        return json_error(404, f"room {raw} is unknown here (never seen, or its record expired "
                               f"after {ds.rooms.ttl_s:g} s / {ds.rooms.keep} rooms)")
    return web.json_response(rec.doc())


async def stats_get(request: web.Request) -> web.Response:
    ds = request.app[DECODE_KEY]
    sched = ds.replica
    return web.json_response({
        "rank": ds.ranks.info.name, **ds.stats, "rooms": ds.rooms.counts(),
        "receiver": ds.rank.receiver.stats,  # type: ignore[attr-defined]
        "kv_pages_free": sched.pool.num_free, "kv_pages_total": sched.pool.num_pages,
        "running": len(sched.running), "monitors": sorted(ds.monitors)})


# -- lifecycle --------------------------------------------------------------------------------
async def decode_ctx(app: web.Application) -> AsyncIterator[None]:
    """Start this leader, serve, stop. Each resource's close goes on the exit stack as soon as
    it is opened, so a start that fails at any step (an instance id in use, a port taken)
    closes everything started before it, in reverse order."""
    async with contextlib.AsyncExitStack() as stack:
        await start_decode(app, stack)
        yield


async def start_decode(app: web.Application, stack: contextlib.AsyncExitStack) -> None:
    cfg, ranks = app[CFG_KEY], app[RANKS_KEY]
    info, dist = ranks.info, ranks.dist
    assert dist is not None
    sched, layout, replica, uplink = await start_group_leader(cfg, info, dist)
    if uplink is not None:
        stack.push_async_callback(uplink.close)
    record = (DecodeRecord(cfg, info, served_fields(cfg.engine, sched.tokenizer))
              if cfg.etcd is not None else None)
    close_record = None
    if record is not None:
        await record.claim()  # before anything runs that a refusal would have to stop
        close_record = once(record.close)
        stack.push_async_callback(close_record)
    receiver = create_receiver(cfg.transfer_backend, cfg.transfer, layout, sched.pool.kv)
    await receiver.start()
    close_receiver = once(receiver.close)
    stack.push_async_callback(close_receiver)
    client = BootstrapClient(BootstrapClientConfig(auth_token=cfg.auth_token))
    await client.start()
    stack.push_async_callback(client.close)
    engine = AsyncEngine(replica)  # type: ignore[arg-type]
    ds = DecodeState(cfg, ranks, engine, replica, DecodeRank(cfg, info, receiver, client),
                     uplink, RoomLog(cfg.room_log_keep, cfg.room_log_ttl_s))
    app[DECODE_KEY] = ds
    await start_engine(app, stack, cfg, engine, replica, "decode")

    async def stop_fetching() -> None:
        """At a stop: the heartbeats end and the receiver fails the rooms still in flight
        before the engine stops."""
        for task in ds.monitors.values():
            task.cancel()
        await asyncio.gather(*ds.monitors.values(), return_exceptions=True)
        await close_receiver()
    stack.push_async_callback(stop_fetching)
    if record is not None and close_record is not None:
        await record.start()
        # At a stop the record goes first: routers drop this decode before it stops fetching.
        stack.push_async_callback(close_record)
        if cfg.caches_prefixes:  # it prefills locally: its cache's blocks go in the index
            # (no request has run yet: the app serves once this start returns; closed before
            # the lease is revoked)
            engine.event_sink = await index_blocks(stack, record, cfg.access,
                                                   cfg.engine.model_name, cfg.engine.page_size)
        watch = PrefillRestarts(record.client, record.layout,
                                lambda addr, why: forget_prefill(ds, addr, why))
        restarts = asyncio.create_task(watch.run(), name="decode-prefill-restarts")
        stack.push_async_callback(cancel_and_wait, restarts)
    logger.info("decode %s rank %s ready", cfg.instance_id, info.name)


async def cancel_and_wait(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def create_decode_app(cfg: PDConfig, ranks: RankContext | None = None) -> web.Application:
    app = worker_app(cfg, decode_ctx, generate)
    app[CFG_KEY] = cfg
    app[RANKS_KEY] = ranks or RankContext()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/debug/rooms/{room}", room_get)
    app.router.add_get("/debug/pd", stats_get)
    return app
