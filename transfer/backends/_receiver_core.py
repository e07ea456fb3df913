"""Transport-independent receiver logic: registration, requests, validation before any write.

Order of checks for every ``pages`` chunk, all before a byte of it reaches the pool: its MAC (with
a transfer key; checked while decoding); the chunk belongs to a live transfer of this connection;
its room equals the room this transfer asked for; dtype, layer and head box, page range and shape
match what was agreed; the checksum over the received bytes equals the header's (with a key, the
MAC is that check). Chunks are held back (not written) until every peer's first chunk passed, so a
swapped room in any peer's first chunk leaves the pool untouched.

What holds when chunk k > 0 fails: chunks are written as they pass, not staged until the last one
(staging would hold the whole transfer in memory and give up the copy that overlaps the network).
So chunks before k may already be in the room's own reserved pages. Those pages are released to the
caller uncommitted (``receive`` raises, ``released_pages`` names them); no page outside the
reservation is ever written, and nothing reads a failed room's pages as KV.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
import uuid
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from transfer import auth, wire
from transfer.backends._chunks import check_room
from transfer.backends._receiver_checks import PeerRx, check_coverage, chunk_problems, requesters
from transfer.backends._receiver_write import PoolWriter
from transfer.backends.base import KVReceiver, ReceiveResult
from transfer.base import TRANSFER_KEY_ENV, TransferConfig, TransferError, TransferState, TransferStatus
from transfer.layout import KVLayout, bytes_array, dtype_from_name, intersect

logger = logging.getLogger(__name__)

FINISHED_KEPT = 4096
ReleasePages = Callable[[Sequence[int]], None]


@dataclass
class _Peer:
    endpoint: str
    layout: KVLayout | None = None
    host_id: str = ""
    device: str = "cpu"
    registered: asyncio.Future | None = None
    pings: dict[int, asyncio.Future] = field(default_factory=dict)
    rooms: set[int] = field(default_factory=set)


@dataclass
class _Rx:
    status: TransferStatus
    transfer_id: int
    dst_page_ids: list[int]
    peers: dict[str, PeerRx]
    done: asyncio.Future
    started: float = field(default_factory=time.monotonic)
    held: list[tuple[str, wire.Pages, list[Any]]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
    nbytes: int = 0
    chunks: int = 0


class ProtocolReceiver(KVReceiver):
    def __init__(self, config: TransferConfig, layout: KVLayout, pool: torch.Tensor, *,
                 receiver_id: str | None = None, release_pages: ReleasePages | None = None,
                 host_id: str = "", device: str | None = None) -> None:
        layout.check_pool(pool, "decode KV pool")
        self.config, self.layout, self.pool = config, layout, pool
        self.writer = PoolWriter(pool, layout)
        self.receiver_id = receiver_id or f"decode-tp{layout.tp_rank}-{uuid.uuid4().hex[:8]}"
        self.release_pages = release_pages
        self.host_id = host_id
        self.device = device or str(pool.device)
        self.auth = auth.TransferAuth.from_key(config.key)
        #: The largest message a prefill may send here (a pages chunk of at most chunk_bytes, or
        #: one page of one layer where that is larger); the socket refuses anything bigger.
        self.max_message_bytes = wire.max_pages_message_bytes(layout, config.chunk_bytes)
        self._peers: dict[str, _Peer] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._rx: dict[int, _Rx] = {}            # by transfer id
        self._by_room: dict[int, _Rx] = {}
        self._finished: OrderedDict[int, TransferStatus] = OrderedDict()
        self._ids = itertools.count(1)
        self._seq = itertools.count(1)
        #: Counters for the worker's metrics.
        self.stats: dict[str, int] = {"registrations": 0, "rooms_ok": 0, "rooms_failed": 0,
                                      "bytes_received": 0, "room_mismatches": 0,
                                      "checksum_failures": 0, "auth_failures": 0}

    # ---- transport, supplied by a backend --------------------------------------------------
    @abstractmethod
    async def _open(self, endpoint: str) -> None: ...

    @abstractmethod
    async def _drop(self, endpoint: str) -> None:
        """Close the connection to ``endpoint`` (no-op when there is none)."""

    @abstractmethod
    async def _send_frames(self, endpoint: str, frames: list[Any]) -> None: ...

    async def _shutdown(self) -> None:
        for endpoint in list(self._peers):
            await self._drop(endpoint)

    def _payload_tensors(self, endpoint: str, msg: wire.Pages) -> tuple[int, list[Any]]:
        """(checksum over what arrived, sources to copy from: tensors, or numpy integer views of
        received bytes). Bytes payload by default."""
        if msg.payload != "bytes":
            raise TransferError(msg.room, f"payload {msg.payload!r} is not supported by this "
                                "backend; use the same backend on both sides", peer=endpoint)
        if msg.checksum_algo == auth.ALGO and self.auth is not None:
            actual = msg.checksum  # the message's MAC, checked in decode, covers these bytes
        elif msg.checksum_algo != wire.CHECKSUM_XXH3:
            raise TransferError(msg.room, f"checksum algorithm {msg.checksum_algo!r} is not "
                                f"{wire.CHECKSUM_XXH3!r} for a bytes payload (nor a MAC this side "
                                "checked)", peer=endpoint)
        else:
            actual = wire.checksum(msg.buffers)
        dtype = dtype_from_name(msg.dtype)
        try:
            return actual, [bytes_array(b, dtype, msg.shape) for b in msg.buffers]
        except ValueError as e:
            raise TransferError(msg.room, f"payload buffers do not match the header's shape "
                                f"{tuple(msg.shape)}: {e}", peer=endpoint) from None

    # ---- public API ------------------------------------------------------------------------
    async def start(self) -> None:
        if self.auth is None:
            logger.warning("KV receiver %s runs without transfer authentication: %s is not set, so "
                           "whoever the bootstrap table names can deliver KV to it; set the same "
                           "key on every prefill and decode", self.receiver_id, TRANSFER_KEY_ENV)

    async def close(self) -> None:
        for rx in list(self._rx.values()):
            self._fail(rx, TransferError(rx.status.room, "the decode rank's receiver closed"))
        await self._shutdown()

    async def connect(self, endpoint: str) -> KVLayout:
        lock = self._locks.setdefault(endpoint, asyncio.Lock())
        async with lock:
            peer = self._peers.get(endpoint)
            if peer is not None and peer.layout is not None:
                return peer.layout
            peer = self._peers[endpoint] = _Peer(endpoint)
            peer.registered = asyncio.get_running_loop().create_future()
            try:
                await self._open(endpoint)
                await self._send_frames(endpoint, self._encode(wire.Register(
                    receiver_id=self.receiver_id, layout=self.layout,
                    num_pages=int(self.pool.shape[2]), max_chunk_bytes=self.config.chunk_bytes,
                    host_id=self.host_id, device=self.device)))
                ack: wire.RegisterAck = await asyncio.wait_for(peer.registered,
                                                               self.config.connect_timeout_s)
            except TransferError:  # the answer failed authentication
                await self._forget_peer(endpoint)
                raise
            except (TimeoutError, ConnectionError, OSError) as e:
                await self._forget_peer(endpoint)
                why = (f"no answer within {self.config.connect_timeout_s} s"
                       if isinstance(e, asyncio.TimeoutError) else f"{type(e).__name__}: {e}")
                raise TransferError(None, f"layout registration with prefill rank {endpoint} failed "
                                    f"({why}); check that the rank is up and that rank_ip/rank_port "
                                    "in the bootstrap table are reachable from this host",
                                    peer=endpoint) from None
            if not ack.ok or ack.layout is None:
                await self._forget_peer(endpoint)
                raise TransferError(None, ack.error or "registration refused", peer=endpoint)
            problems = self.layout.mismatches(ack.layout)
            if problems:
                await self._forget_peer(endpoint)
                raise TransferError(None, "KV layout mismatch between decode and prefill: "
                                    + "; ".join(problems), peer=endpoint)
            peer.layout, peer.host_id, peer.device = ack.layout, ack.host_id, ack.device
            self.stats["registrations"] += 1
            return ack.layout

    async def receive(self, room: int, peers: Sequence[str], dst_page_ids: Sequence[int], *,
                      num_requesters: int | None = None) -> ReceiveResult:
        if room in self._by_room or room in self._finished:
            raise TransferError(room, "this decode rank already has a transfer for this room; the "
                                "router must draw a new bootstrap_room for every attempt")
        check_room(room)
        if not peers:
            raise ValueError("receive() needs at least one prefill peer")
        dst = [int(p) for p in dst_page_ids]
        if not dst or len(set(dst)) != len(dst) or min(dst) < 0 or max(dst) >= self.pool.shape[2]:
            raise ValueError(f"destination pages must be distinct ids in [0, {self.pool.shape[2]}), "
                             f"got {len(dst)} ids")
        tid = next(self._ids)
        rx = _Rx(TransferStatus(room), tid, dst, {},
                 asyncio.get_running_loop().create_future())
        self._rx[tid] = rx
        self._by_room[room] = rx
        try:
            for endpoint in dict.fromkeys(peers):
                layout = await self.connect(endpoint)
                self._check_rx_alive(rx)
                layers = intersect(self.layout.layers, layout.layers)
                heads = intersect(self.layout.heads, layout.heads)
                if layers is None or heads is None:
                    raise TransferError(room, f"prefill rank {endpoint} holds layers {layout.layers} "
                                        f"heads {layout.heads}: nothing this rank (layers "
                                        f"{self.layout.layers} heads {self.layout.heads}) needs; "
                                        "check the rank mapping", peer=endpoint)
                rx.peers[endpoint] = PeerRx(layers, heads,
                                             bytearray(len(dst) * (layers[1] - layers[0])))
                self._peers[endpoint].rooms.add(room)
            check_coverage(room, self.layout, rx.peers)
            for endpoint in rx.peers:
                n = num_requesters or requesters(self.layout, self._peers[endpoint].layout)
                await self._send_frames(endpoint, self._encode(wire.Request(
                    transfer_id=tid, room=room, dst_rank=self.layout.tp_rank, num_requesters=n,
                    dst_page_ids=dst)))
            self._check_rx_alive(rx)
            rx.status.advance(TransferState.WAITING_FOR_INPUT)
            rx.timer = asyncio.get_running_loop().call_later(self.config.waiting_timeout_s,
                                                             self._timeout, tid)
        except TransferError as e:
            self._fail(rx, e)
        except (ConnectionError, OSError) as e:
            self._fail(rx, TransferError(room, f"sending the request failed: {e}"))
        except asyncio.CancelledError:
            self._fail(rx, TransferError(room, "the decode request was cancelled"))
            raise
        try:
            return await asyncio.shield(rx.done)
        except asyncio.CancelledError:  # the caller gave up: free the pages, tell the prefill
            self._fail(rx, TransferError(room, "the decode request was cancelled"))
            raise

    def abort(self, room: int, reason: str) -> None:
        rx = self._by_room.get(room)
        if rx is not None:
            self._fail(rx, TransferError(room, f"aborted by the decode: {reason}"))

    def fail_peer(self, endpoint: str, reason: str) -> list[int]:
        peer = self._peers.get(endpoint)
        failed = []
        for rx in list(self._rx.values()):
            if endpoint in rx.peers:
                self._fail(rx, TransferError(rx.status.room, f"prefill rank {endpoint} declared dead: "
                                             f"{reason}", peer=endpoint), notify=False)
                failed.append(rx.status.room)
        if peer is not None:
            asyncio.ensure_future(self._forget_peer(endpoint))
        return failed

    async def ping(self, endpoint: str, timeout: float) -> bool:
        peer = self._peers.get(endpoint)
        if peer is None or peer.layout is None:
            return False
        seq = next(self._seq)
        fut = peer.pings[seq] = asyncio.get_running_loop().create_future()
        try:
            await self._send_frames(endpoint, self._encode(wire.Heartbeat(seq=seq)))
            await asyncio.wait_for(fut, timeout)
            return True
        except (TimeoutError, ConnectionError, OSError):
            return False
        finally:
            peer.pings.pop(seq, None)

    def poll(self, room: int) -> TransferState | None:
        rx = self._by_room.get(room)
        if rx is not None:
            return rx.status.state
        done = self._finished.get(room)
        return done.state if done else None

    def status(self, room: int) -> TransferStatus | None:
        rx = self._by_room.get(room)
        return rx.status if rx else self._finished.get(room)

    def connected_peers(self) -> list[str]:
        return [e for e, p in self._peers.items() if p.layout is not None]

    # ---- incoming --------------------------------------------------------------------------
    def _encode(self, msg: wire.Message) -> list[Any]:
        return wire.encode(msg, self.auth, auth.D2P)

    async def _on_frames(self, endpoint: str, frames: Sequence[Any]) -> None:
        peer = self._peers.get(endpoint)
        try:
            msg = wire.decode(frames, self.auth, auth.P2D)
        except wire.WireError as e:
            self._on_bad_message(endpoint, peer, e)
            return
        if peer is None:
            return
        if isinstance(msg, wire.RegisterAck):
            if peer.registered is not None and not peer.registered.done():
                peer.registered.set_result(msg)
        elif isinstance(msg, wire.Heartbeat):
            if msg.reply:
                fut = peer.pings.get(msg.seq)
                if fut is not None and not fut.done():
                    fut.set_result(True)
            else:
                await self._send_frames(endpoint, self._encode(wire.Heartbeat(seq=msg.seq,
                                                                              reply=True)))
        elif isinstance(msg, (wire.Pages, wire.Final, wire.Abort)):
            rx = self._rx.get(msg.transfer_id) if msg.transfer_id is not None else None
            if rx is None or endpoint not in rx.peers:
                logger.debug("%s for unknown transfer %s from %s", msg.KIND, msg.transfer_id, endpoint)
                return
            try:
                if isinstance(msg, wire.Abort):
                    if msg.code == wire.ABORT_UNREGISTERED:  # the prefill rank restarted
                        asyncio.ensure_future(self._forget_peer(endpoint))
                    raise TransferError(rx.status.room, f"aborted by the prefill: {msg.reason}",
                                        peer=endpoint)
                if isinstance(msg, wire.Pages):
                    self._on_pages(rx, endpoint, msg)
                else:
                    self._on_final(rx, endpoint, msg)
            except TransferError as e:
                self._fail(rx, e, notify=not isinstance(msg, wire.Abort))
        else:
            logger.warning("unexpected %s message from %s", msg.KIND, endpoint)

    def _on_bad_message(self, endpoint: str, peer: _Peer | None, e: wire.WireError) -> None:
        authn = isinstance(e, wire.AuthError)
        if authn:
            self.stats["auth_failures"] += 1
        logger.warning("dropping a %smessage from %s: %s", "" if authn else "bad ", endpoint, e)
        if authn and peer is not None and peer.registered is not None \
                and not peer.registered.done():
            peer.registered.set_exception(TransferError(
                None, f"KV transfer authentication with prefill rank {endpoint} failed: {e}",
                peer=endpoint))
        rx = self._rx.get(e.transfer_id) if isinstance(e.transfer_id, int) else None
        if rx is not None and endpoint in rx.peers:
            # The connection is ours to this peer, so only the peer (or someone on the path, who
            # could drop the chunk anyway) can fail the room this way: a transfer whose chunk was
            # dropped cannot succeed, so fail it now (releasing its pages), not at the timeout.
            what = "failed authentication" if authn else "could not be decoded"
            self._fail(rx, TransferError(rx.status.room, f"a {e.kind} message from this prefill "
                                         f"rank {what}: {e}", peer=endpoint))

    def _on_pages(self, rx: _Rx, endpoint: str, msg: wire.Pages) -> None:
        room, p = rx.status.room, rx.peers[endpoint]
        if msg.room != room:
            self.stats["room_mismatches"] += 1
            raise TransferError.room_mismatch(room, msg.room, endpoint, f" in chunk {p.chunks}")
        if p.final is not None:
            raise TransferError(room, "pages after the final metadata", peer=endpoint)
        end, n = msg.page_start + msg.page_count, len(rx.dst_page_ids)
        l0, l1 = msg.layers
        want_shape = (msg.page_count, self.layout.page_size, p.heads[1] - p.heads[0],
                      self.layout.head_dim)
        problems = chunk_problems(self.layout, p, n, msg, want_shape)
        if problems:
            raise TransferError(room, "bad pages chunk: " + "; ".join(problems), peer=endpoint)
        actual, tensors = self._payload_tensors(endpoint, msg)
        if actual != msg.checksum:
            self.stats["checksum_failures"] += 1
            raise TransferError.checksum_mismatch(room, msg.checksum, actual, endpoint,
                                                  f" in chunk {p.chunks} (pages "
                                                  f"[{msg.page_start}, {end}) of layers "
                                                  f"[{l0}, {l1}))")
        if len(tensors) != msg.num_buffers or any(tuple(t.shape) != want_shape for t in tensors):
            raise TransferError(room, "payload buffers do not match the header's shape",
                                peer=endpoint)
        if rx.status.state is TransferState.WAITING_FOR_INPUT:
            rx.status.advance(TransferState.TRANSFERRING)
        for layer in range(l0, l1):
            base = (layer - p.layers[0]) * n
            p.covered[base + msg.page_start:base + end] = b"\x01" * msg.page_count
        rx.nbytes += msg.num_buffers * math.prod(want_shape) * self.layout.torch_dtype.itemsize
        rx.chunks += 1
        p.chunks += 1
        if all(q.first_ok for q in rx.peers.values()):
            self._write(rx, endpoint, msg, tensors)
            return
        p.first_ok = True
        rx.held.append((endpoint, msg, tensors))
        if all(q.first_ok for q in rx.peers.values()):
            held, rx.held = rx.held, []
            for args in held:
                self._write(rx, *args)

    def _write(self, rx: _Rx, endpoint: str, msg: wire.Pages, tensors: list[Any]) -> None:
        p = rx.peers[endpoint]
        ids = rx.dst_page_ids[msg.page_start:msg.page_start + msg.page_count]
        self.writer.write(ids, tuple(msg.layers), p.heads, tensors)

    def _on_final(self, rx: _Rx, endpoint: str, msg: wire.Final) -> None:
        room, p = rx.status.room, rx.peers[endpoint]
        if msg.room != room:
            raise TransferError.room_mismatch(room, msg.room, endpoint, " in the final metadata")
        missing = p.covered.count(0)
        if missing or msg.num_pages != len(rx.dst_page_ids):
            raise TransferError(room, f"final metadata with {missing} of {len(p.covered)} "
                                f"(layer, page) cells missing; {len(rx.dst_page_ids)} pages "
                                f"reserved, the prefill says {msg.num_pages}", peer=endpoint)
        p.final = msg
        if not all(q.final for q in rx.peers.values()):
            return
        finals = [q.final for q in rx.peers.values() if q.final]
        if len({(f.first_token, f.cached_tokens) for f in finals}) != 1:
            raise TransferError(room, "prefill ranks disagree on the first token / cached tokens: "
                                + ", ".join(f"{e}: {q.final.first_token}/{q.final.cached_tokens}"
                                            for e, q in rx.peers.items() if q.final))
        self.writer.synchronize()
        rx.status.advance(TransferState.SUCCESS)
        self.stats["rooms_ok"] += 1
        self.stats["bytes_received"] += rx.nbytes
        for e in rx.peers:
            asyncio.ensure_future(self._send_quiet(e, wire.Ack(transfer_id=rx.transfer_id, room=room)))
        self._finish(rx)
        rx.done.set_result(ReceiveResult(room, finals[0].first_token, finals[0].cached_tokens,
                                         len(rx.dst_page_ids), rx.nbytes,
                                         time.monotonic() - rx.started, tuple(rx.peers),
                                         rx.chunks))

    # ---- failure and bookkeeping -----------------------------------------------------------
    def _check_rx_alive(self, rx: _Rx) -> None:
        if rx.status.state is TransferState.FAILED:
            raise rx.status.error  # type: ignore[misc]

    def _timeout(self, tid: int) -> None:
        rx = self._rx.get(tid)
        if rx is None:
            return
        waiting = [e for e, p in rx.peers.items() if p.final is None]
        self._fail(rx, TransferError(rx.status.room, f"no complete KV within "
                                     f"{self.config.waiting_timeout_s} s from {waiting}; check that "
                                     "the prefill got the same request (bootstrap_room) and is "
                                     "alive"))

    def _fail(self, rx: _Rx, error: TransferError, *, notify: bool = True) -> None:
        if rx.status.state.terminal:
            return
        error = error.with_context(room=rx.status.room, stage=rx.status.state,
                                   released_pages=rx.dst_page_ids)
        rx.status.fail(error)
        self.stats["rooms_failed"] += 1
        logger.info("%s", error)
        rx.held.clear()
        if notify:
            for e in rx.peers:
                asyncio.ensure_future(self._send_quiet(e, wire.Abort(
                    room=rx.status.room, transfer_id=rx.transfer_id, reason=error.reason)))
        self._finish(rx)
        if self.release_pages is not None:
            try:
                self.release_pages(rx.dst_page_ids)
            except Exception:  # the pool's bookkeeping must not break the data plane
                logger.exception("release_pages callback failed for room %s", rx.status.room)
        if not rx.done.done():
            rx.done.set_exception(error)
            rx.done.exception()  # retrieved here so an unawaited failure is not logged twice

    def _finish(self, rx: _Rx) -> None:
        if rx.timer:
            rx.timer.cancel()
        room = rx.status.room
        self._rx.pop(rx.transfer_id, None)
        self._by_room.pop(room, None)
        for e in rx.peers:
            if e in self._peers:
                self._peers[e].rooms.discard(room)
        self._finished[room] = rx.status
        while len(self._finished) > FINISHED_KEPT:
            self._finished.popitem(last=False)

    async def _send_quiet(self, endpoint: str, msg: wire.Message) -> None:
        try:
            if endpoint in self._peers:
                await self._send_frames(endpoint, self._encode(msg))
        except (ConnectionError, OSError) as e:
            logger.info("could not send %s to %s: %s", msg.KIND, endpoint, e)

    async def _forget_peer(self, endpoint: str) -> None:
        peer = self._peers.pop(endpoint, None)
        if peer is not None:
            for fut in peer.pings.values():
                if not fut.done():
                    fut.set_result(False)
        await self._drop(endpoint)
