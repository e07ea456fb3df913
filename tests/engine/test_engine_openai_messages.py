"""The engine's chat route refuses what OpenAI's API refuses (a role outside its set, a message
without content) with a 400 naming the field, through the worker's real HTTP app; the same
check as the router's (``tokenization.messages``)."""
from __future__ import annotations

import json
from typing import Any

import pytest

from engine.serve_config import EngineServerConfig
from engine.server import create_app

pytestmark = pytest.mark.timeout(60)

BAD = [
    ([{"role": "user"}], "messages[0].content", "is required"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
     "messages[1].content", "is required"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role", "got 'wizard'"),
]


async def test_bad_chat_messages_are_400_naming_the_field(aiohttp_client: Any) -> None:
    client = await aiohttp_client(create_app(EngineServerConfig()))
    for msgs, field, needle in BAD:
        resp = await client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
        text = await resp.text()
        assert resp.status == 400, (msgs, resp.status, text)
        err = json.loads(text)["error"]
        err = str(err["message"] if isinstance(err, dict) else err)
        assert err.startswith(field + ":") and needle in err, err
    ok = await client.post("/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 2})
    assert ok.status == 200, await ok.text()
