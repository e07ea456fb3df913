"""Validation of request bodies and injection of the bootstrap fields.

The router never forwards a body it could not make sense of: each endpoint's prompt fields and
token counts are checked here, and the prompt token ids (for kv_aware) are derived on the way.
Fields the router does not need (sampling parameters, ...) pass through untouched; the workers
validate them.
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import orjson

from router.errors import BadRequest
from router.json_body import load_json_fast
from router.limits import Limit, WorkerLimits
from router.prompt_hashes import prompt_hashes
from router.rooms import new_room
from tokenization import ChatTemplateError, Tokenizer
from tokenization.chat import request_template_args
from tokenization.messages import check_messages

GENERATE = "generate"
COMPLETIONS = "completions"
CHAT = "chat"
MAX_TOKEN_ID = 2**32 - 1


@dataclass
class Parsed:
    """What the router needs from a request body."""

    body: dict[str, Any]
    prompts: list[list[int] | np.ndarray]
    """Token ids per prompt (the first one is routed on)."""
    batch: int | None
    """Batch size when the body is a batch (bootstrap fields become lists), else None."""
    stream: bool
    model: str | None
    """The (canonical) model the body names; None: it names none."""
    route_model: str | None = None
    """The model the request is routed as: ``model``, else the router's default
    (``Tokenizers.for_request``, the one place it is settled)."""
    raw: bytes | None = None
    """The body as received (valid JSON, as parsed into ``body``); lets ``inject`` splice the
    bootstrap fields in instead of serializing the whole body again."""
    hashes: tuple[int, list[int]] | None = None
    """(seed, block hashes) of the first prompt, when a large body's were computed in the
    parser's thread (``RouteContext.pre_hashed``)."""
    orjson_parsed: bool = False
    """orjson parsed ``body``, so orjson can write it again as it was (``_dumps``)."""
    from_text: bool = False
    """The prompts are text or chat (the router tokenized them), not token ids."""
    tokenizer: Tokenizer | None = None
    """The tokenizer of ``model`` the text was encoded with; None: none is known here, and a
    text prompt's ids are empty (routed on load alone, ``load_only``)."""
    samples: tuple[str, int] | None = None
    """(field, n) when the body asks for n > 1 samples (``n``, ``sampling_params.n``): only a
    worker that serves the request whole takes it (a PD pair runs one sample per room)."""
    api: str = GENERATE
    """The API the body was read as: ``generate`` (SGLang's), ``completions`` or ``chat``."""

    @property
    def load_only(self) -> bool:
        """Text the router could not tokenize: kv_aware sees no prefix of it."""
        return self.from_text and self.tokenizer is None


def _ids(value: Any, field: str, limit: Limit | None = None) -> list[int]:
    if not isinstance(value, list) or not value:
        raise BadRequest(field, "must be a non-empty list of token ids")
    if limit is not None and len(value) > limit.value:
        raise BadRequest(field, limit.prompt_reason(len(value)))
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise BadRequest(f"{field}[{i}]", f"must be an integer, got {type(t).__name__}")
        if not 0 <= t <= MAX_TOKEN_ID:
            raise BadRequest(f"{field}[{i}]", f"token id {t} is outside [0, 2^32-1]")
    return value


NO_IDS = np.empty(0, dtype="<u4")
"""The ids of a text prompt whose model has no tokenizer here: nothing to hash (load-only)."""
_SURROGATE = "is not valid UTF-8 (contains a lone surrogate)"


def _text(value: Any, field: str, limit: Limit | None = None,
          tok: Tokenizer | None = None) -> np.ndarray:
    """The ids the engines prefill for text ``value`` (``encode``, special tokens added)."""
    if not isinstance(value, str):
        raise BadRequest(field, f"must be a string, got {type(value).__name__}")
    if not value:
        raise BadRequest(field, "must not be empty")
    if tok is None:
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequest(field, _SURROGATE) from None
        return NO_IDS
    least = tok.min_tokens(value) if limit is not None else 0
    if limit is not None and least > limit.value:
        # refused from its length alone, before any tokenizer work
        raise BadRequest(field, limit.prompt_reason(f"at least {least}"))
    try:
        ids = tok.encode_array(value)
    except UnicodeEncodeError:
        raise BadRequest(field, _SURROGATE) from None
    except ValueError as exc:
        raise BadRequest(field, f"cannot be tokenized ({exc})") from None
    if limit is not None and len(ids) > limit.value:
        raise BadRequest(field, limit.prompt_reason(len(ids)))
    return ids


def _chat(body: dict[str, Any], messages: list[Any], limit: Limit | None,
          tok: Tokenizer | None) -> np.ndarray:
    """The ids the engines prefill for ``messages``: the model's chat template, with the body's
    ``tools`` and ``chat_template_kwargs``, then encoded without special tokens."""
    try:
        tools, kwargs = request_template_args(body)
        if tok is None:
            check_messages(messages)  # load-only: still refused as the engines would
            return NO_IDS
        ids = tok.encode_chat_array(messages, tools=tools, **kwargs)
    except ChatTemplateError as exc:
        raise BadRequest(exc.path, exc.reason) from None
    except UnicodeEncodeError:
        raise BadRequest("messages", _SURROGATE) from None
    except ValueError as exc:
        raise BadRequest("messages", f"cannot be tokenized ({exc})") from None
    if limit is not None and len(ids) > limit.value:
        raise BadRequest("messages", limit.prompt_reason(len(ids)))
    return ids


def _count(d: dict[str, Any], key: str, limit: int, prefix: str = "") -> None:
    v = d.get(key)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int):
        if not (isinstance(v, float) and v.is_integer()):
            raise BadRequest(prefix + key, f"must be an integer, got {type(v).__name__}")
        v = int(v)
    if v < 0:
        raise BadRequest(prefix + key, f"must be >= 0, got {v}")
    if v > limit:
        raise BadRequest(prefix + key, f"{v} is absurd: the router allows at most {limit}")


def _flag(d: dict[str, Any], key: str) -> bool:
    v = d.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(key, f"must be a boolean, got {type(v).__name__}")
    return v


def _model(d: dict[str, Any]) -> str | None:
    m = d.get("model")
    if m is not None and not isinstance(m, str):
        raise BadRequest("model", f"must be a string, got {type(m).__name__}")
    return m or None


def parse_generate(body: dict[str, Any], max_tokens: int, limit: Limit | None = None,
                   tok: Tokenizer | None = None) -> Parsed:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("text", "give exactly one of text or input_ids (the prompt is missing)"
                         if text is None else "give exactly one of text or input_ids")
    batch: int | None = None
    if text is not None:
        if isinstance(text, list):
            if not text:
                raise BadRequest("text", "batch must not be empty")
            prompts = [_text(t, f"text[{i}]", limit, tok) for i, t in enumerate(text)]
            batch = len(prompts)
        else:
            prompts = [_text(text, "text", limit, tok)]
    else:
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            prompts = [_ids(p, f"input_ids[{i}]", limit) for i, p in enumerate(ids)]
            batch = len(prompts)
        else:
            prompts = [_ids(ids, "input_ids", limit)]
    sp = body.get("sampling_params")
    samples = None
    if sp is not None:
        if not isinstance(sp, dict):
            raise BadRequest("sampling_params", f"must be an object, got {type(sp).__name__}")
        samples = _samples(sp.get("n"), "sampling_params.n")
        for key in ("max_new_tokens", "min_new_tokens"):
            v = sp.get(key)
            # The usual small int passes without the full check (which gives the messages).
            if v is not None and not (v.__class__ is int and 0 <= v <= max_tokens):
                _count(sp, key, max_tokens, "sampling_params.")
    stream = _flag(body, "stream")
    if batch is not None and stream:
        raise BadRequest("stream", "streaming is supported for a single prompt only")
    return Parsed(body, prompts, batch, stream, _model(body), from_text=text is not None,
                  samples=samples)


def parse_completion(body: dict[str, Any], max_tokens: int, limit: Limit | None = None,
                     tok: Tokenizer | None = None) -> Parsed:
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("prompt", "is missing")
    batch: int | None = None
    text = isinstance(prompt, str)
    if text:
        prompts = [_text(prompt, "prompt", limit, tok)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        text = True
        prompts = [_text(p, f"prompt[{i}]", limit, tok) for i, p in enumerate(prompt)]
        batch = len(prompts) if len(prompts) > 1 else None
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [_ids(p, f"prompt[{i}]", limit) for i, p in enumerate(prompt)]
        batch = len(prompts) if len(prompts) > 1 else None
    else:
        prompts = [_ids(prompt, "prompt", limit)]
    samples = _openai_common(body, max_tokens)
    stream = _flag(body, "stream")
    return Parsed(body, prompts, batch, stream, _model(body), from_text=text,
                  samples=samples, api=COMPLETIONS)


def parse_chat(body: dict[str, Any], max_tokens: int, limit: Limit | None = None,
               tok: Tokenizer | None = None) -> Parsed:
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("messages", "is missing")
    if not isinstance(messages, list):
        raise BadRequest("messages", f"must be a list, got {type(messages).__name__}")
    prompts = [_chat(body, messages, limit, tok)]
    samples = _openai_common(body, max_tokens)
    return Parsed(body, prompts, None, _flag(body, "stream"), _model(body), from_text=True,
                  samples=samples, api=CHAT)


def _openai_common(body: dict[str, Any], max_tokens: int) -> tuple[str, int] | None:
    for key in ("max_tokens", "max_completion_tokens"):
        _count(body, key, max_tokens)
    return _samples(body.get("n"), "n")


def _samples(n: Any, field: str) -> tuple[str, int] | None:
    """(``field``, n) when ``n`` asks for more than one sample (only a worker that serves the
    request whole takes it: ``several_samples``), None for one; BadRequest unless a positive
    integer."""
    if n is None or n.__class__ is int and n == 1:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BadRequest(field, f"must be a positive integer, got {n!r}")
    return field, n


def several_samples(field: str, n: int) -> BadRequest:
    """The refusal of ``n`` > 1 samples where only PD pairs serve."""
    # One bootstrap room is one prefill's KV for one decode: n samples would need n rooms,
    # and sglang's PD engines refuse n > 1 too.
    return BadRequest(field, f"must be 1 (got {n}): prefill/decode disaggregation runs one "
                            "sample per prompt; send the prompt n times instead")


def _parse_any(body: dict[str, Any], max_tokens: int, limit: Limit | None = None,
               tok: Tokenizer | None = None) -> Parsed:
    """For /debug/route: whichever prompt field the body carries."""
    if "messages" in body:
        return parse_chat(body, max_tokens, limit, tok)
    if "prompt" in body and "text" not in body and "input_ids" not in body:
        return parse_completion(body, max_tokens, limit, tok)
    return parse_generate(body, max_tokens, limit, tok)


ANY = "any"
PARSERS = {GENERATE: parse_generate, COMPLETIONS: parse_completion, CHAT: parse_chat,
           ANY: _parse_any}

OFF_LOOP_BYTES = 256 << 10
"""Bodies larger than this are parsed, validated and tokenized in a thread, so that one huge
body does not stall the event loop (health answers, etcd watches, every other request): the
thread's Python work yields the GIL every few ms, the loop's own turns stay short. Smaller
bodies take well under a millisecond: a thread hop would only add to their latency."""

OFF_LOOP_BYTES_HF = 16 << 10
"""The same bound for a model with a real (BPE) tokenizer, which takes up to a microsecond per
byte of text it has not cached: a 16 KiB body of new text measured 6-12 ms inline here (Qwen3),
a thread hop 0.1 ms, so such bodies leave the loop much sooner."""


class ResolvesTokenizers(Protocol):
    """What the parser asks of ``router.tokenizers.Tokenizers``."""

    def for_request(self, named: str | None) -> tuple[str | None, Tokenizer | None]:
        """(the model a request naming ``named`` is routed as, its tokenizer or None)."""
        ...


_parse_pool: ThreadPoolExecutor | None = None


def parse_request(kind: str, raw: bytes, max_tokens: int, limits: WorkerLimits | None = None,
                  block_size: int | None = None,
                  tokenizers: ResolvesTokenizers | None = None) -> Parsed:
    """``raw`` checked as a ``kind`` request (``ANY``: whichever fields it has), with its
    prompt limit: that of the model it names, text tokenized with that model's tokenizer
    (``tokenizers``; None: no text is tokenized). With ``block_size``, the first prompt's block
    hashes are computed too."""
    if limits is not None and limits.body is not None and len(raw) > limits.body.value:
        raise BadRequest("body", f"has {len(raw)} bytes; at most {limits.body.value} are taken "
                                 f"({limits.body.source})", 413)
    body, fast = load_json_fast(raw)
    named = body.get("model")
    model, tok = None, None
    if named.__class__ is str or named is None:
        if tokenizers is not None:
            model, tok = tokenizers.for_request(named or None)
        else:
            model = named or None
    limit = limits.prompt(model, tok) if limits else None
    parsed = PARSERS[kind](body, max_tokens, limit, tok)
    parsed.raw = raw
    parsed.orjson_parsed = fast
    parsed.tokenizer = tok
    parsed.route_model = model
    if named:
        parsed.model = model  # canonical: an alias names its model
    if block_size is not None:
        parsed.hashes = prompt_hashes(parsed.prompts[0], block_size)
    return parsed


async def parse_body(kind: str, raw: bytes, max_tokens: int, limits: WorkerLimits | None,
                     block_size: int, tokenizers: ResolvesTokenizers | None = None,
                     off_loop: int = OFF_LOOP_BYTES) -> Parsed:
    """``parse_request``; in a thread for a body over ``off_loop`` bytes, where the prompt's
    block hashes are computed as well."""
    if len(raw) <= off_loop:
        return parse_request(kind, raw, max_tokens, limits, None, tokenizers)
    global _parse_pool
    if _parse_pool is None:
        # Its own two threads: huge bodies queue here, never in the default executor that
        # upstream connects resolve names in.
        _parse_pool = ThreadPoolExecutor(2, thread_name_prefix="router-parse")
    return await asyncio.get_running_loop().run_in_executor(
        _parse_pool, parse_request, kind, raw, max_tokens, limits, block_size, tokenizers)


BOOTSTRAP_KEYS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def inject(parsed: Parsed, host: str | None, port: int | None,
           rid: str | list[str] | None = None) -> tuple[bytes, list[int]]:
    """The body to send to both sides, with bootstrap fields (lists for a batch), and its rooms;
    ``rid``, when given, replaces the client's (see ``router.client_ids``)."""
    if parsed.batch is None:
        room = new_room()
        rooms = [room]
        fields: dict[str, Any] = {"bootstrap_host": host, "bootstrap_port": port,
                                  "bootstrap_room": room}
    else:
        rooms = [new_room() for _ in range(parsed.batch)]
        while len(set(rooms)) < len(rooms):
            rooms = [new_room() for _ in range(parsed.batch)]
        fields = {"bootstrap_host": [host] * parsed.batch,
                  "bootstrap_port": [port] * parsed.batch, "bootstrap_room": rooms}
    if rid is not None:
        fields["rid"] = rid  # the body has one: it is re-serialized below, not spliced
    raw = parsed.raw
    body = parsed.body
    if (rid is None and raw is not None and body and "bootstrap_host" not in body
            and "bootstrap_port" not in body and "bootstrap_room" not in body):
        head = raw.rstrip()
        if head.endswith(b"}"):
            # The received object with three members appended: same JSON, no re-serialization.
            if parsed.batch is None:
                tail = _single_tail(host, port) + b"%d}" % rooms[0]
            else:
                tail = json.dumps(fields, separators=(",", ":")).encode()[1:]
            return b"".join((head[:-1], b",", tail)), rooms
    body = dict(body)
    body.update(fields)
    return dumps_body(body, parsed.orjson_parsed), rooms


def with_rid(parsed: Parsed, rid: str | list[str] | None) -> bytes:
    """The body for a worker that serves the request whole (aggregated): as received, or with
    ``rid`` in place of the client's (``router.client_ids``)."""
    if rid is None and parsed.raw is not None:
        return parsed.raw
    body = dict(parsed.body)
    if rid is not None:
        body["rid"] = rid
    return dumps_body(body, parsed.orjson_parsed)


def dumps_body(body: dict[str, Any], orjson_parsed: bool) -> bytes:
    """``body`` as compact JSON in UTF-8. Not ``json.dumps``' default ASCII: it writes each
    non-ASCII character as ``\\uXXXX`` (twice the bytes of CJK text, three times those of
    accented Latin), so a body the router took could exceed the engines' body limit; orjson
    is also ~10x faster, which matters on the event loop for a large body with a client rid.
    But only for what orjson parsed: it writes an infinity (1e400 in the body) as null."""
    if orjson_parsed:
        try:
            return orjson.dumps(body)
        except orjson.JSONEncodeError:
            pass  # depth over 255 (orjson reads 1024 levels, writes 255)
    try:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:  # a lone surrogate (a "\\udXXX" escape) has no UTF-8 form
        return json.dumps(body, separators=(",", ":")).encode()


_tails: dict[tuple[str | None, int | None], bytes] = {}


def _single_tail(host: str | None, port: int | None) -> bytes:
    """``"bootstrap_host":...,"bootstrap_port":...,"bootstrap_room":`` as ``json.dumps``
    writes it, kept per prefill (a few distinct values)."""
    key = (host, port)
    tail = _tails.get(key)
    if tail is None:
        if len(_tails) >= 4096:
            _tails.clear()
        text = json.dumps({"bootstrap_host": host, "bootstrap_port": port}, separators=(",", ":"))
        tail = _tails[key] = text[1:-1].encode() + b',"bootstrap_room":'
    return tail
