"""Engine exceptions, rooted at ``EngineError`` (``engine.pd.fetch.FetchError``, a decode's failed
KV fetch, is one too). Each carries what went wrong and what to change; the HTTP layer maps
``BadRequest`` to 400 (its ``field`` is OpenAI's ``param``), ``DuplicateRequest`` to 409 and
``CapacityError`` to 503 in one place (``engine.http_common.error_middleware``, by
``STATUS_OF``); any other is a 500. Answers take their route's shape
(``bootstrap.http_errors``)."""
from __future__ import annotations


class EngineError(Exception):
    """Base of the engine's own errors."""


class BadRequest(EngineError):
    """A request the engine refuses as given (HTTP 400)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class DuplicateRequest(EngineError):
    """A request whose id is already in flight on this engine, or given twice in one batch
    (HTTP 409). Refused before it touches anything: the request already running keeps its
    pages, and the client (or the router) retries under a fresh id."""

    def __init__(self, rid: str, within_batch: bool = False) -> None:
        where = "twice in this batch" if within_batch else "already in flight on this engine"
        super().__init__(f"rid: request id {rid!r} is {where}; give every request its own rid")
        self.rid = rid


class CapacityError(EngineError):
    """A request that can never fit in the KV pool, however long it waits (HTTP 503)."""

    def __init__(self, needed_pages: int, capacity_pages: int, page_size: int) -> None:
        super().__init__(
            f"request needs {needed_pages} KV pages of {page_size} tokens but the pool holds "
            f"{capacity_pages}; shorten the prompt or max_new_tokens, or start the engine with "
            f"more --num-pages")
        self.needed_pages = needed_pages
        self.capacity_pages = capacity_pages


class PoolExhausted(EngineError):
    """Not enough free pages right now (the scheduler queues the request)."""

    def __init__(self, needed: int, free: int, capacity: int) -> None:
        super().__init__(f"need {needed} free KV pages, {free} of {capacity} free")
        self.needed = needed
        self.free = free
        self.capacity = capacity

