"""Start a prefill or decode instance: one process per rank on this node.

The launching process runs this node's first rank and spawns the others (``spawn`` start method,
each dies with its parent). Every rank joins torch.distributed (gloo); world rank 0 broadcasts
the bootstrap server's address before any rank registers (multi-node: ranks on other nodes would
otherwise PUT to the wrong port), then the DP group leaders' HTTP ports are exchanged so that
world rank 0 can forward requests to the group that serves them.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from aiohttp import web

from bootstrap.client import BootstrapClient, BootstrapClientConfig
from bootstrap.http_limits import runner_options
from bootstrap.registration import put_route
from engine.pd.common import Bootstrap, build_rank
from engine.pd.config import PDConfig
from engine.pd.fetch import DecodeRank, FetchError
from engine.pd.state import RankContext, rank_route
from engine.ranks.dist import Dist, RankInfo, die_with_parent, local_world_ranks
from engine.ranks.rank_watch import RankWatch
from engine.ranks.replica import follow, loop_handoff
from engine.ranks.uplink import UplinkClient
from engine.scheduler import Scheduler
from transfer import KVLayout, TensorPageSource, TransferError, create_receiver, create_sender
from transfer.tuning import tune_host_allocator

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def serve(cfg: PDConfig) -> int:
    """Run this node's ranks until interrupted (blocking; used by the CLI). Returns the exit
    status: 1 when a rank process died and took the instance down with it."""
    world = cfg.world_size
    local = local_world_ranks(world, cfg.nnodes, cfg.node_rank)
    init_addr = cfg.dist_init_addr
    if world > 1 and init_addr is None:
        init_addr = f"127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    children = [ctx.Process(target=_child, args=(cfg, r, init_addr), name=f"kvatlas-rank{r}")
                for r in local[1:]]
    for p in children:
        p.start()
    watch = RankWatch(children)
    watch.start()
    try:
        run_rank(cfg, local[0], init_addr, on_shutdown=watch.stop)
    finally:
        watch.stop()
        for p in children:
            if p.is_alive():
                p.terminate()
        for p in children:
            p.join(10)
            if p.is_alive():
                p.kill()
    return 1 if watch.dead is not None else 0


def _child(cfg: PDConfig, world_rank: int, init_addr: str | None) -> None:
    die_with_parent()
    # A terminal's Ctrl-C reaches the whole process group: the leader stops the ranks itself,
    # in order (a DP group leader's server installs its own handler all the same).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("KVATLAS_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s rank{world_rank} %(levelname)s %(name)s: %(message)s")
    run_rank(cfg, world_rank, init_addr)


def run_rank(cfg: PDConfig, world_rank: int, init_addr: str | None,
             on_shutdown: Callable[[], None] | None = None) -> None:
    """Run one rank. ``on_shutdown``: called as a leader's server begins to stop."""
    # Before the ZMQ context and its I/O thread exist: one malloc arena lets received KV frames
    # reuse memory instead of re-faulting fresh pages on every transfer (bench/transfer.py).
    tune_host_allocator()
    import torch

    if cfg.engine.torch_threads is not None:
        torch.set_num_threads(cfg.engine.torch_threads)
    info = RankInfo(world_rank, cfg.world_size, cfg.tp, cfg.dp, cfg.nnodes, cfg.node_rank)
    dist = Dist(info, init_addr)
    try:
        host = cfg.engine.host
        # KV events of DP groups 1.. flow to world rank 0's index writer (it binds, they connect)
        events = [None] + [f"tcp://{host}:{free_port(host)}" for _ in range(1, cfg.dp)] \
            if world_rank == 0 and cfg.mode == "prefill" and cfg.etcd is not None else None
        boot_host, bport, events = dist.world_broadcast(
            (host, cfg.bootstrap_port or free_port(host), events))
        port = replay = None
        if info.is_leader:
            port = cfg.engine.port if world_rank == 0 else free_port(host)
            if events and info.dp_rank > 0:
                replay = f"tcp://{host}:{free_port(host)}"
        ports = dist.world_gather((host, port, replay))
        dp_urls = [f"http://{ports[d * cfg.tp][0]}:{ports[d * cfg.tp][1]}"
                   for d in range(cfg.dp)]
        replays = [ports[d * cfg.tp][2] for d in range(cfg.dp)]
        if info.is_leader:
            mine = replace(cfg, engine=replace(cfg.engine, port=port), bootstrap_port=bport)
            ranks = RankContext(info, dist, bport, dp_urls, events or [], replays)
            if cfg.mode == "prefill":
                from engine.pd.prefill_app import create_prefill_app as make
            else:
                from engine.pd.decode import create_decode_app as make
            app = make(mine, ranks)
            if on_shutdown is not None:
                async def shutting_down(_: web.Application) -> None:
                    on_shutdown()
                app.on_shutdown.append(shutting_down)
            # handler_cancellation: a client that hangs up aborts its request and frees its pages
            web.run_app(app, host=cfg.engine.host, port=port, print=None,
                        access_log=None, handler_cancellation=True, **runner_options(app))
        else:
            asyncio.run(follower_main(cfg, info, dist, Bootstrap(boot_host, bport, 1)))
    finally:
        dist.close()


async def follower_main(cfg: PDConfig, info: RankInfo, dist: Dist, boot: Bootstrap) -> None:
    loop = asyncio.get_running_loop()
    sched, layout = await loop.run_in_executor(None, build_rank, cfg, info, dist)
    # A start that fails at any step closes what it had opened (in reverse order), as a stop does.
    async with contextlib.AsyncExitStack() as stack:
        uplink = UplinkClient(dist.group_broadcast(None), info.tp_rank)
        stack.callback(uplink.close)
        start = prefill_follower if cfg.mode == "prefill" else decode_follower
        on_op = await start(cfg, info, sched, layout, boot, uplink, stack)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        stack.callback(executor.shutdown, wait=False)
        await loop.run_in_executor(executor, follow, sched, dist, loop_handoff(loop, on_op))


OnOp = Callable[[tuple[Any, ...]], Awaitable[None]]


async def prefill_follower(cfg: PDConfig, info: RankInfo, sched: Scheduler, layout: KVLayout,
                           boot: Bootstrap, uplink: UplinkClient,
                           stack: contextlib.AsyncExitStack) -> OnOp:
    """A prefill follower's sender, registered with the bootstrap server; returns the handler
    of the leader's transfer commands."""
    sender = create_sender(cfg.transfer_backend, cfg.transfer, layout,
                           TensorPageSource(sched.pool.kv, layout), host=cfg.engine.host)
    await sender.start()
    stack.push_async_callback(sender.close)
    _, rank_port = sender.rank_address
    await put_route(f"http://{boot.addr}", rank_route(cfg, info, cfg.public_host, rank_port),
                    token=cfg.auth_token)

    async def on_op(op: tuple[Any, ...]) -> None:
        if op[0] == "abort":
            # The leader gave the room up (its client left, or its own send failed): fail
            # it here now, not at this rank's timeout; the pending send then reports it.
            # Runs before the engine thread gives the pages back (loop_handoff waits).
            _, room, reason = op
            sender.abort(room, reason)
            return
        if op[0] != "send":
            return
        _, room, pages, first, cached = op
        try:
            sender.create(room)
            await sender.send(room, pages, first_token=first, cached_tokens=cached)
            await uplink.report("send", room, True)
        except TransferError as exc:
            await uplink.report("send", room, False, str(exc))
    return on_op


async def decode_follower(cfg: PDConfig, info: RankInfo, sched: Scheduler, layout: KVLayout,
                          boot: Bootstrap, uplink: UplinkClient,
                          stack: contextlib.AsyncExitStack) -> OnOp:
    """A decode follower's receiver and bootstrap client; returns the handler of the leader's
    transfer commands."""
    receiver = create_receiver(cfg.transfer_backend, cfg.transfer, layout, sched.pool.kv)
    await receiver.start()
    stack.push_async_callback(receiver.close)
    client = BootstrapClient(BootstrapClientConfig(auth_token=cfg.auth_token))
    await client.start()
    stack.push_async_callback(client.close)
    rank = DecodeRank(cfg, info, receiver, client)
    aborted: dict[int, str] = {}

    async def on_op(op: tuple[Any, ...]) -> None:
        kind = op[0]
        if kind == "receive":
            _, host, port, room, pages = op
            try:
                res = await rank.fetch(Bootstrap(host, port, room), pages,
                                       guard=lambda: aborted.pop(room, None))
                await uplink.report("receive", room, True, first_token=res.first_token)
            except FetchError as exc:
                await uplink.report("receive", room, False, exc.reason, stage=exc.stage,
                                    peer=exc.peer)
        elif kind == "abort":
            _, room, reason = op
            if receiver.poll(room) is None:
                aborted[room] = reason
            receiver.abort(room, reason)
        elif kind == "fail_prefill":
            rank.fail_prefill(op[1], op[2])
    return on_op
