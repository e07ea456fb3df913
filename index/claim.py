"""Refuse a second live process under an instance id that is taken.

Two processes with one id would overwrite each other's instance record and blocks in etcd, and
when one of them stops, its lease takes keys the other one wrote along with it. So at start an
instance looks at its record's key: held under a lease that someone still renews, by a holder
that still listens at the address its record names, the id is taken. A lease a crashed
predecessor left behind only counts down, so a restart with the same id goes on after one
renewal period's look, and its writes then take the keys over.
"""
from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

from index.errors import EtcdError, InstanceIdInUse, RecordError
from index.etcd import EtcdClient
from index.record import InstanceRecord

logger = logging.getLogger(__name__)

SLACK_S = 1.0
"""Margin over a holder's renewal period (a third of its TTL); also the truncation of TTLs to
whole seconds."""


async def ensure_id_free(client: EtcdClient, key: bytes, instance_id: str,
                         source: str | None = None) -> None:
    """Raise InstanceIdInUse when ``key`` holds a record of our kind (``source``: the record's
    ``source`` field, None for servers) under a lease that is being renewed. An index agent
    (source "kv-events") shares its id with the instance's bootstrap server by design, so each
    only looks at its own kind. Best effort: with etcd unreachable it returns (the instance
    serves without etcd meanwhile)."""
    loop = asyncio.get_running_loop()
    try:
        kv = await client.get(key)
        rec = _record(kv.value, key, instance_id) if kv is not None else None
        # An unreadable record names no kind: servers treat it as theirs (as an old one would).
        if kv is None or not kv.lease or (rec.source if rec else None) != source:
            return
        remaining, granted = await client.lease_ttls(kv.lease)
        replied = loop.time()
        if remaining <= 0:
            return
        window = granted / 3 + SLACK_S
        logger.info("instance id %s has a record under lease %x (%d s left): checking for "
                    "%.1f s whether a live process renews it", instance_id, kv.lease, remaining,
                    window)
        await asyncio.sleep(window)
        asked = loop.time()
        again, _ = await client.lease_ttls(kv.lease)
    except EtcdError as exc:
        logger.warning("could not check whether instance id %s is in use: %s", instance_id, exc)
        return
    # etcd truncates TTLs to whole seconds, and between its two readings at least
    # `asked - replied` seconds passed: a lease nobody renewed now reads below
    # remaining + 1 - that, so reading as much or more proves a renewal.
    renewed = again >= remaining + SLACK_S - (asked - replied)
    address = _address(rec)
    # The holder's address settles it where the record names one: this process has not bound
    # its own ports yet, so whatever answers there is the holder.
    if renewed and (address is None or await _listens(*address)):
        raise InstanceIdInUse(instance_id, kv.lease, _holder(rec))
    logger.info("instance id %s: its previous holder is gone; taking over", instance_id)


async def connect_and_claim(client: EtcdClient, key: bytes, instance_id: str,
                            source: str | None = None, meanwhile: str = "retrying") -> None:
    """A start path's first etcd step: connect and refuse a live holder of the id
    (``ensure_id_free``). etcd away is not an error: the process serves without it and its
    lease loop connects later (``meanwhile`` says what it does until then, for the log)."""
    try:
        await client.connect()
    except EtcdError as exc:
        logger.warning("etcd not reachable at start, %s: %s", meanwhile, exc)
        return
    await ensure_id_free(client, key, instance_id, source=source)


def _record(value: bytes, key: bytes, instance_id: str) -> InstanceRecord | None:
    """The record, or None when it cannot be read (then it names no kind and no address)."""
    try:
        return InstanceRecord.from_json(value, key=key, instance_id=instance_id)
    except RecordError as exc:
        logger.info("instance id %s: %s", instance_id, exc)
        return None


def _address(rec: InstanceRecord | None) -> tuple[str, int] | None:
    """Where the record's holder serves: its HTTP url, else its bootstrap server."""
    if rec is None:
        return None
    url = rec.url
    if isinstance(url, str):
        parts = urlsplit(url)
        try:
            if parts.hostname and parts.port:
                return parts.hostname, parts.port
        except ValueError:
            return None
    host, port = rec.bootstrap_host, rec.bootstrap_port
    if host is not None and port is not None:
        return host, port
    return None


async def _listens(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (TimeoutError, OSError):
        return False
    writer.close()
    return True


def _holder(rec: InstanceRecord | None) -> str:
    role = rec.role if rec is not None else "instance"
    address = _address(rec)
    return f"{role} at {address[0]}:{address[1]}" if address else role
