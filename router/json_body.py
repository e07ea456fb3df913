"""Reading a request body as JSON, strictly: the router never forwards a body a worker would
refuse (not UTF-8, NaN/Infinity, nesting past ``MAX_DEPTH``, not an object), and says why."""
from __future__ import annotations

import json
from typing import Any

import orjson

from router.errors import BadRequest


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Bytes -> b"0" for a digit, b"[" for an opening bracket, b"x" otherwise, so that one pass
# serves both checks: a run of 19 digits may be an integer orjson turns into a float (it keeps
# ints within [-2^63, 2^64-1] exact; any 18-digit one fits), and brackets bound the depth.
_CLASSES = bytes(0x30 if 0x30 <= i <= 0x39 else 0x5B if i in b"[{" else 0x78
                 for i in range(256))
_LONG_INT = b"0" * 19


MAX_DEPTH = 256
"""Deepest nesting of arrays and objects a body may have. Why a bound: the standard parser and
``json.dumps`` (which re-serializes a body that already carries bootstrap fields) recurse per
level, and Python's recursion limit (1000) would turn a deep body into a 500."""

NOT_UTF8 = "is not UTF-8; send JSON encoded as UTF-8 (RFC 8259)"
"""The reason given for a body in another encoding, word for word the engine's too: a client
gets the same answer from the router and from a worker."""
_WIDE_BOMS = (b"\x00\x00\xfe\xff", b"\xff\xfe", b"\xfe\xff")  # UTF-32-BE, UTF-16/32-LE, UTF-16-BE


def load_json(raw: bytes) -> dict[str, Any]:
    """The JSON object in ``raw``; BadRequest for anything else (empty, not UTF-8, not JSON,
    NaN/Infinity, nested deeper than MAX_DEPTH, not an object)."""
    return load_json_fast(raw)[0]


def load_json_fast(raw: bytes) -> tuple[dict[str, Any], bool]:
    """``load_json``, and whether orjson parsed it: then orjson writes it back as it was
    (there is no int over 64 bits, no float a huge literal made infinite, no lone surrogate)."""
    if not raw:
        raise BadRequest("body", "is empty; send a JSON object")
    body: Any = None
    classes = raw.translate(_CLASSES)
    if _LONG_INT not in classes:
        # orjson is strict (refuses NaN/Infinity, invalid UTF-8, NUL bytes, depth over 1024)
        # and several times faster: what it parses needs no further encoding check.
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # the standard parser decides, with its messages
    fast = body is not None
    if not fast:
        body = _load_slow(raw)
    if not isinstance(body, dict):
        raise BadRequest("body", f"must be a JSON object, got {type(body).__name__}")
    # Depth n needs n opening brackets: a cheap count spares the walk for nearly every body.
    if len(raw) > 2 * MAX_DEPTH and classes.count(b"[") > MAX_DEPTH:
        _check_depth(body)
    return body, fast


def _load_slow(raw: bytes) -> Any:
    # json.loads(bytes) would guess UTF-16/32 and take them; workers refuse them, so the
    # router does too. UTF-16/32 text of ASCII is valid UTF-8 with NULs: hence the NUL check.
    if b"\x00" in raw[:4] or raw.startswith(_WIDE_BOMS):
        raise BadRequest("body", NOT_UTF8)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("body", NOT_UTF8) from None
    try:
        # NaN/Infinity are Python extensions a strict worker would refuse: never forward.
        return json.loads(text, parse_constant=_no_constants)
    except ValueError as exc:
        raise BadRequest("body", f"not valid JSON ({exc})") from None
    except RecursionError:
        raise BadRequest("body", f"JSON nested deeper than {MAX_DEPTH} levels") from None


def _check_depth(body: Any) -> None:
    """BadRequest when ``body`` nests deeper than MAX_DEPTH (iterative: no recursion)."""
    level = [body]
    for _ in range(MAX_DEPTH):
        level = [v for c in level for v in (c.values() if isinstance(c, dict) else c)
                 if isinstance(v, (dict, list))]
        if not level:
            return
    raise BadRequest("body", f"JSON nested deeper than {MAX_DEPTH} levels")
