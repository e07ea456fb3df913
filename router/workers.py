"""Workers and the prefill/decode pools.

A worker comes from one of three sources: a static flag, an etcd instance key, or an admin POST.
The etcd instance record (``/{prefix}/v1/instances/{id}``) is parsed by ``index.record``: a
malformed or newer-version record is skipped (counted, logged once per key). The router uses
these fields:

- ``role``: ``"prefill"``, ``"decode"`` (a PD pair's halves) or ``"aggregated"`` (an instance
  that serves whole requests: sent each one with no bootstrap fields);
- ``url``: the worker's HTTP base URL (a record without one cannot be routed to and is skipped);
- ``model``: the served model (filtered against ``--model`` when given; an alias is taken as
  its canonical name);
- ``bootstrap_host`` / ``bootstrap_port``: where decodes find the prefill's bootstrap server
  (host defaults to the URL's host, port to None = the prefill's default 8998);
- ``ready``: false keeps the worker in the pool but unselectable (e.g. ranks still registering);
- ``max_prompt_tokens`` / ``context_length``: the longest prompt it takes (see router/limits.py);
- ``tokenizer``: the tokenizer it prefills with (see router/tokenizers.py).

Listeners of the pools are told "join", "leave", "moved" (a new URL) and "record" (the record
of a worker already in the pool was written again).

**Pairing.** A static or admin worker and an etcd record of the same role and URL (compared
normalized: scheme, lower-case host, port with its default, no trailing slash) are one worker,
whichever came first: the etcd one serves, because its id is the one the block index (and a
sidecar's KV events) use, and the other is *shadowed* (``shadowed_by``) until the record leaves
or moves to another URL. A shadowed worker is never chosen, and is left out of every count (the
workers gauge, /readiness, /workers' role lists, the prompt and body limits).

**The admin API and discovery.** While an etcd record lives, its worker and the worker's URL are
the record's: ``POST /workers`` with its id or URL, and ``DELETE /workers`` of it, are refused
(``DiscoveredWorker``, 409 naming the record; ``WorkerPools.refuse_discovered``).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from index.pd_protocol import SGLANG_BOOTSTRAP, PDProtocol
from index.record import AGGREGATED, DECODE, PREFILL, InstanceRecord, RecordReader
from router.breaker import CircuitBreaker
from router.config import RouterConfig, check_url
from router.engine_load import EngineLoad
from router.errors import DiscoveredWorker, NoWorkers
from router.limits import Stated, WorkerLimits, prefer
from tokenization import canonical_model

logger = logging.getLogger(__name__)

ROLES = (PREFILL, DECODE, AGGREGATED)
COMPUTE_ROLES = (PREFILL, AGGREGATED)
"""The roles whose workers compute prompts (and so hold prefixes): the prefill policy picks
among them, and the block index's entries are theirs."""
ETCD = "etcd"
"""``Worker.source`` of a worker discovered from an etcd instance record."""
ADMIN = "admin"
"""``Worker.source`` of a worker added by ``POST /workers``."""
_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


_DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize_url(url: str) -> str:
    """``url`` as pairing compares it: lower-case scheme and host, the port written out (80 or
    443 by default), no trailing slash; ``http://LocalHost/`` and ``http://localhost:80`` are
    one server. Assumes ``url`` passed ``check_url``."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"  # an IPv6 literal keeps its brackets
    port = parts.port or _DEFAULT_PORTS.get(scheme, 80)
    return f"{scheme}://{host}:{port}{parts.path.rstrip('/')}"


def static_id(url: str) -> str:
    """A stable instance id for a worker known only by URL (``static-host-port``)."""
    parts = urlsplit(url)
    return _ID_UNSAFE.sub("-", f"static-{parts.hostname}-{parts.port or 80}")


@dataclass
class Worker:
    """One routable worker and its local counters."""

    instance_id: str
    role: str
    url: str
    breaker: CircuitBreaker
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    model: str | None = None
    source: str = "static"
    ready: bool = True
    healthy: bool = True
    load: int = 0
    """In-flight requests: added on dispatch, released when the upstream answer completes."""
    health_failures: int = 0
    health_successes: int = 0
    requests: int = 0
    record: dict[str, Any] = field(default_factory=dict)
    shadowed_by: str | None = None
    """A static/admin worker whose URL an etcd instance also registered: the etcd entry (whose
    id matches the block index) serves instead, so the worker is not counted twice."""
    url_key: str = ""
    """``normalize_url(url)``: what pairing compares."""
    limits: Stated = Stated()
    """The longest prompt and largest body it takes, once known (its record or /server_info)."""
    info_asked: bool = False
    """Its /server_info was read (or is not served): the health checks ask only once."""
    engine: EngineLoad | None = None
    """Its last ``/metrics`` reading (router/engine_load.py), when the router scrapes them."""
    protocol: PDProtocol = SGLANG_BOOTSTRAP
    """A prefill's or decode's PD protocol (its record's, or ``--pd-protocol`` for a static
    one): a pair's halves must agree (``PDProtocol.pair_key``)."""
    local_prefill: bool = False
    """A decode whose record says it prefills a request itself when asked
    (``X-Kvatlas-Prefill: local``): a candidate for serving a request whole."""

    def __post_init__(self) -> None:
        if self.bootstrap_host is None:
            self.bootstrap_host = urlsplit(self.url).hostname
        self.url_key = normalize_url(self.url)

    @property
    def counted(self) -> bool:
        """Not shadowed: counts as a worker of its pool (a shadowed one is its etcd twin)."""
        return self.shadowed_by is None

    @property
    def available(self) -> bool:
        return (self.ready and self.healthy and self.shadowed_by is None
                and self.breaker.allow())

    def describe(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "role": self.role, "url": self.url,
                "model": self.model, "source": self.source, "ready": self.ready,
                "healthy": self.healthy, "circuit": self.breaker.state, "load": self.load,
                "requests": self.requests, "bootstrap_host": self.bootstrap_host,
                "bootstrap_port": self.bootstrap_port, "shadowed_by": self.shadowed_by,
                "pd_protocol": self.protocol.label if self.role != AGGREGATED else None,
                "max_prompt_tokens": self.limits.prompt.value if self.limits.prompt else None,
                "max_body_bytes": self.limits.body.value if self.limits.body else None,
                "ignored_limits": {name: value for name, value in self.limits.ignored},
                "engine": self.engine.describe() if self.engine is not None else None}


def parse_instance_record(instance_id: str, raw: bytes, reader: RecordReader | None = None,
                          key: bytes | None = None) -> dict[str, Any] | None:
    """The router's view of one instance record, or None when unusable.

    ``reader`` (discovery's) counts and logs refused records once per ``key``; without one a
    module-wide reader does."""
    rec = (reader or _READER).read(key or instance_id, raw, instance_id=instance_id)
    return None if rec is None else routable_record(instance_id, rec)


def routable_record(instance_id: str, rec: InstanceRecord) -> dict[str, Any] | None:
    """The router's view of a parsed instance record, or None when it is not routable (no
    usable url)."""
    role = rec.role
    if role not in ROLES:
        logger.debug("instance %s: role %r is not routable; ignored", instance_id, role)
        return None
    try:
        url = check_url(rec.url)  # type: ignore[arg-type]
    except ValueError as exc:
        logger.warning("instance %s: no usable url (%s); ignored until it publishes one",
                       instance_id, exc)
        return None
    model = canonical_model(rec.model) if rec.model else None
    return {"instance_id": instance_id, "role": role, "url": url, "model": model,
            "bootstrap_host": rec.bootstrap_host or None, "bootstrap_port": rec.bootstrap_port,
            "ready": rec.ready and rec.healthy, "raw": rec.to_dict(), "record": rec}


_READER = RecordReader()


class WorkerPools:
    """The prefill, decode and aggregated pools, keyed by instance id."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.workers: dict[str, dict[str, Worker]] = {role: {} for role in ROLES}
        self._models: frozenset[str] | None = None
        """models() as of the last change to the pools (it is asked on every request)."""
        self._shapes: tuple[bool, bool] | None = None
        """shapes() as of the last change to the pools (asked on every request too)."""
        self.listeners: list[Any] = []
        """Callables ``(event, worker)`` told of "join", "leave" and "moved" (a new URL)."""
        self.limits = WorkerLimits(config.max_prompt_tokens, config.block_size)

    def new_breaker(self) -> CircuitBreaker:
        c = self.config
        return CircuitBreaker(c.breaker_failure_threshold, c.breaker_success_threshold,
                              c.breaker_timeout, enabled=c.breaker_enabled)

    def pool(self, role: str) -> list[Worker]:
        return list(self.workers[role].values())

    def get(self, role: str, instance_id: str) -> Worker | None:
        return self.workers[role].get(instance_id)

    def find(self, instance_id: str) -> Worker | None:
        return self.workers[PREFILL].get(instance_id) or self.workers[DECODE].get(instance_id)

    def add(self, role: str, url: str, *, instance_id: str | None = None,
            bootstrap_host: str | None = None, bootstrap_port: int | None = None,
            model: str | None = None, source: str = "static", ready: bool = True,
            record: dict[str, Any] | None = None,
            protocol: PDProtocol | None = None) -> Worker:
        """Add or update a worker; an update keeps its breaker, load and health. The admin
        API (``source`` ADMIN) gets ``DiscoveredWorker`` for an id or URL an etcd record names
        (a static flag's worker pairs with the record instead: see the module's docstring)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        url = check_url(url)
        iid = instance_id or static_id(url)
        if source == ADMIN:
            self.refuse_discovered(f"{source} worker {iid} at {url} is not added",
                                   instance_id=iid, url=url)
        self._models = self._shapes = None
        if protocol is None:
            # A record's (checked when it was read); an aggregated worker has none to speak.
            protocol = (PDProtocol.from_dict(record.get("pd_protocol")) if record
                        else SGLANG_BOOTSTRAP)
        local = role == DECODE and record is not None and record.get("local_prefill") is True
        worker = self.workers[role].get(iid)
        events: tuple[str, ...]
        if worker is None:
            worker = Worker(iid, role, url, self.new_breaker(), bootstrap_host, bootstrap_port,
                            model, source, ready, record=record or {}, protocol=protocol)
            worker.local_prefill = local
            self.workers[role][iid] = worker
            logger.info("%s worker %s joined (%s, %s)", role, iid, url, source)
            events = ("join",)
        else:
            moved = worker.url != url
            worker.url, worker.url_key = url, normalize_url(url)
            worker.bootstrap_host = bootstrap_host or urlsplit(url).hostname
            worker.bootstrap_port = bootstrap_port
            worker.model, worker.source, worker.ready = model, source, ready
            worker.record = record or {}
            worker.protocol, worker.local_prefill = protocol, local
            events = ("record",)
            if moved:
                logger.info("%s worker %s moved to %s", role, iid, url)
                worker.limits, worker.info_asked = Stated(), False  # maybe another server
                events = ("moved", "record")
        # Paired before the listeners hear of it: they see who is shadowed already.
        self._pair(role)
        # What the record states wins over what /server_info told: it names this process.
        stated, known = self.limits.stated(record, iid), worker.limits
        self.learned(worker, prefer(stated, Stated(known.prompt, known.body)))
        for event in events:
            self._tell(event, worker)
        return worker

    def remove(self, role: str, instance_id: str) -> Worker | None:
        worker = self.workers[role].pop(instance_id, None)
        if worker is not None:
            self._models = self._shapes = None
            logger.info("%s worker %s left", role, instance_id)
            self._pair(role)  # a static twin it shadowed serves again
            self.limits.forget(instance_id)
            self.limits.rebuild(self.counted())
            self._tell("leave", worker)
        return worker

    def discovered(self, instance_id: str | None = None,
                   url: str | None = None) -> Worker | None:
        """The etcd-discovered worker (either role) of ``instance_id`` or of ``url`` (compared
        normalized), if any."""
        key = None
        if url is not None:
            try:
                key = normalize_url(check_url(url))
            except ValueError:
                key = None  # not a URL: no worker has it
        for w in self.all():
            if w.source == ETCD and (w.instance_id == instance_id
                                     or (key is not None and w.url_key == key)):
                return w
        return None

    def refuse_discovered(self, action: str, *, instance_id: str | None = None,
                          url: str | None = None) -> None:
        """``DiscoveredWorker`` (409) when ``instance_id`` or ``url`` is an etcd-discovered
        worker's: the admin API neither removes, adds a twin of, nor moves such a worker,
        since discovery would (or would not) undo it at the record's next write."""
        w = self.discovered(instance_id, url)
        if w is not None:
            key = self.config.layout.instance(w.instance_id).decode()
            raise DiscoveredWorker(w.instance_id, w.role, w.url, key, action)

    def remove_url(self, url: str) -> list[Worker]:
        try:
            key = normalize_url(check_url(url))
        except ValueError:
            return []  # no worker has a URL that is not one
        gone = []
        for role in ROLES:
            for iid, w in list(self.workers[role].items()):
                if w.url_key == key:
                    gone.append(self.remove(role, iid))
        return [w for w in gone if w is not None]

    def _pair(self, role: str) -> None:
        """Shadow each static/admin worker of ``role`` by the etcd worker of its URL, if any;
        un-shadow those whose etcd twin left or moved. Recomputed whole after every change,
        so the order in which a flag and a record arrive does not matter (pools are small)."""
        pool = self.workers[role]
        by_url: dict[str, str] = {}
        for w in pool.values():
            if w.source == ETCD:
                by_url.setdefault(w.url_key, w.instance_id)
        for w in pool.values():
            if w.source == ETCD:
                continue
            twin = by_url.get(w.url_key)
            if twin == w.shadowed_by:
                continue
            if twin is None:
                logger.info("%s worker %s (%s) serves again: no etcd record names its URL "
                            "now", role, w.instance_id, w.url)
            else:
                # Its requests in flight finish and release its own load; new ones go to the
                # twin, whose id is the one its index entries are under.
                logger.info("%s worker %s (%s, %s) is the etcd instance %s: that one serves",
                            role, w.instance_id, w.url, w.source, twin)
            w.shadowed_by = twin

    def learned(self, worker: Worker, limits: Stated) -> None:
        """``worker`` takes what ``limits`` says."""
        worker.limits = limits
        self.limits.note_ignored(worker.instance_id, limits)
        self.limits.rebuild(self.counted())

    def health_changed(self, worker: Worker) -> None:
        """``worker`` turned healthy or unhealthy: only the limits of those that can serve
        bound what the router takes."""
        self.limits.rebuild(self.counted())

    def fitting(self, role: str, workers: list[Worker], unfit: frozenset[str]) -> list[Worker]:
        """``workers`` but those whose own limits a request exceeds (``unfit``); NoWorkers
        (503) naming them when none is left, though some worker that cannot serve now (not
        ready, unhealthy, its circuit open) would take it."""
        if not unfit:
            return workers
        fit = [w for w in workers if w.instance_id not in unfit]
        if not fit:
            names = ", ".join(sorted(w.instance_id for w in workers))
            raise NoWorkers(role, f"the available {role} workers ({names}) take less than this "
                                  f"request (their prompt or body limits); those that would "
                                  f"take it cannot serve now")
        return fit

    def counted(self) -> list[Worker]:
        """Every worker but the shadowed ones: what counts (limits, gauges, readiness)."""
        return [w for w in self.all() if w.shadowed_by is None]

    def all(self) -> list[Worker]:
        return self.pool(PREFILL) + self.pool(DECODE) + self.pool(AGGREGATED)

    def shapes(self) -> tuple[bool, bool]:
        """(a PD pair can be formed, a worker can serve a request whole: an aggregated one, or
        a decode that prefills locally): the workers registered and counted, whether or not
        they can serve right now. Kept until the pools change (add/remove, which re-pair)."""
        if self._shapes is None:
            def has(role: str) -> bool:
                return any(w.shadowed_by is None for w in self.workers[role].values())
            pd = has(PREFILL) and has(DECODE)
            whole = has(AGGREGATED) or (pd and any(
                w.local_prefill and w.shadowed_by is None for w in self.workers[DECODE].values()))
            self._shapes = (pd, whole)
        return self._shapes

    def models(self) -> frozenset[str]:
        """The models served: the workers' and ``--model``."""
        if self._models is None:
            found = {w.model for w in self.all() if w.model}
            if self.config.model:
                found.add(self.config.model)
            self._models = frozenset(found)
        return self._models

    def unavailable_reason(self, role: str) -> str:
        """Why no ``role`` worker can be selected (assumes none can)."""
        workers = [w for w in self.pool(role) if w.shadowed_by is None]
        if not workers:
            return f"no {role} workers registered"
        not_ready = sum(1 for w in workers if not w.ready)
        unhealthy = sum(1 for w in workers if w.ready and not w.healthy)
        open_ = sum(1 for w in workers if w.ready and w.healthy and not w.breaker.allow())
        parts = []
        if open_:
            parts.append(f"{open_} with an open circuit")
        if unhealthy:
            parts.append(f"{unhealthy} unhealthy")
        if not_ready:
            parts.append(f"{not_ready} not ready")
        return f"all {len(workers)} {role} workers unavailable: " + ", ".join(parts)

    def _tell(self, event: str, worker: Worker) -> None:
        for cb in self.listeners:
            cb(event, worker)
