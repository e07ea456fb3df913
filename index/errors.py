"""kvatlas's etcd exception tree.

gRPC and aetcd errors are mapped onto these in exactly one place (``index.etcd``), so callers
never see a transport library's exception and every message says what to check.
"""
from __future__ import annotations


class IndexLayerError(Exception):
    """Root of the index layer's errors."""


class EtcdError(IndexLayerError):
    """An etcd operation failed.

    ``endpoint`` is the etcd address the client was using and ``op`` the operation, so a log line
    alone tells an operator which etcd and which call to look at.
    """

    def __init__(self, message: str, *, endpoint: str = "", op: str = "") -> None:
        self.endpoint = endpoint
        self.op = op
        where = f" ({op} on {endpoint})" if endpoint or op else ""
        super().__init__(f"{message}{where}")


class EtcdUnavailable(EtcdError):
    """etcd cannot be reached or has no quorum; check that it runs and the address is right."""


class EtcdTimeout(EtcdUnavailable):
    """etcd did not answer within the deadline; it may be overloaded or partitioned."""


class EtcdAuthError(EtcdError):
    """etcd refused the credentials; check --etcd-user/--etcd-password or the TLS files."""


class EtcdCompacted(EtcdError):
    """A watch asked for a revision that etcd has already compacted; reload from a fresh get."""

    def __init__(self, compact_revision: int, *, endpoint: str = "", op: str = "watch") -> None:
        self.compact_revision = compact_revision
        super().__init__(
            f"revision compacted up to {compact_revision}; reload the range", endpoint=endpoint, op=op
        )


class LeaseExpired(EtcdError):
    """The lease is gone (expired or revoked); keys written under it have been deleted."""


class EtcdRequestError(EtcdError):
    """etcd refused the request itself (too many ops in a txn, bad key, quota exceeded)."""


class MalformedValue(IndexLayerError, ValueError):
    """An etcd key or value that this kvatlas does not read: written by another tool, a newer
    kvatlas, or damaged. Every decoder of a stored key or value raises a subclass of it and
    nothing else, so a watch loop (``index.follow``) skips that one key, counts it under
    ``reason`` (a short label, also a metric label) and goes on with the rest.
    """

    def __init__(self, reason: str, detail: str, key: bytes | str = "") -> None:
        self.reason = reason
        self.detail = detail
        self.key = key.decode(errors="replace") if isinstance(key, bytes) else key
        super().__init__(f"{self.key}: {reason}: {detail}" if self.key else f"{reason}: {detail}")


class MalformedKey(MalformedValue):
    """An etcd key under one of kvatlas's prefixes that is not exactly how ``index.keys``
    writes it (not UTF-8, a path of the wrong shape, an invalid instance id); reason
    ``bad_key``."""

    def __init__(self, key: bytes | str, detail: str) -> None:
        super().__init__("bad_key", detail, key)


class RecordError(MalformedValue):
    """An instance record (``/{prefix}/v1/instances/{id}``) that this kvatlas cannot use.

    ``reason`` is ``"malformed"`` (not JSON, not an object, a missing or ill-typed field) or
    ``"newer_version"`` (written by a newer kvatlas: upgrade this process); ``key`` names the
    etcd key, so one log line tells an operator which record to look at.
    """

    def __init__(self, key: str, reason: str, detail: str) -> None:
        super().__init__(reason, detail, key)
        # The record's own wording (callers print it as is).
        self.args = (f"instance record {key or '(no key)'}: {detail}",)


class InstanceIdInUse(IndexLayerError):
    """Another live process holds this instance id's record in etcd."""

    def __init__(self, instance_id: str, lease: int, holder: str) -> None:
        super().__init__(
            f"instance id {instance_id!r} is in use by a live process ({holder}, etcd lease "
            f"{lease:x} still renewed): give this one another --instance-id, or stop that one")
        self.instance_id = instance_id
        self.lease = lease
        self.holder = holder
