"""Transport-independent sender logic: rooms, registrations, chunking, checksums, acks, timeouts.

A backend supplies the transport (``_open``, ``_shutdown``, ``_send_frames``), feeds every incoming
message to ``_on_frames(conn, frames)``, and may change how tensors become payload
(``_encode_payload``, e.g. CUDA IPC handles instead of bytes).
"""
from __future__ import annotations

import asyncio
import logging
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from transfer import auth, wire
from transfer.backends._chunks import check_room, flip_first_byte, plan_chunks
from transfer.backends._pending import EarlyTable, check_request, without_page_ids
from transfer.backends.base import Destination, KVSender, SenderHooks
from transfer.base import TRANSFER_KEY_ENV, TransferConfig, TransferError, TransferState, TransferStatus
from transfer.layout import KVLayout, PageSource, intersect, tensor_bytes

logger = logging.getLogger(__name__)

__all__ = ["ProtocolSender", "plan_chunks"]

FINISHED_KEPT = 4096
#: Buffers smaller than this travel packed into one frame: pyzmq copies frames under 64 KiB
#: anyway, and each frame costs a send call (~50 us), which dominated small transfers.
PACK_BELOW = 64 << 10


@dataclass
class _Registration:
    conn: Hashable
    peer: str
    layout: KVLayout
    host_id: str
    device: str
    num_pages: int
    """Pages of the decode's pool."""
    chunk_bytes: int
    """Chunk size for this decode: ours, or less where its socket accepts less."""


@dataclass
class _Dest:
    reg: _Registration
    request: wire.Request
    """The decode's request without its page ids (only their count is used here)."""
    num_pages: int
    layers: tuple[int, int]
    heads: tuple[int, int]
    acked: bool = False

    def public(self) -> Destination:
        return Destination(self.reg.peer, self.request.dst_rank, self.num_pages, self.layers,
                           self.heads)


@dataclass
class _Room:
    status: TransferStatus
    dests: dict[tuple[Hashable, int], _Dest] = field(default_factory=dict)
    expected: int | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    acked: asyncio.Event = field(default_factory=asyncio.Event)
    timer: asyncio.TimerHandle | None = None
    keepalive: list[Any] = field(default_factory=list)


class ProtocolSender(KVSender):
    def __init__(self, config: TransferConfig, layout: KVLayout, source: PageSource, *,
                 host_id: str = "", device: str = "cpu") -> None:
        self.config, self.layout, self.source = config, layout, source
        self.host_id, self.device = host_id, device
        self.hooks = SenderHooks()
        self.auth = auth.TransferAuth.from_key(config.key)
        self._regs: dict[Hashable, _Registration] = {}
        self._rooms: dict[int, _Room] = {}
        self._finished: OrderedDict[int, TransferStatus] = OrderedDict()
        self._early = EarlyTable(config.early_request_ttl_s, config.max_early_requests)
        self._closed = False
        #: Counters for the worker's metrics: registrations, rooms_ok, rooms_failed, bytes_sent,
        #: auth_failures (messages dropped for a missing or wrong MAC), refused (bad requests).
        self.stats: dict[str, int] = {"registrations": 0, "rooms_ok": 0, "rooms_failed": 0,
                                      "bytes_sent": 0, "auth_failures": 0, "refused": 0}

    # ---- transport, supplied by a backend --------------------------------------------------
    @abstractmethod
    async def _open(self) -> None: ...

    @abstractmethod
    async def _shutdown(self) -> None: ...

    @abstractmethod
    async def _send_frames(self, conn: Hashable, frames: list[Any]) -> None:
        """Send one message to a connection; raise ConnectionError when it is gone."""

    def _peer_name(self, conn: Hashable) -> str:
        return str(conn)

    def _encode_payload(self, reg: _Registration, tensors: list[torch.Tensor]
                        ) -> tuple[dict[str, Any], list[Any], list[Any]]:
        """(extra header fields, buffers to send, objects to keep alive until the ack)."""
        cpu = [t if t.device.type == "cpu" else t.cpu() for t in tensors]
        buffers = [tensor_bytes(t) for t in cpu]
        extra = self._bytes_checksum(buffers)
        if buffers and buffers[0].nbytes < PACK_BELOW:
            buffers = [wire.pack(buffers)]
            extra["packed"] = True
        return extra, buffers, cpu

    def _bytes_checksum(self, buffers: list[Any]) -> dict[str, Any]:
        """Header fields of a bytes payload's integrity check: with a key the message's MAC
        covers the bytes (one pass, not two); otherwise xxh3."""
        if self.auth is not None:
            return {"checksum": 0, "checksum_algo": auth.ALGO, "payload": "bytes"}
        return {"checksum": wire.checksum(buffers), "payload": "bytes"}

    # ---- public API ------------------------------------------------------------------------
    async def start(self) -> None:
        await self._open()
        if self.auth is None:
            logger.warning("KV sender %s runs without transfer authentication: %s is not set, so "
                           "any process that reaches this port can register, abort rooms and "
                           "receive KV; set the same key on every prefill and decode",
                           self.endpoint, TRANSFER_KEY_ENV)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for room in list(self._rooms):
            self._fail(room, TransferError(room, "the prefill rank's sender closed"), notify=True)
        await asyncio.sleep(0)
        await self._shutdown()

    def create(self, room: int) -> TransferStatus:
        check_room(room)
        if room in self._rooms:
            return self._rooms[room].status
        if room in self._finished:
            raise TransferError(room, "this room already ran on this prefill rank; the router must "
                                "draw a new bootstrap_room for every attempt")
        st = _Room(TransferStatus(room))
        self._rooms[room] = st
        st.timer = asyncio.get_running_loop().call_later(
            self.config.bootstrap_timeout_s, self._timeout, room, TransferState.BOOTSTRAPPING)
        early, aborted = self._early.pop(room)
        if aborted is not None:
            self._fail(room, aborted, notify=False)
            return st.status
        for item in early:
            if item.conn in self._regs:
                self._add_request(st, item.conn, item.request, item.num_pages)
        return st.status

    async def wait_bootstrapped(self, room: int) -> list[Destination]:
        st = self._rooms.get(room)
        if st is None:
            done = self._finished.get(room)
            if done is not None and done.error is not None:
                raise done.error  # it failed before the caller got here (e.g. a decode abort)
            self.create(room)
            st = self._rooms[room]
        await self._wait(st, st.ready)
        return [d.public() for d in st.dests.values()]

    async def send(self, room: int, page_ids: Sequence[int], *, first_token: int,
                   cached_tokens: int) -> None:
        await self.wait_bootstrapped(room)
        st = self._rooms[room]
        page_ids = list(page_ids)
        for d in st.dests.values():
            if d.num_pages != len(page_ids):
                self._fail(room, TransferError(
                    room, f"decode rank {d.request.dst_rank} reserved {d.num_pages} "
                    f"pages but this prefill rank has {len(page_ids)} pages of KV; both sides must "
                    "use the same page_size and prompt", peer=d.reg.peer), notify=True)
                return await self._wait(st, st.acked)
        st.status.advance(TransferState.TRANSFERRING)
        try:
            await asyncio.gather(*(self._send_dest(st, d, page_ids, first_token, cached_tokens)
                                   for d in st.dests.values()))
        except (ConnectionError, OSError) as e:
            self._fail(room, TransferError(room, f"sending to the decode failed: {e}; the decode "
                                           "rank probably went away"), notify=True)
        except TransferError as e:
            self._fail(room, e.with_context(room=room), notify=True)
        except asyncio.CancelledError:
            self._fail(room, TransferError(room, "the prefill request was cancelled"), notify=True)
            raise
        except Exception as e:  # the page source is the caller's code: fail the room, not the rank
            logger.exception("room %s: reading or encoding pages failed", room)
            self._fail(room, TransferError(room, f"reading or encoding the pages failed: "
                                           f"{type(e).__name__}: {e}"), notify=True)
        if not st.status.state.terminal:
            self._set_timer(st, self.config.waiting_timeout_s, TransferState.TRANSFERRING)
        await self._wait(st, st.acked)

    def abort(self, room: int, reason: str) -> None:
        self._fail(room, TransferError(room, f"aborted by the prefill: {reason}"), notify=True)

    def poll(self, room: int) -> TransferState | None:
        st = self._rooms.get(room)
        if st is not None:
            return st.status.state
        done = self._finished.get(room)
        return done.state if done else None

    def status(self, room: int) -> TransferStatus | None:
        st = self._rooms.get(room)
        return st.status if st else self._finished.get(room)

    def registered_peers(self) -> dict[str, KVLayout]:
        """Decode ranks registered on this rank's connections, with their layouts."""
        return {r.peer: r.layout for r in self._regs.values()}

    # ---- sending ---------------------------------------------------------------------------
    async def _send_dest(self, st: _Room, d: _Dest, page_ids: list[int], first_token: int,
                         cached_tokens: int) -> None:
        room, req = st.status.room, d.request
        chunks = 0
        for layers, start, stop in plan_chunks(len(page_ids), d.layers,
                                               self.layout.page_bytes((0, 1), d.heads),
                                               d.reg.chunk_bytes):
            if st.status.state.terminal:
                return
            wire_room = self.hooks.room_override.get(room, room) \
                if chunks >= self.hooks.from_chunk else room
            ids = page_ids[start:stop]
            tensors = self.source.read_pages(ids, layers, d.heads)
            extra, buffers, keep = self._encode_payload(d.reg, tensors)
            st.keepalive.append(keep)
            msg = wire.Pages(transfer_id=req.transfer_id, room=wire_room, page_start=start,
                             page_count=len(ids), layers=layers, heads=d.heads,
                             dtype=self.layout.dtype,
                             shape=(len(ids), self.layout.page_size, d.heads[1] - d.heads[0],
                                    self.layout.head_dim),
                             buffers=buffers, **extra)
            frames = self._encode(msg)
            if room in self.hooks.corrupt_rooms and chunks >= self.hooks.from_chunk and buffers:
                # in flight: after checksum and MAC. Header-only (IPC) chunks have no buffer to
                # corrupt; with a key their frame 1 is the MAC, which must stay as computed.
                frames[1] = flip_first_byte(frames[1])
            await self._send_frames(d.reg.conn, frames)
            chunks += 1
            self.stats["bytes_sent"] += sum(t.numel() * t.element_size() for t in tensors)
        final = wire.Final(transfer_id=req.transfer_id,
                           room=self.hooks.room_override.get(room, room), first_token=first_token,
                           cached_tokens=cached_tokens, num_pages=len(page_ids), num_chunks=chunks)
        await self._send_frames(d.reg.conn, self._encode(final))

    def _encode(self, msg: wire.Message) -> list[Any]:
        return wire.encode(msg, self.auth, auth.P2D)

    # ---- incoming --------------------------------------------------------------------------
    async def _on_frames(self, conn: Hashable, frames: Sequence[Any]) -> None:
        try:
            msg = wire.decode(frames, self.auth, auth.D2P)
        except wire.AuthError as e:
            self.stats["auth_failures"] += 1
            logger.warning("dropping a message from %s: %s", self._peer_name(conn), e)
            if e.kind == wire.Register.KIND:  # tell the decode why it cannot register
                await self._reply(conn, wire.RegisterAck(ok=False, layout=self.layout,
                                                         error=str(e)))
            return
        except wire.WireError as e:
            logger.warning("dropping a bad message from %s: %s", self._peer_name(conn), e)
            return
        if isinstance(msg, wire.Register):
            await self._on_register(conn, msg)
        elif isinstance(msg, wire.Request):
            await self._on_request(conn, msg)
        elif isinstance(msg, wire.Ack):
            self._on_ack(conn, msg)
        elif isinstance(msg, wire.Abort):
            error = TransferError(msg.room, f"aborted by the decode: {msg.reason}",
                                  peer=self._peer_name(conn))
            if msg.room in self._rooms:
                self._fail(msg.room, error, notify=True)
            elif msg.room not in self._finished and conn in self._regs:
                # the decode gave up before this rank saw the room: fail it on arrival
                if not self._early.add_abort(msg.room, error):
                    logger.warning("dropping the decode's abort of room %s: %d early requests and "
                                   "aborts are kept already (transfer max_early_requests)",
                                   msg.room, len(self._early))
        elif isinstance(msg, wire.Heartbeat) and not msg.reply:
            await self._reply(conn, wire.Heartbeat(seq=msg.seq, reply=True))
        else:
            logger.warning("unexpected %s message from %s", msg.KIND, self._peer_name(conn))

    async def _on_register(self, conn: Hashable, msg: wire.Register) -> None:
        problems = self.layout.mismatches(msg.layout)
        for name in ("heads", "layers"):
            mine, theirs = getattr(self.layout, name), getattr(msg.layout, name)
            if not problems and intersect(mine, theirs) is None:
                problems.append(f"{name}: this prefill rank holds {mine}, the decode rank needs "
                                f"{theirs}; no overlap (check the rank mapping)")
        if problems:
            error = "KV layout mismatch between prefill and decode: " + "; ".join(problems)
            logger.warning("refusing registration of %s: %s", msg.receiver_id, error)
            await self._reply(conn, wire.RegisterAck(ok=False, layout=self.layout, error=error))
            return
        if not (isinstance(msg.num_pages, int) and msg.num_pages > 0
                and isinstance(msg.max_chunk_bytes, int) and msg.max_chunk_bytes > 0):
            await self._reply(conn, wire.RegisterAck(
                ok=False, layout=self.layout, error=f"registration needs a positive num_pages and "
                f"max_chunk_bytes, got {msg.num_pages!r} and {msg.max_chunk_bytes!r}"))
            return
        self._regs[conn] = _Registration(conn, msg.receiver_id or self._peer_name(conn),
                                         msg.layout, msg.host_id, msg.device, msg.num_pages,
                                         min(self.config.chunk_bytes, msg.max_chunk_bytes))
        self.stats["registrations"] += 1
        await self._reply(conn, wire.RegisterAck(ok=True, layout=self.layout, host_id=self.host_id,
                                                 device=self.device))

    async def _on_request(self, conn: Hashable, req: wire.Request) -> None:
        room = req.room
        reg = self._regs.get(conn)
        if reg is None:
            await self._reply(conn, wire.Abort(room=room, transfer_id=req.transfer_id, reason=(
                "this prefill rank has no layout registration for the connection (it restarted?); "
                "the decode drops the connection and registers again on the next request"),
                code=wire.ABORT_UNREGISTERED))
            return
        problem = check_request(req, reg.num_pages, self.source.num_pages)
        if problem:  # before anything is stored, so a bad request costs nothing here
            self.stats["refused"] += 1
            logger.warning("refusing a request from %s: %s", reg.peer, problem)
            if isinstance(req.transfer_id, int) and isinstance(room, int):
                await self._reply(conn, wire.Abort(room=room, transfer_id=req.transfer_id,
                                                   reason=f"bad request: {problem}"))
            return
        num_pages = len(req.dst_page_ids)
        st = self._rooms.get(room)
        if st is None:
            if room in self._finished:
                await self._reply(conn, wire.Abort(room=room, transfer_id=req.transfer_id, reason=(
                    f"room {room} already ended on this prefill rank "
                    f"({self._finished[room].state.name})")))
                return
            if not self._early.add_request(conn, req, num_pages):
                await self._reply(conn, wire.Abort(room=room, transfer_id=req.transfer_id, reason=(
                    f"this prefill rank already holds {len(self._early)} requests and aborts for "
                    "rooms it has not started (transfer max_early_requests); it is overloaded or "
                    "decodes ask for rooms the router never sent it")))
            return
        self._add_request(st, conn, req, num_pages)

    def _add_request(self, st: _Room, conn: Hashable, req: wire.Request, num_pages: int) -> None:
        room, reg = st.status.room, self._regs[conn]
        if st.status.state is not TransferState.BOOTSTRAPPING:
            self._fail(room, TransferError(room, f"decode rank {req.dst_rank} asked after the room "
                                           f"left Bootstrapping ({st.status.state.name})",
                                           peer=reg.peer), notify=True)
            return
        if st.expected is not None and req.num_requesters != st.expected:
            self._fail(room, TransferError(room, f"decode ranks disagree on how many ranks read this "
                                           f"prefill rank: {st.expected} vs {req.num_requesters}",
                                           peer=reg.peer), notify=True)
            return
        layers = intersect(reg.layout.layers, self.layout.layers)
        heads = intersect(reg.layout.heads, self.layout.heads)
        if layers is None or heads is None:
            self._fail(room, TransferError(room, f"decode rank {req.dst_rank} holds layers "
                                           f"{reg.layout.layers} heads {reg.layout.heads}, which do "
                                           f"not overlap this rank's layers {self.layout.layers} "
                                           f"heads {self.layout.heads}", peer=reg.peer), notify=True)
            return
        st.expected = req.num_requesters
        st.dests[(conn, req.dst_rank)] = _Dest(reg, without_page_ids(req), num_pages, layers,
                                               heads)
        if len(st.dests) >= st.expected:
            st.status.advance(TransferState.WAITING_FOR_INPUT)
            if st.timer:
                st.timer.cancel()
                st.timer = None
            st.ready.set()

    def _on_ack(self, conn: Hashable, msg: wire.Ack) -> None:
        st = self._rooms.get(msg.room)
        if st is None or st.status.state is not TransferState.TRANSFERRING:
            return
        for d in st.dests.values():
            if d.reg.conn == conn and d.request.transfer_id == msg.transfer_id:
                d.acked = True
        if all(d.acked for d in st.dests.values()):
            st.status.advance(TransferState.SUCCESS)
            self._finish(st)

    # ---- failure and bookkeeping -----------------------------------------------------------
    async def _reply(self, conn: Hashable, msg: wire.Message) -> None:
        try:
            await self._send_frames(conn, self._encode(msg))
        except (ConnectionError, OSError) as e:
            logger.info("could not answer %s: %s", self._peer_name(conn), e)

    def _timeout(self, room: int, stage: TransferState) -> None:
        st = self._rooms.get(room)
        if st is None or st.status.state is not stage:
            return
        if stage is TransferState.BOOTSTRAPPING:
            reason = (f"no decode rank asked for this room within {self.config.bootstrap_timeout_s} s "
                      f"({len(st.dests)} of {st.expected or '?'} asked); check that the router sent "
                      "the request to a decode and that the decode can reach " + self.endpoint)
        else:
            reason = (f"the decode did not confirm the pages within {self.config.waiting_timeout_s} s")
        self._fail(room, TransferError(room, reason), notify=True)

    def _set_timer(self, st: _Room, seconds: float, stage: TransferState) -> None:
        if st.timer:
            st.timer.cancel()
        st.timer = asyncio.get_running_loop().call_later(seconds, self._timeout,
                                                         st.status.room, stage)

    def _fail(self, room: int, error: TransferError, *, notify: bool) -> None:
        st = self._rooms.get(room)
        if st is None or not st.status.fail(error):
            return
        logger.info("%s", st.status.error)
        if notify:
            for d in st.dests.values():
                abort = wire.Abort(room=room, transfer_id=d.request.transfer_id, reason=error.reason)
                asyncio.ensure_future(self._reply(d.reg.conn, abort))
        self._finish(st)

    def _finish(self, st: _Room) -> None:
        ok = st.status.state is TransferState.SUCCESS
        self.stats["rooms_ok" if ok else "rooms_failed"] += 1
        if st.timer:
            st.timer.cancel()
        st.keepalive.clear()
        st.ready.set()
        st.acked.set()
        room = st.status.room
        self._rooms.pop(room, None)
        self._finished[room] = st.status
        while len(self._finished) > FINISHED_KEPT:
            self._finished.popitem(last=False)

    async def _wait(self, st: _Room, event: asyncio.Event) -> None:
        try:
            await event.wait()
        except asyncio.CancelledError:  # the prefill request was dropped: free the decode too
            self._fail(st.status.room, TransferError(st.status.room, "the prefill request was "
                                                     "cancelled"), notify=True)
            raise
        if st.status.state is TransferState.FAILED:
            assert st.status.error is not None
            raise st.status.error
