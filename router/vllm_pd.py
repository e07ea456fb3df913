"""vLLM's PD protocol (NixlConnector's ``kv_transfer_params``): the bodies the router sends each
half of a pair and what it reads from the prefill's answer. Data only; ``router.dispatch`` does
the I/O.

Checked against vLLM 0.33 (docs/vllm.md lists each field with the file and line it is read at):

- both halves get the same ``X-Request-Id`` (``request_id``), fresh per attempt: vLLM pairs a
  prefill's blocks with their reader by that id (``cmpl-<id>``, ``chatcmpl-<id>`` for chat, the
  engine's random ``-<8 hex>`` suffix stripped), so a client's own id, which two clients may
  share, is never used for it;
- the prefill gets the client's body with ``do_remote_decode``, ``stream: false``, one token,
  and without what a prefill refuses (``stream_options``, ``min_tokens``,
  ``min_completion_tokens``), as vLLM's own proxy sends it;
- pull: the decode gets the client's body and the prefill's answered ``kv_transfer_params``
  as they came; push: the decode's params name the prefill in advance (``PDProtocol``'s
  identity from its record), so both can be sent at once.

A client's own ``kv_transfer_params`` never reaches a worker: the router writes the field on
both sides (a client naming a host and block ids would have a decode read whatever it points at).
"""
from __future__ import annotations

import uuid
from typing import Any

import orjson

from index.pd_protocol import KV_PARAMS, PREFILL_PARAMS
from router.requests import CHAT, Parsed, dumps_body

_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")


def new_request_id() -> str:
    """The id both halves of one attempt share (``X-Request-Id``)."""
    return uuid.uuid4().hex


def engine_request_id(parsed: Parsed, request_id: str) -> str:
    """The base id a vLLM engine gives the request sent with ``X-Request-Id: request_id``
    (what push mode's ``remote_request_id`` names)."""
    return f"{'chatcmpl' if parsed.api == CHAT else 'cmpl'}-{request_id}"


def prefill_body(parsed: Parsed) -> bytes:
    body = dict(parsed.body)
    for key in _NOT_FOR_PREFILL:
        body.pop(key, None)
    body[KV_PARAMS] = PREFILL_PARAMS
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    return dumps_body(body, parsed.orjson_parsed)


def decode_body(parsed: Parsed, params: dict[str, Any] | None) -> bytes:
    """The client's body for the decode, with ``params`` (None: the prefill answered none, and
    the decode computes the prompt itself, as behind vLLM's proxy)."""
    body = parsed.body
    raw = parsed.raw
    if raw is not None and body and KV_PARAMS not in body:
        head = raw.rstrip()
        if head.endswith(b"}"):
            if params is None:
                return raw
            # The received object with one member appended: no re-serialization.
            return b"".join((head[:-1], b',"kv_transfer_params":', orjson.dumps(params), b"}"))
    out = dict(body)
    out.pop(KV_PARAMS, None)
    if params is not None:
        out[KV_PARAMS] = params
    return dumps_body(out, parsed.orjson_parsed)


def answered_params(body: bytes) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a prefill's answer; None when it has none (an aborted
    prefill) or the answer is not a JSON object."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    params = doc.get(KV_PARAMS) if isinstance(doc, dict) else None
    return params if isinstance(params, dict) and params else None
