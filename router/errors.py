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
    """No slot for this request: ``status`` is 429 (queue full) or 408 (waited too long)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
