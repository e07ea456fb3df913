"""The router's OpenAI routes answer its own errors with OpenAI's error object, so that the
real ``openai`` SDK's exception carries the message, the field at fault and the type (with the
router's extra fields beside the message); its SGLang routes keep ``{"error": "<message>"}``.
The SDK speaks real HTTP to the router's own server, with stub workers behind it."""
from __future__ import annotations

from typing import Any

import openai
import pytest
from error_shapes import error_message, error_object

pytestmark = pytest.mark.timeout(60)


def _sdk(client: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=client.url + "/v1", api_key="unused", max_retries=0)


async def test_the_sdk_shows_the_routers_message_param_and_code(stubs: Any,
                                                                make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d], model="tiny")
    async with _sdk(client) as sdk:
        with pytest.raises(openai.NotFoundError) as unknown:
            await sdk.chat.completions.create(
                model="gpt-nope", messages=[{"role": "user", "content": "hi"}])
        assert "'gpt-nope' is not served here" in unknown.value.message, unknown.value.message
        assert unknown.value.code == "model_not_found" and unknown.value.param == "model"
        assert unknown.value.type == "invalid_request_error"
        with pytest.raises(openai.BadRequestError) as bad:
            await sdk.completions.create(model="tiny", prompt="a", max_tokens=-5)
        assert "max_tokens: must be >= 0" in bad.value.message, bad.value.message
        assert bad.value.param == "max_tokens" and bad.value.code == "400"
        assert isinstance(bad.value.body, dict) and bad.value.body["message"].startswith(
            "max_tokens:")
        assert [m.id for m in (await sdk.models.list()).data] == ["tiny"]
    assert not p.bodies and not d.bodies
    # The same mistake on the SGLang route keeps its shape.
    resp = await client.post("/generate", json={"text": "a", "model": "gpt-nope"})
    assert resp.status == 404 and "gpt-nope" in error_message("/generate", await resp.json())


async def test_extra_fields_sit_beside_the_message(stubs: Any, make_router: Any) -> None:
    (p,) = await stubs("prefill")
    client = await make_router([p], [])
    async with _sdk(client) as sdk:
        with pytest.raises(openai.InternalServerError) as none:
            await sdk.completions.create(model="tiny", prompt="a", max_tokens=2)
    assert none.value.status_code == 503 and "no decode workers" in none.value.message
    assert none.value.type == "service_unavailable"
    assert isinstance(none.value.body, dict) and none.value.body["role"] == "decode"
    # SGLang's shape: the same fields, the message a string.
    resp = await client.post("/generate", json={"text": "x"})
    body = await resp.json()
    assert resp.status == 503 and "no decode workers" in error_message("/generate", body)
    assert body["role"] == "decode"
    assert not p.bodies


async def test_an_upstream_the_router_cannot_reach_is_a_502_with_a_message(
        stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d], model="tiny", retry_max_attempts=1)
    await d.stop()  # its port now refuses connections: the router's own 502
    async with _sdk(client) as sdk:
        with pytest.raises(openai.APIStatusError) as down:
            await sdk.completions.create(model="tiny", prompt="a", max_tokens=2)
    assert down.value.status_code == 502, down.value.body
    assert f"{d.url}: cannot connect" in down.value.message, down.value.message
    assert down.value.type == "server_error"
    resp = await client.post("/generate", json={"text": "x"})
    assert resp.status == 502 and "failed" in error_message("/generate", await resp.json())


async def test_the_routers_own_answers_take_the_routes_shape(stubs: Any,
                                                             make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d], model="tiny")
    resp = await client.get("/v1/nope")
    err = error_object("/v1/nope", await resp.json())
    assert resp.status == 404 and err["code"] == 404 and "/v1/nope" in err["message"]
    resp = await client.get("/v1/completions")
    assert resp.status == 405
    assert "not allowed" in error_object("/v1/completions", await resp.json())["message"]
    resp = await client.get("/nope")
    assert resp.status == 404 and "/nope" in error_message("/nope", await resp.json())


async def test_a_body_over_the_limit_is_refused_in_the_routes_shape(stubs: Any,
                                                                   make_router: Any) -> None:
    """Refused by the HTTP layer before any handler ran (its head named the route)."""
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d], model="tiny", max_body=4096)
    async with _sdk(client) as sdk:
        with pytest.raises(openai.APIStatusError) as big:
            await sdk.completions.create(model="tiny", prompt="a" * 5000, max_tokens=2)
    assert big.value.status_code == 413 and "the limit is 4096 bytes" in big.value.message
    assert big.value.type == "invalid_request_error"
    resp = await client.post("/generate", data=b'{"text": "' + b"a" * 5000 + b'"}')
    assert resp.status == 413 and "4096" in error_message("/generate", await resp.json())
    assert not p.bodies and not d.bodies
