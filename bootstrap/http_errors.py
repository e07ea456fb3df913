"""Error answers of kvatlas's aiohttp servers (the bootstrap server and the engine's worker
port; ``engine/`` imports this, the router has its own HTTP layer with the same two shapes).

Two shapes, picked by route at each app's one error boundary (its middleware):

- SGLang routes (``/generate``, ``/flush_cache``, the bootstrap API...): ``{"error": "<message>",
  **extra}``, as SGLang answers them.
- OpenAI routes (``/v1/...``): OpenAI's error object ``{"error": {"message", "type", "param",
  "code", **extra}}``, so that the ``openai`` SDK's exception carries the message.

A handler builds either with :func:`json_error` (an :class:`ErrorAnswer`, SGLang-shaped until
the boundary reshapes it) or raises its package's typed error, which the boundary maps.
"""
from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from bootstrap.errors import BootstrapLayerError

OPENAI_PREFIX = "/v1/"


def openai_route(path: str) -> bool:
    """Whether ``path`` is an OpenAI-compatible route, answered with OpenAI's error object."""
    return path.startswith(OPENAI_PREFIX)


def openai_type(status: int) -> str:
    """OpenAI's ``type`` of an error answered with ``status``."""
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    if status == 503:
        return "service_unavailable"
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(status: int, message: str, *, openai: bool, param: str | None = None,
               code: str | int | None = None, **extra: Any) -> dict[str, Any]:
    """The JSON of an error answer: OpenAI's error object (``openai``), with ``extra`` beside
    the message, or SGLang's ``{"error": message, **extra}``. ``param`` names the request field
    at fault when known; ``code`` is a short slug (default: the HTTP status)."""
    if not openai:
        return {"error": message, **extra}
    return {"error": {"message": message, "type": openai_type(status), "param": param,
                      "code": status if code is None else code, **extra}}


class ErrorAnswer(web.Response):
    """An error answer that remembers what it says, so the app's boundary can give it the
    shape of its route (:func:`shaped`). Its own body is the SGLang shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None,
                 **extra: Any) -> None:
        self.message = message
        self.param = param
        self.code = code
        self.extra = extra
        super().__init__(text=json.dumps(error_body(status, message, openai=False, **extra)),
                         status=status, content_type="application/json", headers=headers)

    def for_openai(self) -> web.Response:
        return web.json_response(error_body(self.status, self.message, openai=True,
                                            param=self.param, code=self.code, **self.extra),
                                 status=self.status, headers=_kept_headers(self))


def _kept_headers(resp: web.StreamResponse) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items()
            if k.lower() not in ("content-type", "content-length")}


def json_error(status: int, message: str, *, param: str | None = None,
               code: str | int | None = None, **extra: Any) -> ErrorAnswer:
    """An error answer: ``status`` with ``message`` (and ``extra`` fields beside it)."""
    return ErrorAnswer(status, message, param=param, code=code, **extra)


class Refusal(web.HTTPException, BootstrapLayerError):
    """An HTTP error raised from inside a read (``body_deadline``, an over-long body) that must
    travel as an exception (aiohttp closes the connection with it) yet answer in the route's
    shape: it carries its ``message`` and a ``status_code`` of its own."""

    def __init__(self, status: int, message: str, *, close: bool = False) -> None:
        self.status_code = status
        self.message = message
        super().__init__(text=json.dumps({"error": message}), content_type="application/json")
        if close:
            self.force_close()


def shaped(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
    """``resp`` in the shape of ``request``'s route: an :class:`ErrorAnswer` or a
    :class:`Refusal` on an OpenAI route becomes OpenAI's error object; anything else is left
    as it is."""
    if not openai_route(request.path):
        return resp
    if isinstance(resp, ErrorAnswer):
        return resp.for_openai()
    if isinstance(resp, Refusal):
        resp.text = json.dumps(error_body(resp.status, resp.message, openai=True))
    return resp
