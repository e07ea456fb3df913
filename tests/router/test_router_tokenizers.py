"""The router tokenizes text and chat with the model's real tokenizer (here Qwen3's, and a
template that refuses roles out of order), so its ids are the engines' ids; what it cannot
tokenize is refused with a 400 before any worker sees it, or, for a model it has no tokenizer
for, routed on load alone, loudly."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from error_shapes import error_message

from tokenization import load_tokenizer
from tokenization.assets import qwen3_tokenizer_dir

ALTERNATING = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def strict_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("strict-tokenizer")
    (d / "tokenizer.json").write_bytes((qwen3_tokenizer_dir() / "tokenizer.json").read_bytes())
    (d / "chat_template.jinja").write_text(ALTERNATING)
    return d


async def _routed(prefills: list[Any], decodes: list[Any]) -> int:
    return sum(len(w.bodies) for w in [*prefills, *decodes])


async def test_debug_route_shows_real_token_ids(stubs: Any, make_router: Any) -> None:
    prefills, decodes = await stubs("prefill", 2), await stubs("decode")
    client = await make_router(prefills, decodes, tokenizers={None: "qwen3"})
    qwen = load_tokenizer("qwen3")
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Grüße aus 東京 🙂"}]
    resp = await client.post("/debug/route", json={"messages": msgs, "return_token_ids": True,
                                                   "chat_template_kwargs":
                                                       {"enable_thinking": False}})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    want = qwen.encode_chat(msgs, enable_thinking=False)
    assert body["token_ids"] == want and body["prompt_tokens"] == len(want)
    assert body["tokenizer"]["fingerprint"] == qwen.fingerprint and body["load_only"] is None
    for c in body["candidates"]:
        assert {"index_blocks", "predicted_blocks"} <= set(c)
    text = await client.post("/debug/route", json={"text": "hello world", "return_token_ids":
                                                   True})
    assert (await text.json())["token_ids"] == qwen.encode("hello world")
    assert await _routed(prefills, decodes) == 0


async def test_bad_chats_are_400_and_reach_no_worker(stubs: Any, make_router: Any,
                                                     strict_dir: Path) -> None:
    prefills, decodes = await stubs("prefill", 2), await stubs("decode")
    client = await make_router(prefills, decodes, tokenizers={None: str(strict_dir)},
                               max_prompt_tokens=40)
    cases = [
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
         "messages", "roles must alternate"),
        ([{"role": "user", "content": [{"type": "text", "text": "see"},
                                       {"type": "image_url", "image_url": {"url": "x"}}]}],
         "messages[0].content[1]", "image_url"),
        ([{"role": "user", "content": "word " * 60}], "messages", "at most 40"),
    ]
    for msgs, field, needle in cases:
        for path in ("/v1/chat/completions", "/debug/route"):
            resp = await client.post(path, json={"messages": msgs, "max_tokens": 4})
            assert resp.status == 400, (path, await resp.text())
            err = error_message(path, await resp.json())
            assert err.startswith(field + ":") and needle in err, err
    long = await client.post("/generate", json={"text": "word " * 60})
    assert long.status == 400 and "at most 40" in (await long.json())["error"]
    ok = await client.post("/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 4})
    assert ok.status == 200
    assert [len(p.bodies) for p in prefills].count(1) == 1 and len(decodes[0].bodies) == 1


async def test_a_model_without_tokenizer_is_routed_on_load_loudly(
        stubs: Any, start_router: Any, caplog: pytest.LogCaptureFixture) -> None:
    from router.config import RouterConfig

    prefills, (d,) = await stubs("prefill", 2), await stubs("decode")
    client = await start_router(RouterConfig(prefill=[(p.url, None) for p in prefills],
                                             decode=[d.url], health_interval=60,
                                             model="some/model"))
    assert "no tokenizer known to the router" in caplog.text
    assert await client.metric_lines('kvatlas_router_untokenizable_models{model="some/model"} 1')
    resp = await client.post("/debug/route", json={"text": "hello", "return_token_ids": True})
    body = await resp.json()
    assert body["load_only"] and body["prompt_tokens"] is None and body["token_ids"] is None
    assert (await client.post("/generate", json={"text": "hello"})).status == 200
    assert await client.metric_lines(
        'kvatlas_router_load_only_requests_total{model="some/model"} 1.0')
    # token ids are still routed on their prefix: nothing to tokenize
    ids = await client.post("/debug/route", json={"input_ids": [1, 2, 3]})
    assert (await ids.json())["prompt_tokens"] == 3


async def test_index_and_predicted_hits_are_separate_series(stubs: Any,
                                                            make_router: Any) -> None:
    prefills, decodes = await stubs("prefill", 2), await stubs("decode")
    client = await make_router(prefills, decodes, tokenizers={None: "qwen3"})
    prompt = "The same long shared prefix, said again and again. " * 20
    for _ in range(3):
        assert (await client.post("/generate", json={"text": prompt})).status == 200
    # no index here: every hit is the router's own prediction, and says so
    index = await client.metric_lines("kvatlas_router_index_hit_tokens_total")
    predicted = await client.metric_lines("kvatlas_router_predicted_hit_tokens_total")
    assert index and float(index[0].split()[-1]) == 0.0
    assert predicted and float(predicted[0].split()[-1]) > 0.0


async def test_tokenizers_named_by_instance_records(start_router: Any, etcd_settings: Any,
                                                    key_prefix: str, stubs: Any,
                                                    register: Any) -> None:
    """Without --tokenizer the router loads what its instances' records name; a record naming
    another fingerprint is flagged; a model whose record names a path this host cannot read is
    routed on load alone, loudly."""
    from etcd_instances import wait_for

    from router.config import RouterConfig

    qwen = load_tokenizer("qwen3")
    prefills, (d,) = await stubs("prefill", 3), await stubs("decode")
    named = {"source": "qwen3", "fingerprint": qwen.fingerprint}
    await register("p0", {"role": "prefill", "url": prefills[0].url, "model": "qwen-model",
                          "tokenizer": named})
    await register("p1", {"role": "prefill", "url": prefills[1].url, "model": "qwen-model",
                          "tokenizer": {**named, "fingerprint": "0123456789abcdef"}})
    await register("p2", {"role": "prefill", "url": prefills[2].url, "model": "lost-model",
                          "tokenizer": {"source": "/no/such/tokenizer", "fingerprint": "x"}})
    await register("d0", {"role": "decode", "url": d.url, "model": "qwen-model",
                          "tokenizer": named})
    client = await start_router(RouterConfig(etcd=etcd_settings, etcd_prefix=key_prefix,
                                             health_interval=60))
    body = {"model": "qwen-model", "text": "Grüße aus 東京", "return_token_ids": True}

    async def loaded() -> Any:
        resp = await client.post("/debug/route", json=body)
        doc = await resp.json()
        return resp.status == 200 and doc["token_ids"] == qwen.encode(body["text"])

    await wait_for(loaded, timeout=20)
    mismatch = await client.metric_lines('kvatlas_router_tokenizer_mismatch{instance="p1"')
    assert mismatch and mismatch[0].endswith(" 1.0"), mismatch
    assert not await client.metric_lines('kvatlas_router_tokenizer_mismatch{instance="p0"')

    async def lost() -> Any:
        return await client.metric_lines(
            'kvatlas_router_untokenizable_models{model="lost-model"} 1')

    await wait_for(lost, timeout=10)
    resp = await client.post("/debug/route", json={"model": "lost-model", "text": "hi"})
    doc = await resp.json()
    assert resp.status == 200 and doc["load_only"], doc
