"""Parsing and validation of SGLang ``/generate`` and OpenAI request bodies.

Prompts become token ids by the engine's tokenizer (``tokenization``), by the rules SGLang and
vLLM apply: text (``/generate`` ``text``, an OpenAI completion ``prompt`` string) is
``tok.encode(text, add_special_tokens=True)``; chat ``messages`` are
``tok.encode_chat(messages, **chat_template_kwargs)``; ids (``input_ids``, a ``prompt`` list of
ints) are used as given. Every parser takes the tokenizer (``tok``); without one it is the byte
tokenizer (for callers outside the engine: tests, tools).

Everything a client can get wrong raises ``BadRequest(field, reason)`` (HTTP 400): wrong JSON
types, empty prompts, prompts longer than the model's positions, ``max_new_tokens`` out of range,
negative temperatures, text that is not valid UTF-8 (lone surrogates), ids outside the vocab,
chat messages the template refuses (its own message) and content parts that are not text.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from bootstrap.http_limits import NOT_UTF8, utf8_text
from engine.config import ModelConfig
from engine.errors import BadRequest
from engine.sampling import MAX_SEED, MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams
from tokenization.base import ChatTemplateError, Tokenizer
from tokenization.chat import request_template_args

DEFAULT_MAX_NEW_TOKENS = 128
OPENAI_COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass
class GenInput:
    """One prompt to generate for, validated."""

    prompt: list[int]
    params: SamplingParams
    rid: str | None = None


def load_json(raw: bytes) -> dict[str, Any]:
    text = utf8_text(raw)
    if text is None:
        raise BadRequest("body", NOT_UTF8)
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequest("body", f"not valid JSON: {exc.msg} at position {exc.pos}") from None
    except RecursionError:
        raise BadRequest("body", "JSON nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    return body


# -- typed field access ----------------------------------------------------------------------
def _int(d: dict[str, Any], key: str, default: int | None, lo: int | None = None,
         hi: int | None = None, prefix: str = "") -> int | None:
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise BadRequest(prefix + key, f"must be an integer, got {type(v).__name__}")
    if lo is not None and v < lo:
        raise BadRequest(prefix + key, f"must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise BadRequest(prefix + key, f"must be <= {hi}, got {v}")
    return v


def _float(d: dict[str, Any], key: str, default: float, prefix: str = "") -> float:
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise BadRequest(prefix + key, f"must be a number, got {type(v).__name__}")
    if v != v or v in (float("inf"), float("-inf")):
        raise BadRequest(prefix + key, "must be finite")
    return float(v)


def _bool(d: dict[str, Any], key: str, default: bool, prefix: str = "") -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(prefix + key, f"must be a boolean, got {type(v).__name__}")
    return v


def _stop(d: dict[str, Any], key: str, prefix: str = "") -> list[str]:
    v = d.get(key)
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise BadRequest(prefix + key, "must be a non-empty string or a list of non-empty strings")
    if len(items) > MAX_STOP_STRINGS:
        raise BadRequest(prefix + key, f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
    for i, s in enumerate(items):
        if len(s) > MAX_STOP_CHARS:
            raise BadRequest(prefix + key, f"stop string {i} has {len(s)} characters; at most "
                                           f"{MAX_STOP_CHARS}")
    for s in items:
        _check_text(s, prefix + key)
    return list(items)


def _check_text(text: str, field: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(field, "is not valid UTF-8 (contains a lone surrogate)") from None


def _too_long(n: int, field: str, max_positions: int, at_least: bool = False) -> BadRequest:
    # max_positions - 1: ModelConfig.max_prompt_tokens, which /server_info reports
    has = f"at least {n}" if at_least else str(n)
    return BadRequest(field, f"prompt has {has} tokens; the model takes at most "
                             f"{max_positions - 1} (max positions {max_positions})")


@functools.cache
def default_tokenizer() -> Tokenizer:
    """The byte tokenizer, for parsers called without the engine's tokenizer."""
    from tokenization import ByteTokenizer

    return ByteTokenizer()


def encode_text(text: object, field: str, tok: Tokenizer | None = None, *,
                max_positions: int | None = None) -> list[int]:
    """Token ids of ``text`` (``tok.encode(text, add_special_tokens=True)``). With
    ``max_positions`` an over-long text is refused: first from its length alone
    (``tok.min_tokens``), before anything is encoded (a huge body costs no tokenizer work); then
    exactly, from its ids."""
    tok = tok or default_tokenizer()
    if not isinstance(text, str):
        raise BadRequest(field, f"must be a string, got {type(text).__name__}")
    if not text:
        raise BadRequest(field, "must not be empty")
    _check_text(text, field)
    if max_positions is not None:
        least = tok.min_tokens(text)
        if least >= max_positions:
            raise _too_long(least, field, max_positions, at_least=True)
    try:
        ids = tok.encode(text, add_special_tokens=True)
    except ValueError as exc:
        raise BadRequest(field, f"cannot be tokenized: {exc}") from None
    if max_positions is not None and len(ids) >= max_positions:
        raise _too_long(len(ids), field, max_positions)
    return ids


def id_bound(model: ModelConfig, tok: Tokenizer) -> int:
    """Ids a request may give are ``0 .. id_bound - 1``: in the tokenizer's vocabulary and
    the model's embedding (a checkpoint may pad its embedding past the tokenizer)."""
    return min(model.vocab_size, tok.vocab_size)


def check_ids(ids: object, field: str, vocab: int, max_positions: int | None = None) -> list[int]:
    if not isinstance(ids, list):
        raise BadRequest(field, f"must be a list of token ids, got {type(ids).__name__}")
    if not ids:
        raise BadRequest(field, "must not be empty")
    if max_positions is not None and len(ids) >= max_positions:
        raise _too_long(len(ids), field, max_positions)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise BadRequest(f"{field}[{i}]", f"must be an integer, got {type(t).__name__}")
        if not 0 <= t < vocab:
            raise BadRequest(f"{field}[{i}]", f"token id {t} is outside the vocab [0, {vocab})")
    return list(ids)


def check_prompt_len(prompt: list[int], field: str, model: ModelConfig) -> None:
    if len(prompt) >= model.max_positions:
        raise _too_long(len(prompt), field, model.max_positions)


def build_params(d: dict[str, Any], prompt_len: int, model: ModelConfig, *, max_key: str,
                 default_max: int, prefix: str = "", vocab: int | None = None) -> SamplingParams:
    """SamplingParams from SGLang or OpenAI fields in ``d`` (validated)."""
    room = model.max_positions - prompt_len
    max_new = _int(d, max_key, None, lo=1, hi=model.max_positions, prefix=prefix)
    if max_new is None:
        max_new = min(default_max, room)
    elif max_new > room:
        raise BadRequest(prefix + max_key,
                         f"{max_new} new tokens after a {prompt_len}-token prompt exceed the "
                         f"model's {model.max_positions} positions; ask for at most {room}")
    temperature = _float(d, "temperature", 1.0, prefix)
    if temperature < 0:
        raise BadRequest(prefix + "temperature", f"must be >= 0, got {temperature}")
    top_p = _float(d, "top_p", 1.0, prefix)
    if not 0 < top_p <= 1:
        raise BadRequest(prefix + "top_p", f"must be in (0, 1], got {top_p}")
    top_k = _int(d, "top_k", -1, lo=-1, prefix=prefix)
    stop_ids = d.get("stop_token_ids")
    if stop_ids is not None:
        stop_ids = check_ids(stop_ids, prefix + "stop_token_ids", vocab or model.vocab_size)
    return SamplingParams(
        max_new_tokens=max_new, temperature=temperature, top_p=top_p, top_k=top_k or -1,
        stop=_stop(d, "stop", prefix), stop_token_ids=stop_ids or [],
        ignore_eos=_bool(d, "ignore_eos", False, prefix),
        seed=_int(d, "seed", None, lo=0, hi=MAX_SEED, prefix=prefix))


# -- SGLang /generate -------------------------------------------------------------------------
def parse_generate(body: dict[str, Any], model: ModelConfig, tok: Tokenizer | None = None
                   ) -> tuple[list[GenInput], bool, bool]:
    """(inputs, is_batch, stream) of a ``/generate`` body."""
    tok = tok or default_tokenizer()
    vocab = id_bound(model, tok)
    stream = _bool(body, "stream", False)
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("text", "give exactly one of text or input_ids")
    if text is not None:
        batch = isinstance(text, list)
        prompts = [encode_text(t, f"text[{i}]" if batch else "text", tok,
                               max_positions=model.max_positions)
                   for i, t in enumerate(text if batch else [text])]
    else:
        batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = [check_ids(p, f"input_ids[{i}]" if batch else "input_ids", vocab,
                             model.max_positions)
                   for i, p in enumerate(ids if batch else [ids])]
    if batch and not prompts:
        raise BadRequest("text" if text is not None else "input_ids", "batch must not be empty")
    if batch and stream:
        raise BadRequest("stream", "streaming is supported for a single prompt only")
    sp = body.get("sampling_params", {})
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params", f"must be an object, got {type(sp).__name__}")
    check_n(sp, "sampling_params.")
    rid = body.get("rid")
    if batch:
        # ids given twice are a 409 (DuplicateRequest) where the engine claims them
        if rid is not None and not (isinstance(rid, list) and len(rid) == len(prompts)
                                    and all(isinstance(r, str) and r for r in rid)):
            raise BadRequest("rid", "for a batch, must be a list of distinct ids, one per prompt")
    elif rid is not None and not (isinstance(rid, str) and rid):
        raise BadRequest("rid", "must be a non-empty string")
    inputs = []
    for i, prompt in enumerate(prompts):
        field = "text" if text is not None else "input_ids"
        check_prompt_len(prompt, field, model)
        params = build_params(sp, len(prompt), model, max_key="max_new_tokens",
                              default_max=DEFAULT_MAX_NEW_TOKENS, prefix="sampling_params.",
                              vocab=vocab)
        inputs.append(GenInput(prompt, params, rid[i] if isinstance(rid, list) else rid))
    return inputs, batch, stream


# -- OpenAI -----------------------------------------------------------------------------------
# OpenAI fields this engine does not implement, with the values that mean "not used": any other
# value is refused rather than silently ignored (a client asking for logprobs must not get none)
UNSUPPORTED_OPENAI: dict[str, tuple[object, ...]] = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
    "best_of": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1), "logit_bias": (None, {}), "suffix": (None, ""),
    "tools": (None, []), "functions": (None, []), "response_format": (None, {"type": "text"}),
}


def check_n(d: dict[str, Any], prefix: str = "") -> None:
    """Refuse ``n`` > 1 (several samples of one prompt), which this engine does not produce:
    answering one sample where n were asked would look like success."""
    n = _int(d, "n", 1, lo=1, prefix=prefix)
    if n != 1:
        raise BadRequest(prefix + "n", f"only n = 1 is supported (got {n}); send {n} requests, "
                                       "or a batch of the prompt repeated, with their own seeds")


def _common_openai(body: dict[str, Any]) -> None:
    check_n(body)
    for key, defaults in UNSUPPORTED_OPENAI.items():
        v = body.get(key)
        # True == 1 in Python: a bool only matches a bool default (best_of: true is refused)
        if v is not None and not any(v == d and isinstance(v, bool) == isinstance(d, bool)
                                     for d in defaults):
            raise BadRequest(key, f"is not supported by this engine (got {json.dumps(v)[:80]}); "
                                  f"omit it or use {json.dumps(defaults[1])}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model", "must be a string")


def _max_key(body: dict[str, Any]) -> str:
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"


def parse_completion(body: dict[str, Any], model: ModelConfig, tok: Tokenizer | None = None
                     ) -> tuple[GenInput, bool]:
    """(input, stream) of an OpenAI ``/v1/completions`` body."""
    tok = tok or default_tokenizer()
    vocab = id_bound(model, tok)
    _common_openai(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) >= model.max_positions:
        raise _too_long(len(prompt), "prompt", model.max_positions)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in prompt):
        ids = check_ids(prompt, "prompt", vocab, model.max_positions)
    elif isinstance(prompt, list):
        if len(prompt) != 1:
            raise BadRequest("prompt", "exactly one prompt per request is supported")
        ids = encode_text(prompt[0], "prompt[0]", tok, max_positions=model.max_positions)
    else:
        ids = encode_text(prompt, "prompt", tok, max_positions=model.max_positions)
    check_prompt_len(ids, "prompt", model)
    params = build_params(body, len(ids), model, max_key=_max_key(body),
                          default_max=OPENAI_COMPLETION_DEFAULT_MAX_TOKENS, vocab=vocab)
    return GenInput(ids, params), _bool(body, "stream", False)


def encode_messages(body: dict[str, Any], tok: Tokenizer) -> list[int]:
    """The ids of a chat body's ``messages`` (its ``tools`` and ``chat_template_kwargs`` passed to
    the template, as SGLang and vLLM do); BadRequest naming the message, part or field the
    template or the tokenizer refused."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BadRequest("messages", "must be a list of {role, content} objects")
    try:
        tools, kwargs = request_template_args(body)
        return tok.encode_chat(messages, tools=tools, **kwargs)
    except ChatTemplateError as exc:
        raise BadRequest(exc.path, exc.reason) from None
    except (ValueError, TypeError) as exc:  # e.g. a lone surrogate the tokenizer cannot encode
        raise BadRequest("messages", f"cannot be tokenized: {exc}") from None


def parse_chat(body: dict[str, Any], model: ModelConfig, tok: Tokenizer | None = None
               ) -> tuple[GenInput, bool]:
    """(input, stream) of an OpenAI ``/v1/chat/completions`` body."""
    tok = tok or default_tokenizer()
    _common_openai(body)
    ids = encode_messages(body, tok)
    check_prompt_len(ids, "messages", model)
    params = build_params(body, len(ids), model, max_key=_max_key(body),
                          default_max=DEFAULT_MAX_NEW_TOKENS, vocab=id_bound(model, tok))
    return GenInput(ids, params), _bool(body, "stream", False)


def check_model(body: dict[str, Any], names: frozenset[str]) -> None:
    """Refuse an OpenAI body whose ``model`` this engine does not serve (``names``: its served
    name, its alias and config name); a request without one is served. The body was checked to
    be an object by the parser."""
    model = body.get("model")
    if isinstance(model, str) and names and model not in names:
        raise BadRequest("model", f"{model!r} is not served here; this engine serves "
                                  f"{sorted(names)}")


def include_usage(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise BadRequest("stream_options", "must be an object")
    return _bool(opts, "include_usage", False, "stream_options.")
