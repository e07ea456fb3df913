"""Chat messages OpenAI's API would refuse (a role outside its set, a message without content)
are a 400 naming the field at the router, with the model's real template (Qwen3's, which would
render any role) and with the reference models' byte tokenizer, and no worker sees them; with
Qwen3's template an assistant turn of tool calls only, answered by a tool turn, is valid."""
from __future__ import annotations

import json
from typing import Any

import pytest

from tokenization.assets import qwen3_tokenizer_dir

BAD = [
    ([{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}],
     "messages[1].role", "wizard"),
    ([{"role": "user"}], "messages[0].content", "is required"),
    ([{"role": "system", "content": None}, {"role": "user", "content": "hi"}],
     "messages[0].content", "is required"),
    ([{"content": "x"}], "messages[0].role", "is required"),
]


def error_text(raw: str) -> str:
    """The error message of a 400, whether ``error`` is a string or OpenAI's object."""
    err = json.loads(raw)["error"]
    return str(err["message"] if isinstance(err, dict) else err)


@pytest.mark.parametrize("qwen3", [True, False], ids=["qwen3", "byte"])
async def test_messages_openai_refuses_are_400_naming_the_field(
        stubs: Any, make_router: Any, qwen3: bool) -> None:
    prefills, decodes = await stubs("prefill"), await stubs("decode")
    kw = {"tokenizers": {None: str(qwen3_tokenizer_dir())}} if qwen3 else {}
    client = await make_router(prefills, decodes, **kw)
    for msgs, field, needle in BAD:
        for path in ("/v1/chat/completions", "/debug/route"):
            resp = await client.post(path, json={"messages": msgs, "max_tokens": 4})
            text = await resp.text()
            assert resp.status == 400, (path, msgs, resp.status, text)
            err = error_text(text)
            assert err.startswith(field + ":") and needle in err, err
    assert sum(len(w.bodies) for w in [*prefills, *decodes]) == 0
    if not qwen3:
        return  # the byte template renders system, user and assistant turns only
    tool_turn = [{"role": "user", "content": "weather?"},
                 {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                  "function": {"name": "w", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    ok = await client.post("/v1/chat/completions", json={"messages": tool_turn, "max_tokens": 4})
    assert ok.status == 200, await ok.text()
