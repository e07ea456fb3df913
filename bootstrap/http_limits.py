"""How long a client may take to send a request, and the encoding its body must be in, for
kvatlas's aiohttp servers: the bootstrap server and the engine's worker port (``engine/`` imports
this; the router has its own HTTP layer with the same bound).

A slow client (slowloris: a request head or body trickled a byte at a time) would otherwise hold
a connection, and the memory behind it, for as long as it likes. Two bounds, one setting:

- The request head: aiohttp's keep-alive timer closes a connection whose next request head has
  not arrived whole ``read_timeout_s`` after the connection opened or its previous answer went
  out (aiohttp counts a half-received head as idle). ``web.run_app`` sets that timer to 75 s,
  a bare ``web.AppRunner`` to 3630 s: :func:`make_runner` and :func:`runner_options` give
  every server the app's own bound.
- The body: a handler reads it inside :func:`body_deadline`; a body not received whole within
  ``read_timeout_s`` is a 408 (JSON ``{"error": ...}``), and the connection is closed with it.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from bootstrap.http_errors import Refusal

READ_TIMEOUT_S = 75.0
"""Default bound, in seconds, on a request head and on a body (web.run_app's keep-alive)."""

READ_TIMEOUT = web.AppKey("read_timeout_s", float)

NOT_UTF8 = "is not UTF-8; send JSON encoded as UTF-8 (RFC 8259)"
"""The reason given for a body in another encoding, word for word the router's: a client gets
the same answer from the router, a worker and a bootstrap server."""
_WIDE_BOMS = (b"\x00\x00\xfe\xff", b"\xff\xfe", b"\xfe\xff")  # UTF-32-BE, UTF-16/32-LE, UTF-16-BE


def utf8_text(raw: bytes) -> str | None:
    """A JSON body's text, or None when it is not UTF-8 (``json.loads`` would guess UTF-16 or
    UTF-32 from bytes). UTF-16/32 text of ASCII is valid UTF-8 with NULs, and JSON text starts
    with ASCII: hence the NUL and BOM checks before the strict decode."""
    if b"\x00" in raw[:4] or raw.startswith(_WIDE_BOMS):
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def check_read_timeout(seconds: float) -> None:
    """The validation both servers' configs apply to their ``read_timeout_s``."""
    if not seconds > 0:
        raise ValueError(f"read timeout must be > 0 seconds, got {seconds}")


def bound_reads(app: web.Application, read_timeout_s: float) -> None:
    """Record the app's bound (its factory calls this; runners and handlers read it)."""
    check_read_timeout(read_timeout_s)
    app[READ_TIMEOUT] = read_timeout_s


def read_timeout(app: web.Application) -> float:
    return app.get(READ_TIMEOUT, READ_TIMEOUT_S)


def runner_options(app: web.Application) -> dict[str, Any]:
    """Keyword arguments for ``web.run_app`` / ``web.AppRunner`` that bound request heads."""
    return {"keepalive_timeout": read_timeout(app)}


def make_runner(app: web.Application, **kwargs: Any) -> web.AppRunner:
    """A ``web.AppRunner`` for ``app`` whose connections must send their heads in time."""
    return web.AppRunner(app, **runner_options(app), **kwargs)


@contextlib.asynccontextmanager
async def body_deadline(request: web.Request) -> AsyncIterator[None]:
    """Bound the reading of ``request``'s body done inside the block: 408 when it overruns."""
    seconds = read_timeout(request.app)
    timer = asyncio.timeout(seconds)
    try:
        async with timer:
            yield
    except TimeoutError:
        if not timer.expired():
            raise
        # Closed once answered: a "Connection: close" header alone leaves aiohttp reading (and
        # discarding) the rest of the body for up to 10 s more, then serving the next request
        # on the very connection that was too slow.
        raise Refusal(408, f"request body not received within {seconds:g} s (the server's "
                           "read timeout)", close=True) from None
