"""``kvatlas doctor``: walk the evidence chain of a PD cluster and stop at the first broken link.

The chain, in the order a request depends on it: etcd answers; instances are registered; for
each prefill instance its ranks are all registered, the bootstrap server resolves the topology
and every rank, each rank's transfer socket accepts a connection, and a probe request (sent to
the prefill and a decode with a fresh room, as the router would) reaches the decode stage
``consumed`` for that room; then the router is ready, its breakers are closed, every prefill's
index links hold (``doctor_index``: all of them are reported before the chain stops), its index
mirror is live and non-empty (an empty index silently turns KV routing into load routing), and a probe
through the router is consumed on a decode.
"""
from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from bootstrap.mirror import readable_ranks
from index.agent_stats import parse_stats_key, stats_prefix
from index.errors import EtcdError, MalformedValue
from index.etcd import EtcdClient, EtcdSettings
from index.keys import KeyLayout, loads
from index.pd_protocol import SGLANG
from index.record import DECODE, DEFAULT_ENGINE, PREFILL, InstanceRecord, RecordReader
from index.rooms import ROUTER_ROOMS
from index.shards import IndexShards
from kvatlas.launcher.doctor_index import index_links

PROBE_PROMPT = ("kvatlas doctor probe: a prompt long enough to fill a few KV blocks, so the "
                "prefill stores them and the index shows them. ")
ROUTE_PARAMS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")


def readable_records(layout: KeyLayout, reader: RecordReader, kvs: Iterable[Any]
                     ) -> Iterator[tuple[str, InstanceRecord]]:
    """(instance id, record) of every instance key that parses: a key kvatlas does not write
    is skipped, as routers skip it; an unreadable record is counted by ``reader`` (the
    registration link names them)."""
    for kv in kvs:
        try:
            iid = layout.parse_instance(kv.key)
        except MalformedValue:
            continue
        rec = reader.read(kv.key, kv.value, instance_id=iid)
        if rec is not None:
            yield iid, rec


@dataclass
class Link:
    """One checked link of the chain."""

    name: str
    ok: bool
    detail: str
    hint: str = ""


@dataclass
class Doctor:
    etcd: EtcdSettings
    layout: KeyLayout
    router: str | None
    timeout: float = 10.0
    index_etcd: IndexShards = field(default_factory=IndexShards)
    """The block index's shards (``--index-etcd``), each checked after the main etcd."""
    links: list[Link] = field(default_factory=list)
    instances: dict[str, InstanceRecord] = field(default_factory=dict)
    """Every readable instance record, read once by the etcd link (the vLLM checks walk them
    too)."""
    ranks: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    records: RecordReader = field(default_factory=lambda: RecordReader("doctor: instance record"))

    def _add(self, name: str, ok: bool, detail: str, hint: str = "") -> bool:
        self.links.append(Link(name, ok, detail, "" if ok else hint))
        return ok

    async def run(self) -> list[Link]:
        """Check each link in order; stop at the first that fails."""
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            steps: list[Callable[[], Awaitable[bool]]] = [self._etcd, self._shards,
                                                          self._registered]
            for step in steps:
                if not await step():
                    return self.links
            # vLLM-protocol pairs (pd_protocol set) are walked by kvatlas/commands/_doctor_vllm_pd.
            decodes = [r for r in self.instances.values()
                       if r.role == DECODE and r.pd_protocol.name == SGLANG]
            for iid, rec in sorted(self.instances.items()):
                if (rec.role == PREFILL and rec.pd_protocol.name == SGLANG and decodes
                        and not await self._prefill(http, iid, rec, decodes[0])):
                    return self.links
            if self.router:
                await self._router(http)
        return self.links

    # --- etcd and registration ----------------------------------------------------------

    async def _etcd(self) -> bool:
        try:
            async with EtcdClient(self.etcd) as client:
                status = await client.status()
                _, kvs = await client.get_prefix(self.layout.instances_prefix())
                for iid, rec in readable_records(self.layout, self.records, kvs):
                    self.instances[iid] = rec
                    _, rkvs = await client.get_prefix(self.layout.ranks_prefix(iid))
                    self.ranks[iid] = readable_ranks(self.layout, rkvs)
        except (EtcdError, OSError) as exc:
            return self._add("etcd reachable", False, f"{self.etcd.display}: {exc}",
                             "is etcd running (`kvatlas cluster status`)? are --etcd and the "
                             "TLS/auth flags right?")
        return self._add("etcd reachable", True, f"{self.etcd.display} ({status})")

    async def _shards(self) -> bool:
        """Each index shard's etcd answers (a shard down leaves its instances' blocks stale)."""
        ok = True
        for i, settings in enumerate(self.index_etcd.clusters):
            try:
                async with EtcdClient(settings) as client:
                    status = await client.status()
            except (EtcdError, OSError) as exc:
                ok = self._add(f"index shard {i} reachable", False, f"{settings.display}: {exc}",
                               "is that etcd running? every process must list the same "
                               "--index-etcd clusters, in the same order") and ok
                continue
            self._add(f"index shard {i} reachable", True, f"{settings.display} ({status})")
        return ok

    async def _registered(self) -> bool:
        roles = [r.role for r in self.instances.values()]
        n_p, n_d = roles.count(PREFILL), roles.count(DECODE)
        ok = n_p > 0 and n_d > 0
        refused = {r: n for r, n in self.records.stats().items() if n}
        unread = f"; unreadable records: {refused}" if refused else ""
        return self._add("instances registered", ok,
                         f"{n_p} prefill, {n_d} decode under {self.layout.prefix}{unread}",
                         "no live instance key for a role: the instance is down, its lease "
                         "expired, or it uses another --etcd/--etcd-prefix; read its log")

    # --- one prefill instance -----------------------------------------------------------

    async def _prefill(self, http: aiohttp.ClientSession, iid: str, rec: InstanceRecord,
                       decode: InstanceRecord) -> bool:
        n, m = rec.registered_ranks, rec.expected_ranks
        if not self._add(f"{iid}: registration", rec.ready and n == m,
                         f"{n} of {m} ranks registered",
                         "a rank did not PUT /route: read the instance log for the rank that "
                         "failed, check --tp/--dp and the bootstrap port"):
            return False
        boot = f"http://{rec.bootstrap_host}:{rec.bootstrap_port}"
        status, topo = await _get(http, f"{boot}/route?" + "&".join(f"{p}=-1"
                                                                    for p in ROUTE_PARAMS))
        if not self._add(f"{iid}: topology resolvable", status == 200 and isinstance(topo, dict),
                         f"GET {boot}/route (-1s) -> {status}",
                         "the bootstrap server does not answer or is not ready: is "
                         f"{boot} reachable from here, and all ranks registered?"):
            return False
        addresses = []
        for r in self.ranks.get(iid, []):
            dp, cp, tp, pp = r["key"]
            q = "&".join(f"{k}={v}" for k, v in zip(ROUTE_PARAMS, (dp, cp, tp, pp)))
            status, addr = await _get(http, f"{boot}/route?{q}")
            if status != 200 or not isinstance(addr, dict):
                return self._add(f"{iid}: every rank resolvable", False,
                                 f"rank dp={dp} cp={cp} tp={tp} pp={pp} -> {status}",
                                 "the bootstrap table lost a rank: restart the instance")
            if (addr.get("rank_ip"), addr.get("rank_port")) != (r.get("rank_ip"),
                                                                 r.get("rank_port")):
                return self._add(f"{iid}: every rank resolvable", False,
                                 f"rank {(dp, cp, tp, pp)}: bootstrap says {addr}, etcd says "
                                 f"{r.get('rank_ip')}:{r.get('rank_port')}",
                                 "the etcd mirror is behind the bootstrap table: check the "
                                 "instance's mirror state on its /metrics")
            addresses.append((addr["rank_ip"], int(addr["rank_port"])))
        if not self._add(f"{iid}: every rank resolvable", len(addresses) == m and m,
                         f"{len(addresses)} of {m} ranks resolve (bootstrap == etcd)",
                         "etcd holds fewer rank keys than expected: the mirror is lagging"):
            return False
        for host, port in addresses:
            if not await _connectable(host, port):
                return self._add(f"{iid}: transfer sockets reachable", False,
                                 f"{host}:{port} refuses connections",
                                 "the rank process died or binds another interface")
        self._add(f"{iid}: transfer sockets reachable", True, f"{len(addresses)} sockets accept")
        return await self._probe_direct(http, iid, rec, decode, boot)

    async def _probe_direct(self, http: aiohttp.ClientSession, iid: str, rec: InstanceRecord,
                            decode: InstanceRecord, boot: str) -> bool:
        room = ROUTER_ROOMS.draw()  # a room the router could have drawn
        host = urlsplit(boot).hostname
        body = {"text": PROBE_PROMPT + iid, "sampling_params": {"max_new_tokens": 2,
                                                                  "temperature": 0.0},
                "bootstrap_host": host, "bootstrap_port": rec.bootstrap_port,
                "bootstrap_room": room}
        (ps, _), (ds, dbody) = await asyncio.gather(
            _post(http, f"{rec.url}/generate", body),
            _post(http, f"{decode.url}/generate", body))
        detail = f"room {room}: prefill {ps}, decode {ds}"
        if ps != 200 or ds != 200:
            return self._add(f"{iid}: probe consumed", False, f"{detail} {str(dbody)[:200]}",
                             "the transfer failed: GET the decode's /debug/rooms/{room} for the "
                             "stage and rank that failed")
        if decode.engine != DEFAULT_ENGINE:
            # SGLang's decode keeps no room log: its 200 answer is the evidence there is.
            return self._add(f"{iid}: probe consumed", True, f"{detail} ({decode.engine} "
                             "decode: room stage not recorded)")
        return await self._room_consumed(http, f"{iid}: probe consumed", room, [decode.url])

    async def _room_consumed(self, http: aiohttp.ClientSession, name: str, room: int,
                             decode_urls: list[Any]) -> bool:
        for url in decode_urls:
            status, doc = await _get(http, f"{url}/debug/rooms/{room}")
            if status == 200 and isinstance(doc, dict):
                ok = doc.get("stage") == "consumed" and doc.get("state") != "failed"
                return self._add(name, ok, f"room {room} on {url}: stage {doc.get('stage')}, "
                                           f"{doc.get('state')}",
                                 f"the room stopped at {doc.get('stage')}: {doc.get('error')}")
        return self._add(name, False, f"no decode knows room {room}",
                         "the decode did not record the room: is it a kvatlas decode (GET "
                         "/debug/rooms/{room})?")

    # --- the router ---------------------------------------------------------------------

    async def _router(self, http: aiohttp.ClientSession) -> bool:
        r = self.router
        status, ready = await _get(http, f"{r}/readiness")
        if not self._add("router ready", status == 200, f"GET {r}/readiness -> {status}",
                         f"the router sees no available worker of a role: {ready}"):
            return False
        _, workers = await _get(http, f"{r}/workers")
        workers = workers if isinstance(workers, dict) else {}
        listed = {w["instance_id"]: w for role in ("prefill", "decode")
                  for w in workers.get(role, [])}
        missing = sorted(set(self.instances) - set(listed))
        bad = sorted(f"{i} ({w['circuit']}{'' if w['healthy'] else ', unhealthy'})"
                     for i, w in listed.items() if w["circuit"] != "closed" or not w["healthy"])
        if not self._add("router pools and breakers", not missing and not bad,
                         f"{len(listed)} workers; missing {missing or 'none'}; "
                         f"open/unhealthy {bad or 'none'}",
                         "a worker the router cannot use: check its health and the router's "
                         "--etcd/--model; open circuits close after --cb-timeout-duration-secs"):
            return False
        if not await self._index_section(http):
            return False
        index = await self._index(http, ready)
        if not self._add("index mirror live and non-empty",
                         index.get("state") == "live" and (index.get("blocks") or 0) > 0,
                         f"state {index.get('state')}, {index.get('blocks')} blocks",
                         "an empty or stale index makes KV routing load routing: check that "
                         "prefills publish blocks (etcd keys under /blocks) and the router's "
                         "etcd connection"):
            return False
        body = {"text": PROBE_PROMPT + "through the router",
                "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
        status, doc = await _post(http, f"{r}/generate", body)
        room = (doc or {}).get("meta_info", {}).get("bootstrap_room") \
            if isinstance(doc, dict) else None
        if status != 200 or not room:
            return self._add("probe through the router consumed", False,
                             f"POST {r}/generate -> {status}: {str(doc)[:200]}",
                             "the router's retries failed: read `kvatlas cluster status` and the "
                             "router log")
        foreign = {r.url for r in self.instances.values()
                   if r.role == DECODE and r.engine != DEFAULT_ENGINE}
        urls = [w["url"] for w in workers.get("decode", []) if w["url"] not in foreign]
        if not urls and foreign:
            return self._add("probe through the router consumed", True,
                             f"room {room}: 200 (foreign decodes: room stage not recorded)")
        return await self._room_consumed(http, "probe through the router consumed", int(room),
                                         urls)


    async def _index_section(self, http: aiohttp.ClientSession) -> bool:
        """Every prefill's index links (``doctor_index``), all of them reported before the
        chain stops: several instances can each have their own cause."""
        status, doc = await _get(http, f"{self.router}/debug/index_health")
        if not self._add("router index health", status == 200 and isinstance(doc, dict),
                         f"GET {self.router}/debug/index_health -> {status}",
                         "a router older than this kvatlas: upgrade it"):
            return False
        try:
            async with EtcdClient(self.etcd) as client:
                _, kvs = await client.get_prefix(stats_prefix(self.layout))
        except (EtcdError, OSError) as exc:
            return self._add("ingestion counters readable", False, str(exc),
                             "etcd went away during the checks: run doctor again")
        counters = {parse_stats_key(self.layout, kv.key): loads(kv.value) for kv in kvs}
        health = doc.get("instances") or {}
        ok = True
        for iid, rec in sorted(self.instances.items()):
            if rec.role != PREFILL:
                continue
            for name, good, detail, hint in index_links(iid, health.get(iid), counters.get(iid)):
                ok = self._add(name, good, detail, hint) and ok
        return ok

    async def _index(self, http: aiohttp.ClientSession, ready: Any,
                     wait: float = 5.0) -> dict[str, Any]:
        """The router's index detail; waits briefly for blocks, since the probes just stored
        some and their events reach the router asynchronously."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            index = ready.get("index", {}) if isinstance(ready, dict) else {}
            if (index.get("blocks") or 0) > 0 or loop.time() > deadline:
                return index
            await asyncio.sleep(0.2)
            _, ready = await _get(http, f"{self.router}/readiness")


async def _get(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    return await _request(http, "GET", url)


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    return await _request(http, "POST", url, json=body)


async def _request(http: aiohttp.ClientSession, method: str, url: str,
                   **kw: Any) -> tuple[int, Any]:
    """(status, JSON body or text); status 0 and the error when nothing answered."""
    try:
        async with http.request(method, url, **kw) as resp:
            text = await resp.text()
            try:
                return resp.status, await resp.json(content_type=None)
            except ValueError:
                return resp.status, text
    except (TimeoutError, aiohttp.ClientError) as exc:
        return 0, repr(exc)


async def _connectable(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (TimeoutError, OSError, socket.gaierror):
        return False
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return True
