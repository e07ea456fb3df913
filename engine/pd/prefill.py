"""The prefill instance's leader (HTTP, bootstrap server, index writer) and its follower ranks.

A PD ``/generate`` (the router sends the same body to prefill and decode at once) waits, holding
no page, until the room's decode asked for it (which it does once it reserved the room's pages),
then runs the prompt with ``max_new_tokens=1`` and ``hold_pages``, so its pages stay pinned, sends
the pages of every TP rank plus the first token and cached-token count to the decode ranks that
asked for the room, and only then gives the pages back. It answers once the KV is sent; the
router ignores that body. A room it gives up (its client left, its own send failed) is aborted
on every TP rank before the pages come back, so that no follower keeps sending them.
With ``--dp`` > 1, world rank 0 picks the DP group (``room % dp`` or round robin announced with
``/register_dp_rank``) and forwards the request to that group's leader.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from aiohttp import web

from bootstrap.client import BootstrapClient, BootstrapClientConfig
from bootstrap.config import BootstrapConfig
from bootstrap.http_limits import make_runner
from bootstrap.registration import put_route
from bootstrap.server import STATE as BOOTSTRAP_STATE
from bootstrap.server import create_app as create_bootstrap_app
from engine.errors import BadRequest, CapacityError
from engine.http_common import json_error, until_disconnected
from engine.pd.batch import PDItem, answer_batch, item_ids, read_pd_items
from engine.pd.common import Bootstrap, start_group_leader
from engine.pd.config import PDConfig
from engine.pd.state import CFG_KEY, RANKS_KEY, RankContext, once, rank_route, start_engine
from engine.ranks.replica import ReplicatedScheduler
from engine.ranks.uplink import UplinkServer
from engine.registration import open_local_feed, served_fields
from engine.runner import AsyncEngine
from index.events.endpoints import offset_endpoint
from index.events.publisher import KVEventPublisher, PublisherConfig
from index.events.subscriber import SubscriberConfig
from index.lease import cancel_and_wait
from index.pd_protocol import SGLANG_BOOTSTRAP, PDProtocol
from index.writer import BlockWriter
from transfer import KVSender, TensorPageSource, TransferError, create_sender

logger = logging.getLogger(__name__)


@dataclass
class PrefillState:
    cfg: PDConfig
    ranks: RankContext
    engine: AsyncEngine
    replica: ReplicatedScheduler
    sender: KVSender
    uplink: UplinkServer | None
    session: aiohttp.ClientSession
    writer: BlockWriter | None = None
    bootstrap: BootstrapClient | None = None
    rr: Any = field(default_factory=lambda: itertools.count())
    stats: dict[str, int] = field(default_factory=lambda: {"sent": 0, "failed": 0,
                                                           "forwarded": 0, "expired": 0})
    sending: set[int] = field(default_factory=set)
    """Rooms whose KV every TP rank was told to send and whose send has not ended here."""
    awaiting_decode: set[int] = field(default_factory=set)
    """Rooms admitted here that wait, holding no page, for their decode to ask for them."""
    leases: set[asyncio.Task[None]] = field(default_factory=set)
    identity: PDProtocol = SGLANG_BOOTSTRAP
    """How this prefill names itself in vLLM's answers (``PDConfig.identity``), as its record
    does."""
    """vLLM pull: the tasks holding answered requests' pages for their decodes
    (``prefill_vllm.hold_for_decode``)."""


PREFILL_KEY = web.AppKey("pd_prefill", PrefillState)


async def generate(request: web.Request) -> web.StreamResponse:
    ps = request.app[PREFILL_KEY]
    items, batch = await read_pd_items(request)
    for item in items:  # all refused before any starts (a prefill keeps the prompt's KV only)
        ps.engine.scheduler.check_fits(len(item.gen.prompt), 1)
    return await prefill_items(request, items, batch)


async def prefill_items(request: web.Request, items: list[PDItem], batch: bool
                        ) -> web.Response:
    ps = request.app[PREFILL_KEY]
    # A duplicate id is refused (409) before any room or page is touched; the claim lasts
    # until the held pages are given back, which the scheduler tracks by id.
    with ps.engine.claim(item_ids(items)):
        # A router whose client left closes this connection: the prefill stops (its pages
        # back, its room failed) whatever runner serves the app, not only one made with
        # handler_cancellation.
        if not batch:
            return await until_disconnected(request, prefill_item(ps, items[0], request.path))
        return await until_disconnected(request, answer_batch(
            [prefill_item(ps, item) for item in items]))


async def prefill_item(ps: PrefillState, item: PDItem, path: str = "/generate") -> web.Response:
    info = ps.ranks.info
    if info.world_rank == 0 and info.dp_size > 1:
        dp = await choose_dp(ps, item.boot)
        if dp != 0:
            return await forward(ps, dp, item.body, path)
    gi = item.gen
    ps.engine.scheduler.check_fits(len(gi.prompt), 1)  # a prefill keeps the prompt's KV only
    assert gi.rid is not None  # given and claimed by prefill_items
    return await prefill_one(ps, gi.prompt, gi.params, gi.rid, item.boot)


async def choose_dp(ps: PrefillState, boot: Bootstrap) -> int:
    dp_size = ps.ranks.info.dp_size
    if ps.cfg.load_balance_method == "follow_bootstrap_room":
        return boot.room % dp_size
    dp = next(ps.rr) % dp_size
    assert ps.bootstrap is not None and ps.ranks.bootstrap_port is not None
    await ps.bootstrap.register_dp_rank(ps.cfg.engine.host, ps.ranks.bootstrap_port, boot.room, dp)
    return dp


async def forward(ps: PrefillState, dp: int, body: dict[str, Any], path: str) -> web.Response:
    """Hand a request to DP group ``dp``'s leader, on the endpoint it came in on."""
    ps.stats["forwarded"] += 1
    async with ps.session.post(f"{ps.ranks.dp_urls[dp]}{path}", json=body) as resp:
        return web.Response(body=await resp.read(), status=resp.status,
                            content_type="application/json")


async def prefill_one(ps: PrefillState, prompt: list[int], params: Any, rid: str,
                      boot: Bootstrap) -> web.Response:
    """SGLang's flow for one prompt, answered as SGLang's prefill answers (the router reads
    only its status)."""
    started = time.monotonic()
    sent = await prefill_and_send(ps, prompt, params, rid, boot)
    if isinstance(sent, web.Response):
        return sent
    first, cached = sent
    return web.json_response({
        "text": "", "output_ids": [first],
        "meta_info": {"id": rid, "bootstrap_room": boot.room, "prompt_tokens": len(prompt),
                      "cached_tokens": cached, "completion_tokens": 1,
                      "finish_reason": {"type": "kv_sent"},
                      "e2e_latency": round(time.monotonic() - started, 6)}})


async def prefill_and_send(ps: PrefillState, prompt: list[int], params: Any, rid: str,
                           boot: Bootstrap) -> tuple[int, int] | web.Response:
    """Wait for the room's decode, compute holding the pages, send them, give them back:
    (first token, cached tokens) once sent, or the error answer."""
    room, engine = boot.room, ps.engine
    try:
        ps.sender.create(room)
    except TransferError as exc:
        raise BadRequest("bootstrap_room", exc.reason) from None
    try:
        await wait_for_decode(ps, room)
    except TransferError as exc:
        ps.stats["failed"] += 1
        return json_error(502, f"room {room} was not computed: {exc}", room=room,
                          stage=exc.stage.name if exc.stage else None)
    computed = await compute_held(ps, prompt, params, rid, room)
    if isinstance(computed, web.Response):
        return computed
    first, cached = computed
    released = False
    try:
        pages = await engine.call(lambda: list(ps.replica.held[rid]))
        await send_all_ranks(ps, room, pages, first, cached)
    except TransferError as exc:
        ps.stats["failed"] += 1
        return json_error(502, str(exc), room=room, stage=exc.stage.name if exc.stage else None)
    except BaseException as exc:
        # cancelled (the client left) before the send waited on the room, which alone fails
        # it then: fail it here, or it stays open and a decode may still ask for it; and on
        # the other TP ranks too, which would otherwise send freed pages until their timeout
        reason = f"prefill did not finish: {type(exc).__name__}"
        ps.sender.abort(room, reason)
        released = True  # by the call below, even if this task is cancelled again
        await asyncio.shield(engine.call(abort_and_release, ps, room, reason, rid))
        raise
    finally:
        if not released:
            await asyncio.shield(engine.call(ps.replica.release_held, rid))
    ps.stats["sent"] += 1
    return first, cached


async def compute_held(ps: PrefillState, prompt: list[int], params: Any, rid: str, room: int
                       ) -> tuple[int, int] | web.Response:
    """Run the prompt (one token) keeping its pages held: (first token, cached tokens), or the
    500 answer when it produced none. On any failure the room is aborted and no page stays
    held; the caller gives the pages back once they are sent."""
    engine, last = ps.engine, None
    try:
        async with contextlib.aclosing(engine.generate(
                prompt, replace(params, max_new_tokens=1), rid, hold_pages=True)) as gen:
            async for out in gen:
                last = out
    except (CapacityError, BadRequest) as exc:
        ps.sender.abort(room, str(exc))
        raise
    except BaseException as exc:  # cancelled: the pages may already be held; give them back
        ps.sender.abort(room, f"prefill did not finish: {type(exc).__name__}")
        await asyncio.shield(engine.call(ps.replica.release_held, rid))
        raise
    if last is None or last.error or not last.new_ids:
        reason = last.error if last is not None and last.error else "prefill produced no token"
        ps.sender.abort(room, reason)
        await engine.call(ps.replica.release_held, rid)
        return json_error(500, f"prefill of room {room} failed: {reason}", room=room)
    return last.new_ids[0], last.cached_tokens


async def wait_for_decode(ps: PrefillState, room: int) -> None:
    """Wait, holding no page, until every decode rank that reads this rank asked for ``room``
    (as SGLang's bootstrap queue does). A decode asks only once it reserved the room's pages,
    so every page this prefill pins then has a destination: the two pools can never fill with
    rooms waiting on each other (computed rooms here whose decodes wait for pages held by
    rooms not computed yet). The other TP ranks are not waited for: their decode ranks ask
    after the same reservation, and each sends on the leader's instruction. Raises the
    room's TransferError when no decode asked within the bootstrap timeout or the decode
    aborted it; a cancellation (the client left) fails the room and tells its decode."""
    ps.awaiting_decode.add(room)
    try:
        await ps.sender.wait_bootstrapped(room)
    finally:
        ps.awaiting_decode.discard(room)


def abort_and_release(ps: PrefillState, room: int, reason: str, rid: str) -> None:
    """Engine thread: have the other TP ranks abort ``room``, then give its pages back on every
    rank. One call, so that the abort precedes the release in the ordered broadcast whatever
    happens to the handler; a follower's engine thread runs the release only once its sender
    failed the room (``loop_handoff``), so no rank reads a page after it was freed."""
    if ps.ranks.info.tp_size > 1:
        ps.replica.transfer(("abort", room, reason))
    ps.replica.release_held(rid)


async def send_all_ranks(ps: PrefillState, room: int, pages: list[int], first: int,
                         cached: int) -> None:
    """Send this rank's shard and have every other TP rank send its own; raise the first
    failure (TransferError) after all ranks are done."""
    tp = ps.ranks.info.tp_size
    if tp > 1:
        await ps.engine.call(ps.replica.transfer, ("send", room, pages, first, cached))
    ps.sending.add(room)
    try:
        await send_and_collect(ps, room, pages, first, cached)
    finally:
        ps.sending.discard(room)


async def send_and_collect(ps: PrefillState, room: int, pages: list[int], first: int,
                           cached: int) -> None:
    """This rank's send, then the other TP ranks' reports; the first failure raised."""
    tp = ps.ranks.info.tp_size
    own = asyncio.ensure_future(ps.sender.send(room, pages, first_token=first,
                                               cached_tokens=cached))
    errors: list[TransferError] = []
    try:
        await own
    except TransferError as exc:
        errors.append(exc)
        if tp > 1:
            # the room is lost: the other ranks stop now, and report at once, rather than
            # send to a decode that gave up until their timeout while this request waits
            await ps.engine.call(ps.replica.transfer, ("abort", room, exc.reason))
    if tp > 1 and ps.uplink is not None:
        timeout = ps.cfg.transfer.bootstrap_timeout_s + ps.cfg.transfer.waiting_timeout_s
        reports = await ps.uplink.wait("send", room, tp - 1, timeout)
        for rep in reports:
            if not rep["ok"]:
                errors.append(TransferError(room, f"prefill TP rank {rep['rank']}: "
                                            f"{rep['error']}"))
        if len(reports) < tp - 1:
            errors.append(TransferError(room, f"only {len(reports)} of {tp - 1} other TP ranks "
                                        "reported their send"))
    if errors:
        raise errors[0]


async def stats_get(request: web.Request) -> web.Response:
    ps = request.app[PREFILL_KEY]
    doc: dict[str, Any] = {"rank": ps.ranks.info.name, **ps.stats, "sender": ps.sender.stats,
                           "held": len(ps.replica.held), "sending": len(ps.sending),
                           "awaiting_decode": len(ps.awaiting_decode)}
    if ps.uplink is not None:  # the other TP ranks' outcomes (send_ok, send_failed)
        doc["ranks"] = dict(ps.uplink.counts)
    if ps.writer is not None:
        doc["index_writer"] = ps.writer.stats()
    return web.json_response(doc)


# -- lifecycle --------------------------------------------------------------------------------
async def prefill_ctx(app: web.Application) -> AsyncIterator[None]:
    """Start this leader, serve, stop. Each resource's close goes on the exit stack as soon as
    it is opened, so a start that fails at any step (a port or instance id in use, ``PUT
    /route`` refused) closes everything started before it, in reverse order."""
    async with contextlib.AsyncExitStack() as stack:
        await start_prefill(app, stack)
        yield


async def start_prefill(app: web.Application, stack: contextlib.AsyncExitStack) -> None:
    cfg, ranks = app[CFG_KEY], app[RANKS_KEY]
    info, dist = ranks.info, ranks.dist
    assert dist is not None
    sched, layout, replica, uplink = await start_group_leader(cfg, info, dist)
    if uplink is not None:
        stack.push_async_callback(uplink.close)
    sender = create_sender(cfg.transfer_backend, cfg.transfer, layout,
                           TensorPageSource(sched.pool.kv, layout), host=cfg.engine.host)
    close_sender = once(sender.close)
    stack.push_async_callback(close_sender)
    await sender.start()
    bport = ranks.bootstrap_port or cfg.bootstrap_port
    writer = sink = None
    if info.world_rank == 0:
        writer, sink = await start_bootstrap(cfg, ranks, bport, stack, served_fields(
            cfg.engine, sched.tokenizer))
    # Made after the bootstrap server is up: a start it refuses (a port in use, an instance id
    # in use) has no session to close.
    session = aiohttp.ClientSession()
    stack.push_async_callback(session.close)
    e = cfg.engine
    if e.kv_events is not None:
        # Standalone (no etcd), as SGLang publishes: each DP group on the endpoint's port + its
        # DP rank (and the replay's), for the sidecar beside the instance to index.
        sink = await start_publisher(stack, PublisherConfig(
            endpoint=offset_endpoint(e.kv_events, info.dp_rank),
            replay_endpoint=(None if e.kv_events_replay is None
                             else offset_endpoint(e.kv_events_replay, info.dp_rank)),
            topic=e.kv_events_topic))
    elif info.dp_rank > 0 and len(ranks.event_endpoints) > info.dp_rank:
        sink = await start_publisher(stack, PublisherConfig(
            endpoint=ranks.event_endpoints[info.dp_rank] or "",
            replay_endpoint=ranks.replay_endpoints[info.dp_rank]))
    engine = AsyncEngine(replica, event_sink=sink)  # type: ignore[arg-type]
    _, rank_port = sender.rank_address
    http_port = int(ranks.dp_urls[0].rsplit(":", 1)[1]) if ranks.dp_urls else None
    # Decodes dial rank_ip: the advertised host, not the (possibly wildcard) bind address.
    await put_route(f"http://{cfg.engine.host}:{bport}",
                    rank_route(cfg, info, cfg.public_host, rank_port, http_port),
                    token=cfg.auth_token)
    bclient = BootstrapClient(BootstrapClientConfig(auth_token=cfg.auth_token))
    await bclient.start()
    stack.push_async_callback(bclient.close)
    ps = PrefillState(cfg, ranks, engine, replica, sender, uplink, session, writer, bclient,
                      identity=cfg.identity(bport, info.tp_size))
    app[PREFILL_KEY] = ps
    await start_engine(app, stack, cfg, engine, replica, "prefill")
    # At a stop the sender closes first, failing the rooms still open, before the engine stops.
    stack.push_async_callback(close_sender)
    # Before that, the pull leases end: their pages go back while the engine still runs.
    stack.push_async_callback(end_leases, ps)
    logger.info("prefill %s rank %s ready: KV sender %s, bootstrap %s:%d", cfg.instance_id,
             info.name, sender.endpoint, cfg.engine.host, bport)


async def end_leases(ps: PrefillState) -> None:
    """The pull leases still held end now (each gives its pages back as it goes)."""
    await cancel_and_wait(*ps.leases)


async def start_publisher(stack: contextlib.AsyncExitStack, config: PublisherConfig) -> Any:
    """A KV-event publisher closed with ``stack``; returns its sink for the engine."""
    publisher = KVEventPublisher(config)
    stack.push_async_callback(publisher.close)
    await publisher.start()
    return publisher.drain


async def start_bootstrap(cfg: PDConfig, ranks: RankContext, bport: int,
                          stack: contextlib.AsyncExitStack,
                          served: dict[str, Any] | None = None
                          ) -> tuple[BlockWriter | None, Any]:
    """World rank 0: the instance's bootstrap server and, with etcd, its index writer fed by
    every DP group's prefix cache (``served``: the record fields of ``served_fields``).
    Returns (writer, this group's KV event sink) or Nones."""
    info = ranks.info
    url = f"http://{cfg.public_host}:{cfg.engine.port}"
    bcfg = BootstrapConfig(instance_id=cfg.instance_id or "", model=cfg.engine.model_name,
                           host=cfg.engine.host, port=bport, etcd=cfg.etcd,
                           advertise_host=cfg.public_host, auth_token=cfg.auth_token,
                           etcd_prefix=cfg.etcd_prefix, lease_ttl=cfg.lease_ttl,
                           read_timeout_s=cfg.engine.read_timeout_s,
                           instance_fields={"url": url, "tp_size": info.tp_size,
                                            "dp_size": info.dp_size, **(served or {}),
                                            **cfg.protocol_fields(bport, info.tp_size)})
    bapp = create_bootstrap_app(bcfg)
    boot_runner = make_runner(bapp, access_log=None)
    stack.push_async_callback(boot_runner.cleanup)
    await boot_runner.setup()  # claims the instance id (InstanceIdInUse)
    await web.TCPSite(boot_runner, cfg.engine.host, bport).start()
    mirror = bapp[BOOTSTRAP_STATE].mirror
    if mirror is None:
        return None, None
    # Every DP group's prefix cache: this one's fed in process, the others' by their KV events.
    sources = [(dp, SubscriberConfig(
        endpoint=endpoint,
        replay_endpoint=ranks.replay_endpoints[dp] if dp < len(ranks.replay_endpoints) else None))
        for dp, endpoint in enumerate(ranks.event_endpoints) if dp > 0 and endpoint is not None]
    pipeline, sink = await open_local_feed(
        stack, mirror.session, cfg.index_etcd, cfg.access.layout, cfg.engine.model_name,
        bcfg.instance_id, block_size=cfg.engine.page_size, sources=sources)
    return pipeline.writer, sink
