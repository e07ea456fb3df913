"""The bootstrap layer's exception tree, rooted at ``BootstrapLayerError``.

Two branches: ``BootstrapError`` for the decode-side client (every one carries the bootstrap
address it concerns, so that one log line on a decode rank tells an operator which prefill
instance to look at), and ``RequestError`` for what the bootstrap server refuses (each carries its
HTTP ``status``; ``bootstrap.server``'s middleware is the one place that turns them into answers).
``TopologyMismatch`` comes from the decode -> prefill rank mapping. Every message says what to
check or change.
"""
from __future__ import annotations

from typing import Any


class BootstrapLayerError(Exception):
    """Root of the bootstrap layer's errors."""


class RequestError(BootstrapLayerError):
    """A request the bootstrap server refuses: answered ``status`` with ``body()`` as JSON."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status

    def body(self) -> dict[str, Any]:
        return {"error": str(self)}


class BadRequest(RequestError):
    """Bad input: 400, or 413 for a body over the limit."""


class RegistrationError(RequestError):
    """A registration refused: ``status`` is the HTTP code (400, or 409 when it contradicts the
    registered topology), ``field`` the offending body field."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message, status)
        self.field = field

    def body(self) -> dict[str, Any]:
        return {"error": str(self), "field": self.field}


class TopologyMismatch(BootstrapLayerError, ValueError):
    """Decode and prefill disagree on something the KV layout depends on.

    A mismatch in ``page_size`` or ``kv_cache_dtype`` would make the decode read pages it cannot
    interpret, so it is refused before any transfer is set up. ``field`` names the setting,
    ``decode_value`` / ``prefill_value`` are both sides' values.
    """

    def __init__(
        self, field: str, decode_value: object, prefill_value: object, *, addr: str = "", hint: str = ""
    ) -> None:
        self.field = field
        self.decode_value = decode_value
        self.prefill_value = prefill_value
        self.addr = addr
        where = f" (prefill bootstrap {addr})" if addr else ""
        tail = f": {hint}" if hint else ""
        super().__init__(
            f"decode {field} {decode_value!r} != prefill {field} {prefill_value!r}{where}{tail}"
        )


class BootstrapError(BootstrapLayerError):
    """A call to a prefill instance's bootstrap server failed.

    ``addr`` is the bootstrap address (``host:port``) and ``reason`` a sentence saying what went
    wrong and what to check.
    """

    def __init__(self, *, addr: str, reason: str) -> None:
        self.addr = addr
        self.reason = reason
        super().__init__(f"bootstrap {addr}: {reason}")


class BootstrapUnreachable(BootstrapError):
    """No HTTP answer at all: connection refused, DNS failure, or the per-call timeout expired."""


class BootstrapNotReady(BootstrapError):
    """The server answered 503 (not all prefill ranks registered) on every one of ``tries`` tries."""

    def __init__(self, *, addr: str, reason: str, tries: int, last_status: int | None) -> None:
        self.tries = tries
        self.last_status = last_status
        super().__init__(addr=addr, reason=reason)


class UnknownRank(BootstrapError):
    """The server answered 404: the instance is ready but has no cell ``(dp, cp, tp, pp)``.

    Usually the decode computed a rank outside the prefill's topology (wrong parallel sizes).
    """

    def __init__(self, *, addr: str, reason: str, cell: tuple[int, int, int, int]) -> None:
        self.cell = cell
        super().__init__(addr=addr, reason=reason)


class BadResponse(BootstrapError):
    """The server answered something the protocol does not allow (bad JSON, wrong fields, an
    unexpected status). Often this is not a bootstrap server at all: check the port."""

    def __init__(self, *, addr: str, reason: str, status: int | None = None) -> None:
        self.status = status
        super().__init__(addr=addr, reason=reason)


class BootstrapAuthError(BootstrapError):
    """The server refused a POST with 401/403: the decode's bearer token is missing or wrong."""
