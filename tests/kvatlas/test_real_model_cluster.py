"""The whole system on the real model: a local cluster (embedded etcd, two prefills and a decode
serving SmolLM2-135M-Instruct, the router) as ``kvatlas cluster up`` starts it. A conversation's
second request goes to the prefill holding its first turn, because the block index (not the
router's own prediction) says so, and that prefill reports the prefix as cached."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvatlas.launcher.supervisor import LocalCluster
from kvatlas.launcher.topology import Topology

pytestmark = pytest.mark.timeout(300)

SYSTEM = ("You are a helpful assistant for a geography class. Answer every question with one "
          "short, correct sentence. The students are twelve years old: keep the words simple.")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(Topology(prefill=2, decode=1, model="smollm2-135m"), tmp_path / "run")
    try:
        c.start(timeout=240)
        yield c
    finally:
        c.stop()
        assert not [p.name for p in c.state.processes if p.alive()], "left running"


def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def _chat(url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    status, doc = _post(f"{url}/v1/chat/completions",
                                 {"messages": messages, "max_tokens": 24, "temperature": 0})
    assert status == 200, doc
    return doc


def test_second_turn_goes_to_the_holder_of_its_prefix(cluster: LocalCluster) -> None:
    url = cluster.state.router["url"]
    first = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "What is the capital of France?"}]
    answer = _chat(url, first)
    text = answer["choices"][0]["message"]["content"]
    assert "Paris" in text, text  # the model speaks, and gets this one right
    second = [*first, {"role": "assistant", "content": text},
              {"role": "user", "content": "And the capital of Italy?"}]
    deadline = time.monotonic() + 30
    while True:  # the first turn's blocks reach etcd, then every router's mirror
        status, decision = _post(f"{url}/debug/route", {"messages": second})
        assert status == 200, decision
        chosen = {c["instance_id"]: c for c in decision["candidates"]}[
            decision["prefill"]["instance_id"]]
        if chosen["index_blocks"] > 0:
            break
        assert time.monotonic() < deadline, decision
        time.sleep(0.3)
    assert decision["tokenizer"]["kind"] == "hf" and decision["prompt_tokens"] > 48
    others = [c for c in decision["candidates"] if c is not chosen]
    assert all(c["index_blocks"] == 0 for c in others), decision
    answer2 = _chat(url, second)
    cached = answer2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16 * chosen["index_blocks"] > 0, (cached, chosen)
    assert "Rome" in answer2["choices"][0]["message"]["content"]
