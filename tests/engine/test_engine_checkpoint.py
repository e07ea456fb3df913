"""An engine serving a checkpoint directory (``--model-path``: a tiny Llama with the Qwen3
tokenizer and a template that refuses roles out of order, see ``real_model_helpers``): it names
the checkpoint's model and tokenizer, tokenizes text and chat by the rules of ``tokenization``,
and refuses what it cannot serve with a 400 saying why."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from error_shapes import error_message
from real_model_helpers import tiny_llama_checkpoint

from engine.serve_config import EngineServerConfig
from engine.server import create_app
from tokenization import load_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", max_positions=64)


async def _client(aiohttp_client: Any, checkpoint: Path) -> Any:
    return await aiohttp_client(create_app(EngineServerConfig(model_path=str(checkpoint),
                                                              num_pages=64)))


async def test_serves_the_checkpoint_with_its_tokenizer(aiohttp_client: Any,
                                                        checkpoint: Path) -> None:
    c = await _client(aiohttp_client, checkpoint)
    info = await (await c.get("/model_info")).json()
    assert info["served_model_name"] == "test/tiny-llama"
    assert info["architectures"] == ["LlamaForCausalLM"]
    tok = load_tokenizer(str(checkpoint))
    assert info["tokenizer"]["fingerprint"] == tok.fingerprint
    assert info["max_prompt_tokens"] == 63
    msgs = [{"role": "user", "content": "Grüße"}]
    r = await c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3,
                                                   "temperature": 0,
                                                   "chat_template_kwargs":
                                                       {"enable_thinking": False}})
    body = await r.json()
    assert r.status == 200, body
    assert body["model"] == "test/tiny-llama"
    assert body["usage"]["prompt_tokens"] == len(tok.encode_chat(msgs, enable_thinking=False))
    assert len(tok.encode_chat(msgs, enable_thinking=False)) > len(tok.encode_chat(msgs))
    r = await c.post("/generate", json={"text": "hello world", "sampling_params":
                                        {"max_new_tokens": 2, "temperature": 0}})
    assert (await r.json())["meta_info"]["prompt_tokens"] == len(tok.encode("hello world"))


@pytest.mark.parametrize("body, field, needle", [
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
     "messages", "roles must alternate"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "see"},
                                                {"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content[1]", "input_audio"),
    ({"messages": [{"role": "user", "content": "word " * 80}]}, "messages", "at most 63"),
    ({"prompt": "word " * 80}, "prompt", "at most 63"),
])
async def test_what_it_cannot_serve_is_a_400(aiohttp_client: Any, checkpoint: Path,
                                             body: dict[str, Any], field: str,
                                             needle: str) -> None:
    c = await _client(aiohttp_client, checkpoint)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = await c.post(path, json={**body, "max_tokens": 2})
    assert r.status == 400, await r.text()
    err = error_message(path, await r.json())
    assert err.startswith(field + ":") and needle in err, err
    state = await (await c.get("/server_info")).json()
    assert state["internal_states"][0]["kv_pages_used"] == 0
