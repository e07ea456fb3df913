"""The router's exception tree, rooted at ``RouterError``.

Every error carries the HTTP ``status`` it is answered with and ``extra`` fields for the JSON
body, so the router maps them to answers in one place (``router.handlers.error_response``)
instead of one ``except`` per class. Messages say what to change.

``UpstreamError`` (``router.http.client``) is part of the tree too: the dispatcher and the
health checker catch it and turn it into a retry or a 502/503 of their own.
"""
from __future__ import annotations

from typing import Any


class RouterError(Exception):
    """Root of the router's errors: answered ``status`` with ``{"error": str(exc), **extra}``."""

    status: int = 500

    @property
    def extra(self) -> dict[str, Any]:
        """Fields of the JSON answer besides ``error``."""
        return {}

    @property
    def headers(self) -> dict[str, str] | None:
        """Headers of the answer besides the request id (None: none)."""
        return None


class BadRequest(RouterError):
    """A client error: HTTP ``status`` (400; 413 for a body over the limit) naming ``field``."""

    def __init__(self, field: str, reason: str, status: int = 400) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field = field
        self.reason = reason
        self.status = status


class UnknownModel(RouterError):
    """The request names a model no worker serves (404)."""

    status = 404


class NoWorkers(RouterError):
    """Nothing of ``role`` can be selected; ``reason`` says why (503)."""

    status = 503

    def __init__(self, role: str, reason: str) -> None:
        super().__init__(f"No available servers: {reason}")
        self.role = role
        self.reason = reason

    @property
    def extra(self) -> dict[str, Any]:
        return {"role": self.role}


class Overloaded(RouterError):
    """No slot for this request: ``status`` is 429 (queue full) or 408 (waited too long);
    ``retry_after``: seconds the client should wait before it retries (``Retry-After``)."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after

    @property
    def extra(self) -> dict[str, Any]:
        return {} if self.retry_after is None else {"retry_after_s": self.retry_after}

    @property
    def headers(self) -> dict[str, str] | None:
        return None if self.retry_after is None else {"retry-after": str(self.retry_after)}


class DiscoveredWorker(RouterError):
    """An admin call (``POST``/``DELETE /workers``) on a worker an etcd instance record
    describes (409): while the record lives, the worker's presence and URL are the record's."""

    status = 409

    def __init__(self, instance_id: str, role: str, url: str, key: str, action: str) -> None:
        super().__init__(
            f"{action}: {role} worker {instance_id} ({url}) is described by the etcd record "
            f"{key}, and while that record lives the worker and its URL are the record's. To "
            f"take it out of service drain its engine or stop its sidecar (the record goes "
            f"with its lease); to serve at another URL, have the instance publish it.")
        self.instance_id = instance_id
        self.role = role
        self.url = url
        self.key = key

    @property
    def extra(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "role": self.role, "record": self.key}
