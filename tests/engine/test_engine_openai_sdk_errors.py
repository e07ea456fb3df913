"""The engine's OpenAI routes answer errors with OpenAI's error object, so that the real
``openai`` SDK's exception carries the message, the field at fault and the type; its SGLang
routes keep ``{"error": "<message>"}``. Spoken to over loopback HTTP by the SDK itself."""
from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from error_shapes import error_message, error_object

from engine.serve_config import EngineServerConfig
from engine.server import create_app

pytestmark = pytest.mark.timeout(60)


async def _engine(aiohttp_client: Any, **kw: Any) -> tuple[Any, openai.AsyncOpenAI]:
    c = await aiohttp_client(create_app(EngineServerConfig(**kw)))
    sdk = openai.AsyncOpenAI(base_url=str(c.make_url("/v1")), api_key="unused", max_retries=0)
    return c, sdk


async def test_the_sdk_shows_the_engines_message_param_and_type(aiohttp_client: Any) -> None:
    c, sdk = await _engine(aiohttp_client)
    async with sdk:
        model = (await sdk.models.list()).data[0].id
        with pytest.raises(openai.BadRequestError) as bad:
            await sdk.completions.create(model=model, prompt="hi", max_tokens=-1)
        assert "max_tokens: must be >= 1, got -1" in bad.value.message, bad.value.message
        assert bad.value.param == "max_tokens" and bad.value.type == "invalid_request_error"
        assert isinstance(bad.value.body, dict) and bad.value.body["code"] == 400
        with pytest.raises(openai.BadRequestError) as other:
            await sdk.chat.completions.create(
                model="not-this-one", messages=[{"role": "user", "content": "hi"}])
        assert "'not-this-one' is not served here" in other.value.message, other.value.message
        assert other.value.param == "model"


async def test_a_request_that_never_fits_is_a_503_the_sdk_reads(aiohttp_client: Any) -> None:
    c, sdk = await _engine(aiohttp_client, num_pages=8, max_batch_tokens=32)
    async with sdk:
        model = (await sdk.models.list()).data[0].id
        with pytest.raises(openai.InternalServerError) as full:
            await sdk.completions.create(model=model, prompt="x" * 40, max_tokens=200)
    assert full.value.status_code == 503 and "KV pages" in full.value.message
    assert full.value.type == "service_unavailable" and full.value.param is None
    # The same refusal on the SGLang route keeps its shape: the message as a string.
    r = await c.post("/generate", json={"text": "x" * 40, "sampling_params": {
        "max_new_tokens": 200}})
    assert r.status == 503 and "KV pages" in error_message("/generate", await r.json())


async def test_refusals_before_a_handler_take_the_routes_shape(aiohttp_client: Any) -> None:
    c, _ = await _engine(aiohttp_client, max_request_bytes=1 << 16)
    big = json.dumps({"prompt": "z" * (1 << 17)}).encode()
    for path in ("/v1/completions", "/generate"):
        r = await c.post(path, data=big, headers={"Content-Type": "application/json"})
        assert r.status == 413
        assert "--max-request-bytes" in error_message(path, await r.json())
    r = await c.get("/v1/nope")
    err = error_object("/v1/nope", await r.json())
    assert r.status == 404 and err["type"] == "invalid_request_error" and err["code"] == 404
    r = await c.get("/v1/completions")
    assert r.status == 405 and error_object("/v1/completions", await r.json())["code"] == 405
    r = await c.get("/nope")
    assert r.status == 404 and error_message("/nope", await r.json()) == "Not Found"
