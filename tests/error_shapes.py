"""Reading an error answer in the shape of its route: OpenAI's error object on ``/v1/``
routes (``{"error": {"message", "type", "param", "code", ...}}``), SGLang's ``{"error":
"<message>", ...}`` elsewhere. Both the router and the engines answer these two shapes."""
from __future__ import annotations

from typing import Any

OPENAI_FIELDS = {"message", "type", "param", "code"}


def error_object(path: str, body: Any) -> dict[str, Any]:
    """The fields of an error answer to ``path``: OpenAI's error object on an OpenAI route
    (asserted to have its four fields), SGLang's body (``error`` a string) elsewhere."""
    assert isinstance(body, dict) and "error" in body, body
    if path.startswith("/v1/"):
        err = body["error"]
        assert isinstance(err, dict) and OPENAI_FIELDS <= set(err), body
        assert isinstance(err["message"], str) and err["message"], body
        return err
    assert isinstance(body["error"], str), body
    return body


def error_message(path: str, body: Any) -> str:
    """The message of an error answer to ``path``, whichever shape its route answers."""
    err = error_object(path, body)
    return str(err["message"] if path.startswith("/v1/") else err["error"])
