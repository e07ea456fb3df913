"""A decode serving a request whole: ``X-Kvatlas-Prefill: local`` and no bootstrap fields.

A router may send a short prompt to a decode whose record says ``local_prefill`` instead of
pairing it with a prefill. The decode then runs it as the monolithic engine does, through the
same handlers (``engine.server.generate``, ``engine.openai_api``) on the same ``AsyncEngine``:
the request joins the scheduler's FIFO queue, is admitted with its cached prefix from the
decode's own prefix cache, and draws on the same KV pool as the rooms whose KV arrives by
transfer (those reserve their pages between engine steps, in their own arrival order).
"""
from __future__ import annotations

from aiohttp import web

from engine.errors import BadRequest
from engine.http_common import read_body
from engine.pd.config import PDConfig

PREFILL_HEADER = "X-Kvatlas-Prefill"
"""The header a router sets to ask a decode to prefill the request itself."""
LOCAL = "local"
"""Its one value."""
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


async def wants_local_prefill(request: web.Request, cfg: PDConfig) -> bool:
    """Whether this decode request is to be prefilled here: True with ``X-Kvatlas-Prefill:
    local`` and no bootstrap fields, False without the header (a PD request, checked as
    before). BadRequest for any other value, for the header with bootstrap fields (a request
    is prefilled here or fetched from a prefill, not both), and for the header on a decode
    started without ``--local-prefill``."""
    value = request.headers.get(PREFILL_HEADER)
    if value is None:
        return False
    if value.strip().lower() != LOCAL:
        raise BadRequest(PREFILL_HEADER, f"the only value is {LOCAL!r}, got {value!r}")
    if not cfg.local_prefill:
        raise BadRequest(PREFILL_HEADER, f"{PREFILL_HEADER}: {LOCAL} is refused: this decode "
                         "runs without --local-prefill; send the request with bootstrap fields "
                         "(through a PD router) or to a decode that prefills locally")
    body = await read_body(request)  # aiohttp keeps the bytes: the handler reads them again
    given = [k for k in BOOTSTRAP_FIELDS if body.get(k) is not None]
    if given:
        raise BadRequest(given[0], f"{PREFILL_HEADER}: {LOCAL} asks this decode to prefill the "
                         f"request itself, but {', '.join(given)} name a prefill to fetch its "
                         "KV from: send the header or the bootstrap fields, not both")
    return True
