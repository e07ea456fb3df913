"""Bad input gets a JSON 4xx naming the problem, and nothing reaches a worker."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from error_shapes import error_message, error_object

CASES = [
    ("/generate", b"not json", 400, "JSON"),
    ("/generate", b"", 400, "empty"),
    ("/generate", b"{\"text\": \"a\", \"temperature\": NaN}", 400, "NaN"),
    ("/generate", b"{\"text\": \"a\"} trailing", 400, "JSON"),
    ("/generate", b"\xff\xfe{}", 400, "JSON"),
    ("/generate", b"[1, 2]", 400, "object"),
    ("/generate", b"{\"sampling_params\": {}}", 400, "text or input_ids"),
    ("/generate", b"{\"text\": 5}", 400, "text"),
    ("/generate", b"{\"text\": \"\"}", 400, "empty"),
    ("/generate", b"{\"text\": \"a\", \"input_ids\": [1]}", 400, "exactly one"),
    ("/generate", b"{\"input_ids\": [1, \"x\"]}", 400, "input_ids[1]"),
    ("/generate", b"{\"input_ids\": [-1]}", 400, "outside"),
    ("/generate", b"{\"input_ids\": [true]}", 400, "integer"),
    ("/generate", b"{\"text\": [\"a\", 3]}", 400, "text[1]"),
    ("/generate", b"{\"text\": \"a\", \"sampling_params\": [1]}", 400, "sampling_params"),
    ("/generate", b"{\"text\": \"a\", \"sampling_params\": {\"max_new_tokens\": -1}}", 400,
     ">= 0"),
    ("/generate", b"{\"text\": \"a\", \"sampling_params\": {\"max_new_tokens\": 1e12}}", 400,
     "absurd"),
    ("/generate", b"{\"text\": \"a\", \"sampling_params\": {\"max_new_tokens\": \"5\"}}", 400,
     "integer"),
    ("/generate", b"{\"text\": \"a\", \"stream\": \"yes\"}", 400, "stream"),
    ("/generate", b"{\"text\": [\"a\", \"b\"], \"stream\": true}", 400, "single prompt"),
    ("/generate", b"{\"text\": \"\\ud800\"}", 400, "UTF-8"),
    ("/v1/completions", b"{\"max_tokens\": 3}", 400, "prompt"),
    ("/v1/completions", b"{\"prompt\": {\"a\": 1}}", 400, "prompt"),
    ("/v1/completions", b"{\"prompt\": \"a\", \"max_tokens\": -5}", 400, "max_tokens"),
    ("/v1/completions", b"{\"prompt\": \"a\", \"max_tokens\": 99999999999}", 400, "absurd"),
    ("/v1/completions", b"{\"prompt\": \"a\", \"model\": 7}", 400, "model"),
    ("/v1/completions", b"{\"prompt\": \"a\", \"n\": 0}", 400, "n"),
    # One bootstrap room per prompt: PD serves one sample each.
    ("/v1/completions", b"{\"prompt\": \"a\", \"n\": 2}", 400, "n: must be 1 (got 2)"),
    ("/v1/chat/completions", b"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
     b"\"n\": 3}", 400, "n: must be 1 (got 3)"),
    ("/generate", b"{\"text\": \"a\", \"sampling_params\": {\"n\": 4}}", 400,
     "sampling_params.n: must be 1 (got 4)"),
    ("/generate", b"{\"text\": \"a\", \"sampling_params\": {\"n\": \"2\"}}", 400,
     "sampling_params.n"),
    ("/v1/chat/completions", b"{\"messages\": \"hi\"}", 400, "messages"),
    ("/v1/chat/completions", b"{}", 400, "messages"),
    ("/v1/chat/completions", b"{\"messages\": [5]}", 400, "messages[0]"),
    ("/v1/chat/completions", b"{\"messages\": [{\"content\": \"x\"}]}", 400, "role"),
    ("/v1/chat/completions",
     b"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"max_completion_tokens\": -1}",
     400, "max_completion_tokens"),
    ("/debug/route", b"nope", 400, "JSON"),
    # Nesting: past orjson's depth (the standard parser's RecursionError), with a long int
    # (the standard parser at once), and within orjson's depth but deep enough for json.dumps
    # (a body carrying bootstrap fields is re-serialized) to recurse past Python's limit.
    ("/generate", b'{"text": "a", "x": ' + b"[" * 1500 + b"]" * 1500 + b"}", 400, "nested"),
    ("/generate", b'{"text": "a", "n": 12345678901234567890123, "x": ' + b"[" * 1500
     + b"]" * 1500 + b"}", 400, "nested"),
    ("/generate", b'{"text": "a", "bootstrap_room": 1, "x": ' + b"[" * 1000 + b"]" * 1000
     + b"}", 400, "nested"),
    ("/debug/route", b'{"text": "a", "x": ' + b"[" * 1500 + b"]" * 1500 + b"}", 400, "nested"),
]


@pytest.fixture
async def setup(stubs: Any, make_router: Any) -> Any:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d], model="tiny", max_body=4096, max_tokens=1_000_000)
    return client, p, d


@pytest.mark.parametrize(("path", "raw", "status", "needle"), CASES)
async def test_bad_body(setup: Any, path: str, raw: bytes, status: int, needle: str) -> None:
    client, p, d = setup
    resp = await client.post(path, data=raw, headers={"content-type": "application/json"})
    assert resp.status == status
    body = await resp.json()
    assert needle in error_message(path, body), body
    assert not p.bodies and not d.bodies


NOT_UTF8 = "body: is not UTF-8; send JSON encoded as UTF-8 (RFC 8259)"
"""The workers' answer too, word for word."""


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32",
                                      "utf-32-le", "utf-32-be", "latin-1"])
@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/debug/route"])
async def test_body_not_in_utf8_is_refused_as_the_workers_do(setup: Any, path: str,
                                                               encoding: str) -> None:
    client, p, d = setup
    raw = json.dumps({"text": "caf\u00e9", "prompt": "caf\u00e9"},
                     ensure_ascii=False).encode(encoding)
    resp = await client.post(path, data=raw, headers={"content-type": "application/json"})
    assert resp.status == 400
    assert error_message(path, await resp.json()) == NOT_UTF8
    assert not p.bodies and not d.bodies


async def test_deep_admin_body_is_400(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d], admin_token="s3cret-admin-token")
    auth = {"authorization": "Bearer s3cret-admin-token"}
    deep = b'{"url": "http://127.0.0.1:1", "x": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    for method in ("POST", "DELETE"):
        resp = await client.request(method, "/workers", data=deep, headers=auth)
        assert resp.status == 400 and "nested" in (await resp.json())["error"]


async def test_body_over_limit_is_413(setup: Any) -> None:
    client, p, d = setup
    resp = await client.post("/generate", data=b'{"text": "' + b"a" * 5000 + b'"}')
    assert resp.status == 413
    assert "4096" in (await resp.json())["error"]
    # Chunked, without a content-length: still caught.
    async def gen() -> Any:
        for _ in range(10):
            yield b"a" * 1000
    resp = await client.post("/generate", data=gen())
    assert resp.status == 413 and "limit" in (await resp.json())["error"]
    assert not p.bodies and not d.bodies
    assert (await client.post("/generate", json={"text": "ok"})).status == 200
    # Refused before any handler ran, and still counted.
    metrics = await (await client.get("/metrics")).text()
    assert 'kvatlas_router_requests_total{route="rejected",status="413"} 2.0' in metrics


async def test_a_request_trickled_past_the_read_timeout_is_408(stubs: Any,
                                                               make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d], model="tiny", client_read_timeout=0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", client.app.port)
    writer.write(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: 2000\r\n\r\n{")
    head = b""
    for _ in range(100):  # a byte every 50 ms, for up to 5 s: never idle, never complete
        try:
            head = await asyncio.wait_for(reader.read(1024), 0.05)
            break
        except TimeoutError:
            writer.write(b" ")
    assert head.startswith(b"HTTP/1.1 408 "), head
    assert b"not received within 0.3 s" in head
    writer.close()
    assert not p.bodies and not d.bodies
    metrics = await (await client.get("/metrics")).text()
    assert 'kvatlas_router_requests_total{route="rejected",status="408"} 1.0' in metrics


async def test_unknown_model_is_404(setup: Any) -> None:
    client, p, d = setup
    resp = await client.post("/v1/completions", json={"prompt": "a", "model": "other"})
    assert resp.status == 404
    err = error_object("/v1/completions", await resp.json())
    assert "other" in err["message"] and err["param"] == "model", err
    assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error", err
    assert not p.bodies and not d.bodies


async def test_unknown_path_and_method_are_json(setup: Any) -> None:
    client, _, _ = setup
    resp = await client.get("/nope")
    assert resp.status == 404 and "error" in await resp.json()
    resp = await client.get("/generate")
    assert resp.status == 405 and "error" in await resp.json()
    # The router is still fine afterwards.
    assert (await client.post("/generate", json={"text": "ok"})).status == 200


async def test_one_sample_is_routed(setup: Any) -> None:
    client, p, d = setup
    for path, body in (("/generate", {"text": "a", "sampling_params": {"n": 1}}),
                       ("/v1/completions", {"prompt": "a", "n": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                 "n": 1})):
        assert (await client.post(path, json=body)).status == 200, path
    assert len(d.bodies) == 3
