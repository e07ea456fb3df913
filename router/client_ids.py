"""Request ids: the router's own, and the ``rid`` a client may choose.

Engines key their work by ``rid`` (pages, queues, aborts). A client's ``rid`` is the client's to
choose and so may repeat (16 requests with the same one), so it never reaches an engine: each
attempt sends an id the router made unique (one per batch item) instead, and the answer's bytes
get the client's back (``meta_info.id`` of /generate, ``id`` of an OpenAI answer on an engine that
honours ``rid``). Without a client ``rid`` nothing is rewritten: the engine makes its own.
"""
from __future__ import annotations

import itertools
import json
import secrets
from typing import Any

from router.errors import BadRequest

ClientRid = str | list[str]
"""A client's ``rid``: a string, or one string per item of a batch."""

_PREFIX = f"{secrets.randbits(64):016x}"
_counter = itertools.count(1)


def new_request_id() -> str:
    """Unique in this process, and across processes with near certainty: not a secret (a
    random per-process prefix and a counter)."""
    return f"{_PREFIX}{next(_counter):016x}"


def client_rid(body: dict[str, Any], batch: int | None) -> ClientRid | None:
    """The body's ``rid`` as the client sent it (None without one); BadRequest when it is not
    a non-empty string, or for a batch a list of them, one per item (SGLang's rule)."""
    rid = body.get("rid")
    if rid is None:
        return None
    if batch is None:
        if not isinstance(rid, str) or not rid:
            raise BadRequest("rid", "must be a non-empty string")
    elif not (isinstance(rid, list) and len(rid) == batch
              and all(isinstance(r, str) and r for r in rid)):
        raise BadRequest("rid", f"for a batch, must be a list of {batch} non-empty strings, "
                                "one per prompt")
    return rid


def engine_rid(client: ClientRid) -> ClientRid:
    """A fresh engine-side ``rid`` of the same shape as ``client``'s (each attempt gets its
    own: an engine may still hold the last attempt's id while it aborts it)."""
    base = new_request_id()
    return base if isinstance(client, str) else [f"{base}-{i}" for i in range(len(client))]


class RidEcho:
    """Puts the client's ``rid`` back where the engine wrote the router's, in the answer's
    bytes: a whole body, or a stream as it passes. The router's ids are hex (and ``-``), so
    each occurs as exactly ``"id"`` in the JSON the engine writes, and only there."""

    __slots__ = ("_pairs", "_held")

    def __init__(self, engine: ClientRid, client: ClientRid) -> None:
        engines = [engine] if isinstance(engine, str) else engine
        clients = [client] if isinstance(client, str) else client
        self._pairs = [(b'"%s"' % e.encode(), json.dumps(c).encode())
                       for e, c in zip(engines, clients)]
        self._held = b""

    def whole(self, data: bytes) -> bytes:
        for engine, client in self._pairs:
            data = data.replace(engine, client)
        return data

    def chunk(self, data: bytes) -> bytes:
        """What of a stream can go out now: up to its last newline. An id never spans a line
        (JSON escapes newlines), and an SSE event is complete only at its blank line, so
        holding back a partial line delays nothing a client could read."""
        data = self._held + data
        cut = data.rfind(b"\n") + 1
        self._held = data[cut:]
        return self.whole(data[:cut])

    def rest(self) -> bytes:
        """The end of a stream: whatever was held back."""
        held, self._held = self._held, b""
        return self.whole(held)
