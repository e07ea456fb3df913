"""vLLM's PD contract (NixlConnector's ``kv_transfer_params``) as this engine speaks it.

A router drives a vLLM pair with one ``X-Request-Id`` sent to both halves. Each half names its
request ``cmpl-<X-Request-Id>`` (chat: ``chatcmpl-``) plus a random ``-<8 hex>`` suffix, as vLLM
does, and the pairing key is the id with the suffix stripped. This engine moves KV through the
same rooms as SGLang's bootstrap, so both halves derive the transfer room from that key
(``room_of``): the decode finds the prefill's ranks at its bootstrap server, which the prefill
names as ``remote_host``/``remote_port`` (pull) or its etcd record does (push).

This module only reads and writes the wire: which requests take the vLLM path, the decode's
``Bootstrap`` from the prefill's params, and the prefill's answer.
"""
from __future__ import annotations

import hashlib
import re
import secrets
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from engine.errors import BadRequest
from engine.pd.common import Bootstrap, bootstrap_fields
from index.pd_protocol import KV_PARAMS, PULL, PDProtocol
from index.rooms import ROUTER_ROOMS

_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
_SPAN = ROUTER_ROOMS.high - ROUTER_ROOMS.low + 1


def base_request_id(rid: str) -> str:
    """``rid`` without its random ``-<8 hex>`` suffix (vLLM's pairing key)."""
    return _SUFFIX.sub("", rid)


def room_of(base_id: str) -> int:
    """The transfer room both halves of a request derive from its base id: a hash into
    ``ROUTER_ROOMS`` (never 0, which the KV transfer refuses)."""
    digest = hashlib.blake2b(base_id.encode(), digest_size=8).digest()
    return ROUTER_ROOMS.low + int.from_bytes(digest, "big") % _SPAN


def engine_rid(request: web.Request, chat: bool) -> str:
    """This half's request id: ``cmpl-<X-Request-Id>-<8 hex>`` (``chatcmpl-`` for chat); a
    random id stands in for a missing header, as in vLLM."""
    given = request.headers.get("X-Request-Id") or secrets.token_hex(16)
    return f"{'chatcmpl' if chat else 'cmpl'}-{given}-{secrets.token_hex(4)}"


def kv_params(body: dict[str, Any]) -> dict[str, Any] | None:
    """The body's ``kv_transfer_params`` (None when absent or null); 400 unless an object."""
    kv = body.get(KV_PARAMS)
    if kv is not None and not isinstance(kv, dict):
        raise BadRequest(KV_PARAMS, f"must be an object, got {type(kv).__name__}")
    return kv


def wants_remote_decode(body: dict[str, Any], protocol: PDProtocol) -> bool:
    """Prefill: whether ``body`` asks for vLLM's path (``do_remote_decode: true``). A body
    without ``kv_transfer_params`` is SGLang's bootstrap request, served as ever; one that
    carries them on a prefill configured for SGLang is refused."""
    kv = kv_params(body)
    if kv is None:
        return False
    if protocol.name != "vllm":
        raise BadRequest(KV_PARAMS, "this prefill speaks SGLang's bootstrap (--pd-protocol "
                         "sglang): send bootstrap_host/port/room, or start it with "
                         "--pd-protocol vllm-pull or vllm-push")
    if kv.get("do_remote_decode") is not True:
        raise BadRequest(f"{KV_PARAMS}.do_remote_decode", "a prefill serves only "
                         "do_remote_decode: true (the first half of a disaggregated request)")
    return True


def decode_boot_of(protocol: PDProtocol) -> Callable[[dict[str, Any]], Bootstrap]:
    """Decode: how a body names its transfer under ``protocol``: SGLang's bootstrap fields
    (a body with ``kv_transfer_params`` refused), or vLLM's params (``decode_bootstrap``)."""
    if protocol.name == "vllm":
        return lambda body: decode_bootstrap(body, protocol)

    def sglang(body: dict[str, Any]) -> Bootstrap:
        if kv_params(body) is not None:
            raise BadRequest(KV_PARAMS, "this decode speaks SGLang's bootstrap (--pd-protocol "
                             "sglang): send bootstrap_host/port/room, or start it with "
                             "--pd-protocol vllm-pull or vllm-push")
        return bootstrap_fields(body)
    return sglang


def decode_bootstrap(body: dict[str, Any], protocol: PDProtocol) -> Bootstrap:
    """Decode: the ``Bootstrap`` (the prefill's bootstrap server and the room) that a vLLM body's
    ``kv_transfer_params`` name; 400 naming the missing or bad field. vLLM would recompute the
    prompt on bad params; this decode cannot prefill, so it refuses."""
    kv = kv_params(body)
    if kv is None:
        raise BadRequest(KV_PARAMS, f"missing: this decode speaks vLLM's kv_transfer_params "
                         f"(--pd-protocol {protocol.label}); bootstrap fields are SGLang's")
    if kv.get("do_remote_prefill") is not True:
        raise BadRequest(f"{KV_PARAMS}.do_remote_prefill", "must be true: a decode serves the "
                         "second half of a disaggregated request")
    mode = kv.get("transfer_mode")
    if mode is not None and mode != protocol.mode:
        raise BadRequest(f"{KV_PARAMS}.transfer_mode", f"{mode!r} does not match this decode's "
                         f"mode {protocol.mode!r}: pull and push peers refuse each other")
    for name in ("remote_engine_id", "remote_request_id", "remote_host"):
        v = kv.get(name)
        if not isinstance(v, str) or not v:
            raise BadRequest(f"{KV_PARAMS}.{name}", f"must be a non-empty string, got {v!r}")
    port = kv.get("remote_port")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise BadRequest(f"{KV_PARAMS}.remote_port", f"must be an integer in 1..65535, got "
                         f"{port!r}")
    if protocol.mode == PULL:
        blocks = kv.get("remote_block_ids")
        if not (isinstance(blocks, list) and blocks and all(isinstance(g, list) for g in blocks)
                and any(blocks)):
            raise BadRequest(f"{KV_PARAMS}.remote_block_ids", "must be a non-empty list of "
                             f"block-id lists (the prefill's answer), got {blocks!r}")
    room = room_of(base_request_id(kv["remote_request_id"]))
    return Bootstrap(kv["remote_host"], port, room)


def prefill_answer(*, rid: str, model: str, chat: bool, text: str, prompt_tokens: int,
                   cached_tokens: int, params: dict[str, Any]) -> dict[str, Any]:
    """A prefill's OpenAI answer (its one token) with top-level ``kv_transfer_params``."""
    base = {"id": rid, "created": int(time.time()), "model": model}
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": "length"}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        obj = "text_completion"
    return {**base, "object": obj, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1,
                      "total_tokens": prompt_tokens + 1,
                      "prompt_tokens_details": {"cached_tokens": cached_tokens}},
            KV_PARAMS: params}


def transfer_params(prefill: PDProtocol, *, rid: str, pages: list[int],
                    prompt_tokens: int) -> dict[str, Any]:
    """The ``kv_transfer_params`` prefill ``prefill`` (its identity) answers (vLLM's shape;
    ``pages``: the held KV's page ids on TP rank 0, as one KV-cache group)."""
    mode = prefill.mode
    params: dict[str, Any] = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [pages],
        "remote_engine_id": prefill.engine_id, "remote_request_id": rid,
        "remote_host": prefill.host, "remote_port": prefill.port, "tp_size": prefill.tp_size,
        "dcp_size": 1, "pp_size": 1, "remote_num_tokens": prompt_tokens}
    if mode == PULL:
        # no lease renewal here: the pages are held for kv_lease_s from the answer
        params.update(remote_blocks_expiry_time=None, remote_registration_generation=0)
    params["transfer_mode"] = mode
    return params
