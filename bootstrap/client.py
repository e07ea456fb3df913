"""The client a decode rank uses to talk to prefill instances' bootstrap servers.

One ``BootstrapClient`` per decode process: it owns one aiohttp ``ClientSession`` so that every
call to the same prefill reuses a kept-alive connection (a decode bootstraps every request, and a
fresh TCP handshake per request would dominate the bootstrap latency). The topology of each
bootstrap address is fetched once, with SGLang's retry policy (every 1 s, 15 tries, 5 s per call),
and cached; concurrent requests to a prefill that is still starting share one retry loop instead
of hammering it with one loop each. ``forget()`` drops an address (e.g. after failed heartbeats).

Speaks SGLang's wire format (``reference/sglang-bootstrap.md``), so it works against an SGLang
prefill as well as against kvatlas's own server.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiohttp

from bootstrap.config import AUTH_TOKEN_ENV
from bootstrap.errors import (
    BadResponse,
    BootstrapAuthError,
    BootstrapError,
    BootstrapNotReady,
    BootstrapUnreachable,
    UnknownRank,
)
from bootstrap.mapping import (
    DecodeParallel,
    PrefillServerInfo,
    RankAddress,
    RankMapping,
    check_kv_compat,
    map_decode_rank,
    prefill_dp_for_room,
)

logger = logging.getLogger(__name__)

#: Longest error body quoted in an exception; a misdirected port can answer with a whole page.
_MAX_QUOTE = 200


@dataclass(frozen=True)
class BootstrapClientConfig:
    """Settings of the decode-side bootstrap client (defaults are SGLang's)."""

    retry_interval_s: float = 1.0
    """Pause between topology tries while the prefill is unreachable or not fully registered."""
    tries: int = 15
    """Topology tries before giving up; with the interval this bounds how long a decode waits
    for a prefill instance to come up."""
    timeout_s: float = 5.0
    """Whole-call timeout of each HTTP request (connect + answer)."""
    auth_token: str | None = None
    """Bearer token sent with POSTs when the bootstrap servers require one (``--auth-token``)."""
    max_connections: int = 64
    """Open connections kept across all prefill instances; bounds sockets under a request burst."""

    def __post_init__(self) -> None:
        if not self.retry_interval_s >= 0:
            raise ValueError(f"retry_interval_s must be >= 0, got {self.retry_interval_s!r}")
        if isinstance(self.tries, bool) or not isinstance(self.tries, int) or self.tries < 1:
            raise ValueError(f"tries must be an integer >= 1, got {self.tries!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if self.auth_token is not None and (not self.auth_token or any(c.isspace() for c in self.auth_token)):
            raise ValueError("auth_token must be non-empty and contain no whitespace")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections!r}")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("bootstrap client")
        group.add_argument("--bootstrap-retry-interval", type=float, default=cls.retry_interval_s,
                           help="seconds between topology tries (default %(default)s)")
        group.add_argument("--bootstrap-tries", type=int, default=cls.tries,
                           help="topology tries before giving up (default %(default)s)")
        group.add_argument("--bootstrap-timeout", type=float, default=cls.timeout_s,
                           help="seconds per bootstrap HTTP call (default %(default)s)")
        group.add_argument("--bootstrap-auth-token", default=None,
                           help="bearer token for POSTs to bootstrap servers "
                                f"(default: ${AUTH_TOKEN_ENV})")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> BootstrapClientConfig:
        return cls(retry_interval_s=args.bootstrap_retry_interval, tries=args.bootstrap_tries,
                   timeout_s=args.bootstrap_timeout,
                   auth_token=args.bootstrap_auth_token or os.environ.get(AUTH_TOKEN_ENV)
                   or None)


def format_addr(host: str, port: int) -> str:
    """``host:port`` with IPv6 literals bracketed (``[::1]:8998``), as URLs and logs need."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"bootstrap port must be an integer in 1-65535, got {port!r}")
    if not isinstance(host, str) or not host.strip("[]"):
        raise ValueError(f"bootstrap host must be a non-empty string, got {host!r}")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def parse_addr(addr: str) -> tuple[str, int]:
    """Split ``host:port`` / ``[v6]:port`` (the form routers inject) into host and port."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"bootstrap address {addr!r} is not host:port (IPv6 as [addr]:port)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"bootstrap address {addr!r}: put an IPv6 host in brackets, [addr]:port")
    format_addr(host, int(port))
    return host, int(port)


def _quote(body: str) -> str:
    """The server's error message: kvatlas sends JSON ``{"error": ...}``, SGLang plain text."""
    try:
        doc = json.loads(body)
        if isinstance(doc, dict) and isinstance(doc.get("error"), str):
            body = doc["error"]
    except ValueError:
        pass
    body = body.strip()
    return body if len(body) <= _MAX_QUOTE else body[:_MAX_QUOTE] + "..."


class _Retry(Exception):
    """Internal: a topology try failed in a way worth retrying; carries the final error."""

    def __init__(self, error: BootstrapError, status: int | None) -> None:
        super().__init__(str(error))
        self.error = error
        self.status = status


class BootstrapClient:
    """Async client for prefill bootstrap servers; use as ``async with BootstrapClient() as c``."""

    def __init__(self, config: BootstrapClientConfig | None = None) -> None:
        self.config = config or BootstrapClientConfig()
        self._session: aiohttp.ClientSession | None = None
        self._topology: dict[str, PrefillServerInfo] = {}
        self._inflight: dict[str, asyncio.Task[PrefillServerInfo]] = {}
        self._ranks: dict[tuple[str, int, int, int, int], RankAddress] = {}

    # lifecycle
    async def start(self) -> None:
        """Create the session; must run inside the event loop that will use the client."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.config.max_connections),
                timeout=aiohttp.ClientTimeout(total=self.config.timeout_s),
            )

    async def close(self) -> None:
        """Stop pending topology fetches (their waiters get CancelledError) and the session."""
        pending = list(self._inflight.values())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._inflight.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> BootstrapClient:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("BootstrapClient is not started: use `async with BootstrapClient()` "
                               "or await client.start() first")
        return self._session

    # cache
    def cached_topology(self, host: str, port: int) -> PrefillServerInfo | None:
        return self._topology.get(format_addr(host, port))

    def forget(self, host: str, port: int) -> None:
        """Drop everything cached for an address: the instance died or restarted elsewhere."""
        addr = format_addr(host, port)
        self._topology.pop(addr, None)
        for key in [k for k in self._ranks if k[0] == addr]:
            del self._ranks[key]

    # HTTP plumbing
    async def _call(self, method: str, addr: str, path: str, *, params: dict[str, str] | None = None,
                    body: Any = None, auth: bool = False) -> tuple[int, str]:
        """One request; transport failures become BootstrapUnreachable naming what to check."""
        headers = {}
        if auth and self.config.auth_token:
            headers["Authorization"] = f"Bearer {self.config.auth_token}"
        try:
            async with self.session.request(method, f"http://{addr}{path}", params=params,
                                            json=body, headers=headers) as resp:
                return resp.status, await resp.text(errors="replace")
        except TimeoutError as exc:
            raise BootstrapUnreachable(
                addr=addr, reason=f"{method} {path} got no answer within {self.config.timeout_s:g} s; "
                "check that the prefill instance is up and not overloaded") from exc
        except aiohttp.ClientError as exc:
            raise BootstrapUnreachable(
                addr=addr, reason=f"{method} {path} failed ({type(exc).__name__}: {exc}); check the "
                "bootstrap host and port (--disaggregation-bootstrap-port), that the prefill "
                "instance runs, and that no firewall is in the way") from exc

    @staticmethod
    def _json(addr: str, path: str, status: int, text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError as exc:
            raise BadResponse(addr=addr, status=status, reason=(
                f"{path} answered {status} with a body that is not JSON ({_quote(text)!r}); "
                "is this port a bootstrap server?")) from exc

    def _unexpected(self, addr: str, path: str, status: int, text: str) -> BootstrapError:
        if status in (401, 403):
            return BootstrapAuthError(addr=addr, reason=(
                f"{path} refused with {status} ({_quote(text)}); set the same bearer token as the "
                "bootstrap server's --auth-token"))
        return BadResponse(addr=addr, status=status, reason=(
            f"{path} answered {status}: {_quote(text)}"))

    # topology
    async def get_topology(self, host: str, port: int, *, refresh: bool = False) -> PrefillServerInfo:
        """The prefill instance's topology, waiting (with retry) until all its ranks registered.

        Cached per address; ``refresh`` refetches. Raises BootstrapNotReady / BootstrapUnreachable
        after ``tries`` failed tries, BadResponse at once for answers that retrying cannot fix.
        """
        addr = format_addr(host, port)
        if not refresh and addr in self._topology:
            return self._topology[addr]
        task = self._inflight.get(addr)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._fetch_topology(addr))
            self._inflight[addr] = task
            task.add_done_callback(lambda done: self._drop_inflight(addr, done))
        # shield: one waiter giving up must not cancel the fetch other requests wait on.
        return await asyncio.shield(task)

    def _drop_inflight(self, addr: str, done: asyncio.Task[PrefillServerInfo]) -> None:
        if self._inflight.get(addr) is done:
            del self._inflight[addr]
        if not done.cancelled():
            done.exception()  # mark retrieved: every waiter has already seen it via shield

    async def _fetch_topology(self, addr: str) -> PrefillServerInfo:
        tries = self.config.tries
        last: _Retry | None = None
        for attempt in range(1, tries + 1):
            try:
                info = await self._topology_once(addr)
            except _Retry as retry:
                last = retry
                logger.info("bootstrap %s topology try %d/%d: %s", addr, attempt, tries, retry.error.reason)
                if attempt < tries:
                    await asyncio.sleep(self.config.retry_interval_s)
                continue
            self._topology[addr] = info
            logger.debug("bootstrap %s topology: %s", addr, info)
            return info
        assert last is not None
        waited = self.config.retry_interval_s * (tries - 1)
        if last.status == 503:
            raise BootstrapNotReady(addr=addr, tries=tries, last_status=503, reason=(
                f"not ready after {tries} tries over {waited:g} s; last answer: "
                f"{last.error.reason}; check that every prefill rank started and registered "
                "(PUT /route) with this bootstrap server"))
        if isinstance(last.error, BootstrapUnreachable):
            raise BootstrapUnreachable(addr=addr, reason=(
                f"unreachable after {tries} tries over {waited:g} s; last error: {last.error.reason}"))
        raise BadResponse(addr=addr, status=last.status, reason=(
            f"no topology after {tries} tries over {waited:g} s; last answer: {last.error.reason}"))

    async def _topology_once(self, addr: str) -> PrefillServerInfo:
        params = {"prefill_dp_rank": "-1", "prefill_cp_rank": "-1",
                  "target_tp_rank": "-1", "target_pp_rank": "-1"}
        try:
            status, text = await self._call("GET", addr, "/route", params=params)
        except BootstrapUnreachable as exc:
            raise _Retry(exc, None) from exc
        if status == 503:
            raise _Retry(BootstrapNotReady(addr=addr, tries=1, last_status=503,
                                           reason=_quote(text) or "503"), 503)
        if status >= 500:
            raise _Retry(BadResponse(addr=addr, status=status,
                                     reason=f"/route answered {status}: {_quote(text)}"), status)
        if status != 200:
            raise self._unexpected(addr, "/route (topology)", status, text)
        doc = self._json(addr, "/route", status, text)
        try:
            return PrefillServerInfo.from_json(doc)
        except (TypeError, ValueError) as exc:
            raise BadResponse(addr=addr, status=status, reason=(
                f"topology document is invalid: {exc}; is the server speaking SGLang's bootstrap "
                "protocol?")) from exc

    async def get_mapping(self, host: str, port: int, decode: DecodeParallel, *, page_size: int,
                          kv_cache_dtype: str, mla: bool = False) -> tuple[PrefillServerInfo, RankMapping]:
        """Topology, KV compatibility check (TopologyMismatch) and this rank's mapping, in one call."""
        info = await self.get_topology(host, port)
        check_kv_compat(info, page_size=page_size, kv_cache_dtype=kv_cache_dtype,
                        addr=format_addr(host, port))
        return info, map_decode_rank(decode, info, mla=mla)

    # rank addresses
    async def get_rank_address(self, host: str, port: int, dp: int, cp: int, tp: int, pp: int,
                               *, use_cache: bool = True) -> RankAddress:
        """The KV socket of prefill cell ``(dp, cp, tp, pp)``; one call, no retry (a decode asks
        only after the topology said the instance is complete)."""
        addr = format_addr(host, port)
        cell = (dp, cp, tp, pp)
        for name, value in zip(("dp", "cp", "tp", "pp"), cell):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} rank must be an integer >= 0, got {value!r}")
        key = (addr, *cell)
        if use_cache and key in self._ranks:
            return self._ranks[key]
        params = {"prefill_dp_rank": str(dp), "prefill_cp_rank": str(cp),
                  "target_tp_rank": str(tp), "target_pp_rank": str(pp)}
        status, text = await self._call("GET", addr, "/route", params=params)
        where = f"dp_rank={dp} cp_rank={cp} tp_rank={tp} pp_rank={pp}"
        if status == 404:
            raise UnknownRank(addr=addr, cell=cell, reason=(
                f"no rank registered for {where} ({_quote(text)}); check that decode and prefill "
                "parallel sizes match the mapping (the topology says which ranks exist)"))
        if status == 503:
            raise BootstrapNotReady(addr=addr, tries=1, last_status=503, reason=(
                f"not ready for {where}: {_quote(text)}; wait for get_topology() first"))
        if status != 200:
            raise self._unexpected(addr, "/route", status, text)
        try:
            rank = RankAddress.from_json(self._json(addr, "/route", status, text))
        except ValueError as exc:
            raise BadResponse(addr=addr, status=status,
                              reason=f"rank address for {where} is invalid: {exc}") from exc
        self._ranks[key] = rank
        return rank

    async def get_rank_addresses(self, host: str, port: int, mapping: RankMapping, dp: int
                                 ) -> dict[tuple[int, int, int, int], RankAddress]:
        """Addresses of every cell this decode rank reads for prefill DP ``dp``, fetched concurrently."""
        cells = mapping.cells(dp)
        found = await asyncio.gather(*(self.get_rank_address(host, port, *c) for c in cells))
        return dict(zip(cells, found))

    # room -> dp
    async def register_dp_rank(self, host: str, port: int, room: int, dp_rank: int) -> None:
        """Tell the bootstrap server which prefill DP rank serves ``room`` (prefill side, when it
        does not follow the room)."""
        for name, value in (("bootstrap_room", room), ("dp_rank", dp_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        addr = format_addr(host, port)
        status, text = await self._call("POST", addr, "/register_dp_rank",
                                        body={"bootstrap_room": room, "dp_rank": dp_rank}, auth=True)
        if status != 200:
            raise self._unexpected(addr, "/register_dp_rank", status, text)

    async def query_dp_ranks(self, host: str, port: int, rooms: Iterable[int]) -> dict[int, int]:
        """Prefill DP rank per room; rooms the server does not know (yet, or expired) are absent."""
        wanted = list(rooms)
        for room in wanted:
            if isinstance(room, bool) or not isinstance(room, int) or room < 0:
                raise ValueError(f"bootstrap_room must be an integer >= 0, got {room!r}")
        if not wanted:
            return {}
        addr = format_addr(host, port)
        status, text = await self._call("POST", addr, "/query_dp_ranks",
                                        body={"bootstrap_rooms": wanted}, auth=True)
        if status != 200:
            raise self._unexpected(addr, "/query_dp_ranks", status, text)
        doc = self._json(addr, "/query_dp_ranks", status, text)
        if not isinstance(doc, dict):
            raise BadResponse(addr=addr, status=status,
                              reason=f"/query_dp_ranks answered {type(doc).__name__}, not an object")
        out: dict[int, int] = {}
        for key, value in doc.items():
            try:
                room = int(key)
            except ValueError:
                raise BadResponse(addr=addr, status=status,
                                  reason=f"/query_dp_ranks key {key!r} is not a room number") from None
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise BadResponse(addr=addr, status=status,
                                  reason=f"/query_dp_ranks gives dp rank {value!r} for room {room}")
            out[room] = value
        return out

    async def prefill_dp(self, host: str, port: int, room: int) -> int | None:
        """The prefill DP rank serving ``room``: computed when the prefill follows the room,
        else asked of the server; None while the prefill has not registered the room yet."""
        local = prefill_dp_for_room(room, await self.get_topology(host, port))
        if local is not None:
            return local
        return (await self.query_dp_ranks(host, port, [room])).get(room)

    # liveness
    async def health(self, host: str, port: int) -> bool:
        """One ``GET /health``: True on 200. Never raises for transport errors, because callers
        are heartbeat loops that count misses (SGLang drops an instance after two)."""
        try:
            status, _ = await self._call("GET", format_addr(host, port), "/health")
        except BootstrapUnreachable as exc:
            logger.debug("health of %s: %s", exc.addr, exc.reason)
            return False
        return status == 200
