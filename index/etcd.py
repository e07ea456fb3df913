"""The etcd access layer: the only module of kvatlas that imports aetcd (and so gRPC).

It speaks to etcd through aetcd's generated v3 stubs rather than aetcd's ``Client`` because the
index needs things that client does not offer: several endpoints with fail-over, TLS, paged
snapshot reads at one revision, multi-op transactions, and raw watch responses that keep the
revision and the compaction signal. Every gRPC error is mapped onto ``index.errors`` here, once.
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from aetcd import rpc

from index.errors import (
    EtcdAuthError,
    EtcdCompacted,
    EtcdError,
    EtcdRequestError,
    EtcdTimeout,
    EtcdUnavailable,
    LeaseExpired,
)

logger = logging.getLogger(__name__)

# Sending: large enough for a page of 10k block keys; etcd's own request limit is 1.5 MiB.
_MAX_MESSAGE = 64 * 1024 * 1024
# Receiving: watch responses are not fragmented (see index.follow), so one revision arrives as one
# message: 256 MiB holds the ~4M deletes of a lease revoke. Past it the follower reloads.
_MAX_RECEIVE = 256 * 1024 * 1024
_PAGE = 5000


def parse_endpoints(text: str) -> tuple[str, ...]:
    """Parse ``host:port[,host:port...]`` (an ``http://`` scheme is tolerated) into endpoints."""
    out = []
    for part in text.split(","):
        part = part.strip()
        for scheme in ("http://", "https://"):
            if part.startswith(scheme):
                part = part[len(scheme):]
        part = part.rstrip("/")
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint {part!r} is not HOST:PORT")
        out.append(part)
    if not out:
        raise ValueError("no etcd endpoint given (expected HOST:PORT[,HOST:PORT...])")
    return tuple(out)


@dataclass(frozen=True)
class EtcdSettings:
    """How to reach etcd."""

    endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    """etcd client endpoints as ``host:port``; with several, the client fails over between them."""
    timeout: float = 5.0
    """Deadline of one unary etcd call, in seconds."""
    user: str | None = None
    """etcd user for authentication (with ``password``)."""
    password: str | None = None
    """etcd password for ``user``."""
    ca_cert: str | None = None
    """PEM file of the CA that signed etcd's server certificate; setting it turns TLS on."""
    cert: str | None = None
    """PEM client certificate for mutual TLS."""
    key: str | None = None
    """PEM private key of ``cert``."""

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("EtcdSettings needs at least one endpoint")
        if self.timeout <= 0:
            raise ValueError(f"etcd timeout must be positive, got {self.timeout}")
        if (self.user is None) != (self.password is None):
            raise ValueError("etcd user and password must be given together")
        if (self.cert is None) != (self.key is None):
            raise ValueError("--etcd-cert and --etcd-key must be given together")

    @property
    def display(self) -> str:
        return ",".join(self.endpoints)

    @classmethod
    def from_text(cls, text: str, **kwargs: Any) -> EtcdSettings:
        return cls(endpoints=parse_endpoints(text), **kwargs)


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    lease: int
    mod_revision: int


@dataclass(frozen=True)
class WatchEvent:
    put: bool
    key: bytes
    value: bytes
    mod_revision: int = 0


@dataclass(frozen=True)
class WatchBatch:
    """One watch response: the events of one or more revisions, and the header revision."""

    revision: int
    events: list[WatchEvent] = field(default_factory=list)
    created: bool = False
    """etcd's first response on a new watch: it promises the stream, not that events arrive."""


@dataclass(frozen=True)
class Put:
    key: bytes
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class Delete:
    key: bytes
    prefix: bool = False


@dataclass(frozen=True)
class EtcdStatus:
    version: str
    db_size: int
    db_size_in_use: int
    revision: int
    leader: int


def prefix_end(prefix: bytes) -> bytes:
    """The exclusive end of the key range that starts with ``prefix``."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


def _map_error(exc: BaseException, endpoint: str, op: str) -> EtcdError:
    if isinstance(exc, EtcdError):
        return exc
    if isinstance(exc, grpc.aio.AioRpcError):
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return EtcdTimeout(f"etcd did not answer in time: {details}", endpoint=endpoint, op=op)
        if code == grpc.StatusCode.UNAVAILABLE:
            return EtcdUnavailable(
                f"etcd unreachable or without quorum: {details}", endpoint=endpoint, op=op
            )
        # etcd answers a missing user or a wrong password with INVALID_ARGUMENT.
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) \
                or "user name is empty" in details or "authentication failed" in details:
            return EtcdAuthError(f"etcd refused the credentials: {details}", endpoint=endpoint, op=op)
        if code == grpc.StatusCode.NOT_FOUND and "lease" in details:
            return LeaseExpired(f"etcd lease not found: {details}", endpoint=endpoint, op=op)
        if code == grpc.StatusCode.OUT_OF_RANGE and "compacted" in details:
            return EtcdCompacted(0, endpoint=endpoint, op=op)
        if code == grpc.StatusCode.CANCELLED:
            return EtcdUnavailable(f"etcd call cancelled: {details}", endpoint=endpoint, op=op)
        return EtcdRequestError(f"etcd refused the request ({code.name}): {details}",
                                endpoint=endpoint, op=op)
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return EtcdTimeout("etcd did not answer in time", endpoint=endpoint, op=op)
    if isinstance(exc, OSError):
        return EtcdUnavailable(f"etcd unreachable: {exc}", endpoint=endpoint, op=op)
    return EtcdError(f"etcd call failed: {exc!r}", endpoint=endpoint, op=op)


def _grpc_target(endpoints: Sequence[str]) -> str:
    if len(endpoints) == 1:
        return endpoints[0]
    # gRPC fails over between the addresses of an ipv4:/ipv6: target (pick_first), which is what a
    # client of a 3-member cluster needs. Host names are resolved once here.
    addrs: list[str] = []
    v6 = False
    for ep in endpoints:
        host, _, port = ep.rpartition(":")
        host = host.strip("[]")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            ip = ipaddress.ip_address(infos[0][4][0])
        v6 = v6 or ip.version == 6
        addrs.append(f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}")
    if v6 and any(not a.startswith("[") for a in addrs):
        raise ValueError("cannot mix IPv4 and IPv6 etcd endpoints")
    return ("ipv6:" if v6 else "ipv4:") + ",".join(addrs)


def _read_file(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as fh:
        return fh.read()


class EtcdClient:
    """An asyncio etcd v3 client. Create it, ``await connect()``, and ``await close()`` when done."""

    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        self.endpoint = settings.display
        self._channel: grpc.aio.Channel | None = None
        self._metadata: tuple[tuple[str, str], ...] | None = None
        self._kv: Any = None
        self._lease: Any = None
        self._watch: Any = None
        self._maint: Any = None

    async def __aenter__(self) -> EtcdClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open the channel and authenticate. The channel itself reconnects by itself later."""
        if self._channel is not None:
            return
        options = [
            ("grpc.max_receive_message_length", _MAX_RECEIVE),
            ("grpc.max_send_message_length", _MAX_MESSAGE),
            # etcd's default keepalive enforcement is 5 s; pinging every 10 s finds a dead member.
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2_000),
        ]
        s = self.settings
        try:
            target = _grpc_target(s.endpoints)
        except (OSError, ValueError) as exc:
            raise EtcdUnavailable(f"cannot resolve etcd endpoints: {exc}", endpoint=self.endpoint,
                                  op="connect") from exc
        if s.ca_cert or s.cert:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read_file(s.ca_cert),
                private_key=_read_file(s.key),
                certificate_chain=_read_file(s.cert),
            )
            self._channel = grpc.aio.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        self._kv = rpc.KVStub(self._channel)
        self._lease = rpc.LeaseStub(self._channel)
        self._watch = rpc.WatchStub(self._channel)
        self._maint = rpc.MaintenanceStub(self._channel)
        if s.user is not None:
            await self._authenticate()

    async def _authenticate(self) -> None:
        stub = rpc.AuthStub(self._channel)
        with self._mapped("authenticate"):
            resp = await stub.Authenticate(
                rpc.AuthenticateRequest(name=self.settings.user, password=self.settings.password),
                timeout=self.settings.timeout,
            )
        self._metadata = (("token", resp.token),)

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()

    @contextlib.contextmanager
    def _mapped(self, op: str) -> Iterator[None]:
        try:
            yield
        except (TimeoutError, grpc.aio.AioRpcError, OSError) as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # Our own task is being cancelled (close(), a timeout): gRPC may report that as a
                # CANCELLED call, and mapping it to EtcdUnavailable would swallow the cancellation
                # and keep a retry loop alive forever.
                raise asyncio.CancelledError() from exc
            raise _map_error(exc, self.endpoint, op) from exc

    async def _call(self, op: str, stub: str, method: str, request: Any,
                    timeout: float | None = None) -> Any:
        if self._channel is None:
            await self.connect()
        t = self.settings.timeout if timeout is None else timeout
        for attempt in (0, 1):
            try:
                with self._mapped(op):
                    call = getattr(getattr(self, stub), method)
                    return await call(request, timeout=t, metadata=self._metadata)
            except EtcdAuthError:
                # Simple auth tokens expire; one fresh token, then give up.
                if attempt or self.settings.user is None:
                    raise
                await self._authenticate()
        raise AssertionError("unreachable")

    # --- KV -----------------------------------------------------------------------------------

    async def get(self, key: bytes) -> KeyValue | None:
        resp = await self._call("get", "_kv", "Range", rpc.RangeRequest(key=key))
        if not resp.kvs:
            return None
        kv = resp.kvs[0]
        return KeyValue(kv.key, kv.value, kv.lease, kv.mod_revision)

    async def get_prefix(self, prefix: bytes, keys_only: bool = False) -> tuple[int, list[KeyValue]]:
        """All keys under ``prefix`` as one consistent snapshot, paged; returns (revision, kvs)."""
        end = prefix_end(prefix)
        start = prefix
        revision = 0
        out: list[KeyValue] = []
        while True:
            req = rpc.RangeRequest(key=start, range_end=end, limit=_PAGE, revision=revision,
                                   keys_only=keys_only)
            resp = await self._call("get_prefix", "_kv", "Range", req)
            if revision == 0:
                revision = resp.header.revision
            out.extend(KeyValue(kv.key, kv.value, kv.lease, kv.mod_revision) for kv in resp.kvs)
            if not resp.more or not resp.kvs:
                return revision, out
            start = resp.kvs[-1].key + b"\0"

    async def count_prefix(self, prefix: bytes) -> int:
        """How many keys are under ``prefix`` (etcd counts them; none are sent)."""
        req = rpc.RangeRequest(key=prefix, range_end=prefix_end(prefix), count_only=True)
        resp = await self._call("count_prefix", "_kv", "Range", req)
        return int(resp.count)

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        resp = await self._call("put", "_kv", "Put", rpc.PutRequest(key=key, value=value, lease=lease))
        return int(resp.header.revision)

    async def delete(self, key: bytes, prefix: bool = False) -> int:
        """Delete one key (or every key under ``key`` when ``prefix``); returns the count deleted."""
        req = rpc.DeleteRangeRequest(key=key, range_end=prefix_end(key) if prefix else b"")
        resp = await self._call("delete", "_kv", "DeleteRange", req)
        return int(resp.deleted)

    async def txn(self, ops: Sequence[Put | Delete]) -> int:
        """Apply ``ops`` atomically (no compares); returns the revision of the transaction."""
        reqs = []
        for op in ops:
            if isinstance(op, Put):
                reqs.append(rpc.RequestOp(request_put=rpc.PutRequest(
                    key=op.key, value=op.value, lease=op.lease)))
            else:
                reqs.append(rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(
                    key=op.key, range_end=prefix_end(op.key) if op.prefix else b"")))
        resp = await self._call("txn", "_kv", "Txn", rpc.TxnRequest(success=reqs))
        return int(resp.header.revision)

    # --- leases -------------------------------------------------------------------------------

    async def grant(self, ttl: int) -> tuple[int, int]:
        """Grant a lease; returns (lease id, granted ttl)."""
        resp = await self._call("lease_grant", "_lease", "LeaseGrant", rpc.LeaseGrantRequest(TTL=ttl))
        if resp.error:
            raise EtcdRequestError(f"lease grant refused: {resp.error}", endpoint=self.endpoint,
                                   op="lease_grant")
        return int(resp.ID), int(resp.TTL)

    async def keepalive(self, lease_id: int) -> int:
        """Refresh a lease once; returns its new TTL. Raises LeaseExpired when it is gone."""
        if self._channel is None:
            await self.connect()
        with self._mapped("lease_keepalive"):
            call = self._lease.LeaseKeepAlive(
                iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]),
                timeout=self.settings.timeout, metadata=self._metadata,
            )
            try:
                async for reply in call:
                    if reply.TTL <= 0:
                        raise LeaseExpired(f"lease {lease_id:x} expired", endpoint=self.endpoint,
                                           op="lease_keepalive")
                    return int(reply.TTL)
            finally:
                call.cancel()
        raise EtcdUnavailable("lease keepalive stream closed without a reply", endpoint=self.endpoint,
                              op="lease_keepalive")

    async def revoke(self, lease_id: int) -> int:
        """Revoke a lease; returns the revision at which etcd deleted its keys, 0 when the lease
        was gone already (its keys went at a revision nobody reported)."""
        try:
            resp = await self._call("lease_revoke", "_lease", "LeaseRevoke",
                                    rpc.LeaseRevokeRequest(ID=lease_id))
        except LeaseExpired:
            return 0
        return int(resp.header.revision)

    async def lease_ttl(self, lease_id: int) -> int:
        """Remaining TTL of a lease in seconds, -1 when it does not exist."""
        return (await self.lease_ttls(lease_id))[0]

    async def lease_ttls(self, lease_id: int) -> tuple[int, int]:
        """(remaining, granted) TTL of a lease in seconds; remaining is -1 when it is gone."""
        resp = await self._call("lease_ttl", "_lease", "LeaseTimeToLive",
                                rpc.LeaseTimeToLiveRequest(ID=lease_id))
        return int(resp.TTL), int(resp.grantedTTL)

    # --- maintenance --------------------------------------------------------------------------

    async def status(self) -> EtcdStatus:
        resp = await self._call("status", "_maint", "Status", rpc.StatusRequest())
        return EtcdStatus(resp.version, int(resp.dbSize), int(resp.dbSizeInUse),
                          int(resp.header.revision), int(resp.leader))

    async def compact(self, revision: int, physical: bool = False) -> None:
        await self._call("compact", "_kv", "Compact",
                         rpc.CompactionRequest(revision=revision, physical=physical), timeout=60)

    # --- watch --------------------------------------------------------------------------------

    async def watch_prefix(self, prefix: bytes, start_revision: int,
                           progress_every: float | None = None,
                           fragment: bool = False) -> AsyncIterator[WatchBatch]:
        """Yield watch responses for ``prefix`` from ``start_revision`` (inclusive).

        With ``progress_every``, a progress request is sent at that period so that an idle watch
        still learns the store's current revision (for lag). Raises EtcdCompacted when the start
        revision has been compacted, and EtcdUnavailable when the stream breaks; callers resume
        from their last applied revision + 1.

        With ``fragment``, etcd splits a response larger than its request limit (e.g. the deletes
        of a huge lease expiry) into parts; they are reassembled here, so each yielded batch is
        still whole. etcd 3.5 takes time quadratic in the events per part to split (about 20 s
        for 60k events), so followers leave it off (see ``index.follow``).
        """
        if self._channel is None:
            await self.connect()
        requests: asyncio.Queue[Any] = asyncio.Queue()
        await requests.put(rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
            key=prefix, range_end=prefix_end(prefix), start_revision=start_revision,
            fragment=fragment)))

        async def request_iter() -> AsyncIterator[Any]:
            while True:
                item = await requests.get()
                if item is None:
                    return
                yield item

        async def progress() -> None:
            assert progress_every is not None
            while True:
                await asyncio.sleep(progress_every)
                await requests.put(rpc.WatchRequest(progress_request=rpc.WatchProgressRequest()))

        call = self._watch.Watch(request_iter(), metadata=self._metadata)
        ticker = asyncio.create_task(progress()) if progress_every else None
        parts: list[WatchEvent] = []
        try:
            with self._mapped("watch"):
                async for resp in call:
                    if resp.compact_revision:
                        raise EtcdCompacted(int(resp.compact_revision), endpoint=self.endpoint)
                    if resp.canceled:
                        raise EtcdUnavailable(f"watch cancelled by etcd: {resp.cancel_reason}",
                                              endpoint=self.endpoint, op="watch")
                    events = [WatchEvent(ev.type == rpc.Event.EventType.PUT, ev.kv.key, ev.kv.value,
                                         int(ev.kv.mod_revision))
                              for ev in resp.events]
                    if resp.fragment:
                        parts.extend(events)  # more parts of the same response follow
                        continue
                    if parts:
                        events, parts = parts + events, []
                    yield WatchBatch(int(resp.header.revision), events, bool(resp.created))
            raise EtcdUnavailable("watch stream ended", endpoint=self.endpoint, op="watch")
        finally:
            if ticker is not None:
                ticker.cancel()
            await requests.put(None)
            call.cancel()
