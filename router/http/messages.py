"""The messages of the router's HTTP server (router/http/server.py): a parsed request, a
complete answer, a streamed answer's body, and the response head they go out with."""
from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any, Protocol
from urllib.parse import parse_qsl


class Connection(Protocol):
    """What a request and a stream use of their connection (``router.http.server.HttpProtocol``);
    a protocol, so that this module does not import the server that imports it."""

    streaming: bool

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def close(self) -> None: ...


_STATUS_LINES = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in HTTPStatus}


def response_head(status: int, content_type: str | None, length: int | None,
                  headers: dict[str, str] | None, close: bool, chunked: bool = True) -> bytes:
    """A response head; ``length`` None means a streamed body: chunked, or (HTTP/1.0 client)
    delimited by closing the connection."""
    line = _STATUS_LINES.get(status)
    parts = [line if line is not None else b"HTTP/1.1 %d Unknown\r\n" % status]
    if content_type is not None:
        parts.append(b"content-type: %s\r\n" % content_type.encode("latin-1"))
    if length is None:
        if chunked:
            parts.append(b"transfer-encoding: chunked\r\n")
    else:
        parts.append(b"content-length: %d\r\n" % length)
    if headers:
        for name, value in headers.items():
            parts.append(b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1")))
    if close:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


class Request:
    """One parsed request; ``headers`` has lower-case names (the last of duplicates wins)."""

    __slots__ = ("method", "path", "query_string", "headers", "body", "keep_alive", "http10",
                 "_conn", "_query", "size")

    def __init__(self, method: str, path: str, query_string: str, headers: dict[str, str],
                 body: bytes, keep_alive: bool, conn: Connection,
                 http10: bool = False) -> None:
        self.http10 = http10
        self.method = method
        self.path = path
        self.query_string = query_string
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self._conn = conn
        self._query: dict[str, str] | None = None
        self.size = len(body)
        """Bytes it holds (its body; its headers too once queued by the server)."""

    @property
    def query(self) -> dict[str, str]:
        if self._query is None:
            self._query = dict(parse_qsl(self.query_string, keep_blank_values=True))
        return self._query

    def abort(self) -> None:
        """Drop the connection without finishing the answer (a broken upstream stream must
        not look complete to the client)."""
        self._conn.close()

    async def stream(self, status: int, content_type: str,
                     headers: dict[str, str] | None = None) -> Stream:
        """Send the head of a streamed answer now; the handler writes the body and returns it.
        Chunked for HTTP/1.1; an HTTP/1.0 client knows no chunks, so its body ends with the
        connection."""
        chunked = not self.http10
        if not chunked:
            self.keep_alive = False
        stream = Stream(self._conn, chunked)
        self._conn.streaming = True
        self._conn.write(response_head(status, content_type, None, headers, not chunked, chunked))
        return stream


class Response:
    """A complete answer."""

    __slots__ = ("status", "body", "content_type", "headers")

    def __init__(self, status: int = 200, body: bytes = b"",
                 content_type: str = "application/json",
                 headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers


def json_response(data: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> Response:
    return Response(status, json.dumps(data).encode(), "application/json", headers)


class Stream:
    """The body of a streamed answer. ``write`` waits while the client is not reading, and
    raises ``ConnectionResetError`` once the client has gone away."""

    __slots__ = ("_conn", "ended", "chunked")

    def __init__(self, conn: Connection, chunked: bool = True) -> None:
        self._conn = conn
        self.ended = False
        self.chunked = chunked

    async def write(self, data: bytes) -> None:
        if not data:
            return
        conn = self._conn
        conn.write(b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data)
        await conn.drain()

    async def end(self) -> None:
        if not self.ended:
            self.ended = True
            if self.chunked:
                self._conn.write(b"0\r\n\r\n")
            await self._conn.drain()
