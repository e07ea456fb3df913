"""The router's exception tree, rooted at ``RouterError``, and its error answers.

Every error carries the HTTP ``status`` it is answered with, the request field at fault
(``param``, when known), a short ``code`` and ``extra`` fields for the JSON body, so the router
maps them to answers in one place (``error_response``) instead of one ``except`` per class.
Messages say what to change.

An answer takes its route's shape at one boundary (``shaped``, called by ``RouterApp.handle``):
SGLang routes (``/generate``, the admin API...) answer ``{"error": "<message>", **extra}``;
OpenAI routes (``/v1/...``) OpenAI's error object ``{"error": {"message", "type", "param",
"code", **extra}}``, so that the ``openai`` SDK's exception carries the message. (The engines'
aiohttp servers answer the same two shapes: ``bootstrap.http_errors``, which the router's
layering keeps it from importing.)

``UpstreamError`` (``router.http.client``) is part of the tree too: the dispatcher and the
health checker catch it and turn it into a retry or a 502/503 of their own.
"""
from __future__ import annotations

import json
from typing import Any

from router.http.messages import Response, Stream

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


class ErrorAnswer(Response):
    """An error answer that remembers what it says, so that the boundary (``shaped``) can give
    it its route's shape. Its own body is the SGLang shape."""

    __slots__ = ("message", "param", "code", "extra")

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, *,
                 param: str | None = None, code: str | int | None = None,
                 **extra: Any) -> None:
        super().__init__(status, json.dumps(error_body(status, message, openai=False,
                                                       **extra)).encode(),
                         "application/json", headers)
        self.message = message
        self.param = param
        self.code = code
        self.extra = extra

    def for_openai(self) -> Response:
        body = error_body(self.status, self.message, openai=True, param=self.param,
                          code=self.code, **self.extra)
        return Response(self.status, json.dumps(body).encode(), "application/json",
                        self.headers)


def json_error(status: int, message: str, request_id: str | None = None,
               headers: dict[str, str] | None = None, *, param: str | None = None,
               code: str | int | None = None, **extra: Any) -> ErrorAnswer:
    """An error answer: ``status`` with ``message`` (and ``extra`` fields beside it);
    ``headers``: more headers besides the request id."""
    if request_id:
        headers = {**headers, "x-request-id": request_id} if headers else {
            "x-request-id": request_id}
    return ErrorAnswer(status, message, headers, param=param, code=code, **extra)


def error_response(exc: RouterError, request_id: str | None = None) -> ErrorAnswer:
    """The one mapping of the router's errors to HTTP answers: ``exc.status`` with its
    message, ``param``, ``code`` and ``extra`` fields. ``RouterApp.handle`` answers every
    RouterError a handler raises with it; ``_proxy`` calls it itself to add the request id."""
    return json_error(exc.status, str(exc), request_id, exc.headers, param=exc.param,
                      code=exc.code, **exc.extra)


def shaped(path: str, answer: Response | Stream) -> Response | Stream:
    """``answer`` in the shape of ``path``'s route: an ``ErrorAnswer`` on an OpenAI route
    becomes OpenAI's error object; anything else (a worker's own answer) is left as it is."""
    if isinstance(answer, ErrorAnswer) and openai_route(path):
        return answer.for_openai()
    return answer


class RouterError(Exception):
    """Root of the router's errors: answered ``status`` with ``str(exc)`` (``error_response``)."""

    status: int = 500
    code: str | None = None
    """A short slug for OpenAI's ``code`` (None: the HTTP status)."""

    @property
    def param(self) -> str | None:
        """The request field at fault (OpenAI's ``param``), when known."""
        return None

    @property
    def extra(self) -> dict[str, Any]:
        """Fields of the JSON answer besides ``error``."""
        return {}

    @property
    def headers(self) -> dict[str, str] | None:
        """Headers of the answer besides the request id (None: none)."""
        return None


class BadRequest(RouterError):
    """A client error: HTTP ``status`` (400; 413 for a body over the limit) naming ``field``
    (``field`` "": a ``reason`` that names what it concerns itself, ``param`` if one field)."""

    def __init__(self, field: str, reason: str, status: int = 400,
                 param: str | None = None) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field = field
        self.reason = reason
        self.status = status
        self._param = param or field or None

    @property
    def param(self) -> str | None:
        return self._param


class UnknownModel(RouterError):
    """The request names a model no worker serves (404)."""

    status = 404
    code = "model_not_found"

    @property
    def param(self) -> str | None:
        return "model"


class NoWorkers(RouterError):
    """Nothing of ``role`` can be selected; ``reason`` says why (503)."""

    status = 503

    def __init__(self, role: str, reason: str) -> None:
        super().__init__(f"No available servers: {reason}")
        self.role = role
        self.reason = reason

    @property
    def extra(self) -> dict[str, Any]:
        return {"role": self.role}


class Overloaded(RouterError):
    """No slot for this request: ``status`` is 429 (queue full) or 408 (waited too long);
    ``retry_after``: seconds the client should wait before it retries (``Retry-After``)."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after

    @property
    def extra(self) -> dict[str, Any]:
        return {} if self.retry_after is None else {"retry_after_s": self.retry_after}

    @property
    def headers(self) -> dict[str, str] | None:
        return None if self.retry_after is None else {"retry-after": str(self.retry_after)}


class DiscoveredWorker(RouterError):
    """An admin call (``POST``/``DELETE /workers``) on a worker an etcd instance record
    describes (409): while the record lives, the worker's presence and URL are the record's."""

    status = 409

    def __init__(self, instance_id: str, role: str, url: str, key: str, action: str) -> None:
        super().__init__(
            f"{action}: {role} worker {instance_id} ({url}) is described by the etcd record "
            f"{key}, and while that record lives the worker and its URL are the record's. To "
            f"take it out of service drain its engine or stop its sidecar (the record goes "
            f"with its lease); to serve at another URL, have the instance publish it.")
        self.instance_id = instance_id
        self.role = role
        self.url = url
        self.key = key

    @property
    def extra(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "role": self.role, "record": self.key}
