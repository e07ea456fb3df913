"""``kvatlas sidecar --engine vllm --role aggregated`` in front of a stub ``vllm serve``
(tests/vllm_stub.py: vLLM's HTTP API and KV-event wire), real etcd, real processes: the record
and its limits, the prompt's blocks in the index under kvatlas's own hashes, the record gone when
the engine dies, bad flags, and ``kvatlas doctor`` naming vLLM's silent-zero-hit causes."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from sidecar_procs import ROOT, Spawned
from waiting import wait_until

from index.agent_stats import stats_key
from index.etcd import EtcdClient, EtcdSettings
from index.hashing import block_hashes
from index.keys import KeyLayout, loads
from index.record import InstanceRecord
from index.segments import held_blocks
from kvatlas.etcd_proc import free_ports
from tokenization import load_tokenizer

MODEL = "tiny-vllm"
PROMPT = "A prompt that a vLLM engine caches, long enough for several blocks of sixteen bytes."


class VllmProcs:
    """A stub vLLM and a sidecar beside it, both killed on teardown."""

    def __init__(self, etcd: str, *, stub: tuple[str, ...] = (), car: tuple[str, ...] = ()
                 ) -> None:
        self.port, self.events, self.replay = free_ports(3)
        self.prefix = f"/kvatlas-test-{uuid.uuid4().hex[:12]}"
        self.etcd = etcd
        self.url = f"http://127.0.0.1:{self.port}"
        self.stub = Spawned("vllm-stub", [
            "--port", str(self.port), "--events-port", str(self.events), "--replay-port",
            str(self.replay), "--model", MODEL, "--block-size", "16", "--max-model-len", "2048",
            *stub], program=[sys.executable, str(ROOT / "tests" / "vllm_stub.py")])
        self.stub.wait_http(f"{self.url}/health", 60)
        self.car = Spawned("sidecar-v0", [
            "sidecar", "--engine", "vllm", "--role", "aggregated", "--instance-id", "v0",
            "--engine-url", self.url, "--model", MODEL, "--kv-events",
            f"tcp://*:{self.events}", "--replay", f"tcp://*:{self.replay}", "--etcd", etcd,
            "--etcd-prefix", self.prefix, "--lease-ttl", "3", "--unhealthy-grace", "1",
            "--health-interval", "0.2", *car])

    @property
    def layout(self) -> KeyLayout:
        return KeyLayout(prefix=self.prefix)

    def stop(self) -> None:
        for p in (self.car, self.stub):
            p.stop()


@pytest.fixture
def procs(etcd_endpoint: str) -> Iterator[list[VllmProcs]]:
    made: list[VllmProcs] = []
    yield made
    for p in made:
        p.stop()


async def record(etcd: EtcdClient, p: VllmProcs) -> InstanceRecord | None:
    kv = await etcd.get(p.layout.instance("v0"))
    return None if kv is None else InstanceRecord.from_json(kv.value)


async def complete(p: VllmProcs, prompt: str, stream: bool = False) -> Any:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream}
        async with s.post(f"{p.url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.text() if stream else await resp.json()


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_a_vllm_engine_is_registered_indexed_and_removed_when_it_dies(
        etcd_endpoint: str, etcd_settings: EtcdSettings, procs: list[VllmProcs],
        encoding: str) -> None:
    # array: msgspec's array_like tagged structs (older vLLM); map: vLLM 0.33's.
    p = VllmProcs(etcd_endpoint, stub=("--encoding", encoding))
    procs.append(p)
    async with EtcdClient(etcd_settings) as etcd:
        rec = await wait_until(lambda: record(etcd, p), what="the sidecar writes v0's record",
                               detail=p.car.output)
        assert rec is not None
        assert (rec.role, rec.engine, rec.model, rec.url) == ("aggregated", "vllm", MODEL, p.url)
        assert rec.context_length == 2048 and rec.max_prompt_tokens == 2048
        assert rec.block_size == 16 and rec.bootstrap_host is None

        # Streamed (SSE) and not: the stub speaks vLLM's OpenAI API either way.
        assert (await complete(p, PROMPT))["choices"][0]["text"]
        assert "data: [DONE]" in await complete(p, PROMPT + " again", stream=True)
        ids = load_tokenizer("byte").encode(PROMPT)
        want = set(block_hashes(ids, 16))
        assert len(want) == len(ids) // 16 >= 3

        async def held() -> set[int] | None:
            _, kvs = await etcd.get_prefix(p.layout.blocks_prefix(MODEL, "v0"))
            blocks = set(held_blocks(kv.value for kv in kvs))
            return blocks if want <= blocks else None
        await wait_until(held, what="the index holds the prompt's blocks under v0, keyed by "
                         "kvatlas's hashes of the token ids", detail=p.car.output)

        p.stub.kill()
        await wait_until(lambda: _gone(etcd, p), what="v0's record leaves etcd after the "
                         "engine died (unhealthy, then lease revoked)", detail=p.car.output)
        _, kvs = await etcd.get_prefix(p.layout.blocks_prefix(MODEL, "v0"))
        assert not kvs, "the dead engine's blocks outlived its lease"


async def _gone(etcd: EtcdClient, p: VllmProcs) -> bool:
    return await etcd.get(p.layout.instance("v0")) is None


@pytest.mark.parametrize(("flag", "value"), [("--engine", "foo"), ("--role", "wizard")])
def test_a_bad_engine_or_role_is_a_cli_error_naming_the_flag(flag: str, value: str) -> None:
    args = {"--engine": "vllm", "--role": "aggregated", flag: value}
    out = subprocess.run(
        [sys.executable, "-m", "kvatlas", "sidecar", "--instance-id", "v0", "--engine-url",
         "http://127.0.0.1:1", "--model", MODEL, *(x for kv in args.items() for x in kv)],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert f"argument {flag}: invalid choice: '{value}'" in out.stderr, out.stderr


# --- kvatlas doctor ------------------------------------------------------------------------------

def doctor(p: VllmProcs) -> dict[str, dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "kvatlas", "doctor", "--etcd", p.etcd, "--etcd-prefix", p.prefix,
         "--json", "--timeout", "10"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip(), out.stderr
    return {link["name"]: link for link in json.loads(out.stdout)}


FAULTS = {
    "healthy": ((), (), {}),
    "block_size": ((), ("--block-size", "32"),
                   {"v0: vLLM block size matches the index": "block_size_mismatch"}),
    "no_events": (("--no-kv-events",), ("--publisher-wait", "0"),
                  {"v0: vLLM KV events arrive": "no KV-event publisher connected"}),
    "no_prefix_caching": (("--no-prefix-caching",), (),
                          {"v0: vLLM prefix caching on": "0 prefix-cache queries"}),
    "lora": (("--lora", "adapter-a"), (),
             {"v0: vLLM blocks in the base namespace": "adapter-a"}),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_doctor_names_vllms_silent_zero_hit_causes(
        etcd_endpoint: str, etcd_settings: EtcdSettings, procs: list[VllmProcs],
        fault: str) -> None:
    stub, car, named = FAULTS[fault]
    p = VllmProcs(etcd_endpoint, stub=stub, car=car)
    procs.append(p)
    async with EtcdClient(etcd_settings) as etcd:
        await wait_until(lambda: record(etcd, p), what="the sidecar writes v0's record",
                         detail=p.car.output)
        for i in range(3):
            await complete(p, f"{PROMPT} question {i}")

        async def counted() -> dict[str, Any] | None:
            kv = await etcd.get(stats_key(p.layout, "v0"))
            doc = loads(kv.value) if kv is not None else None
            # Wait for the stats the served requests make: batches received or none expected.
            if doc is None or (fault in ("healthy", "block_size", "lora")
                               and not doc.get("received")):
                return None
            return doc
        await wait_until(counted, what="v0's ingestion counters after 3 requests",
                         detail=p.car.output)
    links = await asyncio.to_thread(doctor, p)
    vllm = {name: link for name, link in links.items() if "vLLM" in name}
    assert len(vllm) == 4, sorted(links)
    failing = {name for name, link in vllm.items() if not link["ok"]}
    assert failing == set(named), (vllm, p.car.output())
    for name, words in named.items():
        assert words in vllm[name]["detail"], vllm[name]
        assert vllm[name]["hint"], vllm[name]


async def test_a_router_routes_to_the_vllm_engine_on_its_events(
        etcd_endpoint: str, procs: list[VllmProcs]) -> None:
    """The router discovers the sidecar's aggregated record, sends an OpenAI request whole to
    the vLLM engine, and then finds the prompt's prefix there through vLLM's own KV events."""
    from router.app import create_app
    from router.config import RouterConfig

    p = VllmProcs(etcd_endpoint)
    procs.append(p)
    cfg = RouterConfig(etcd=EtcdSettings(endpoints=[etcd_endpoint]), etcd_prefix=p.prefix,
                       model=MODEL, tokenizers={None: "byte"}, share_predictions=False,
                       prediction_ttl=0.01, prediction_catch_up=0.0)
    app = create_app(cfg)
    port = await app.start("127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            async def ready() -> bool:
                async with s.get(url + "/readiness") as r:
                    return r.status == 200
            await wait_until(ready, what="the router discovered the vLLM engine",
                             detail=p.car.output)
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
            async with s.post(url + "/v1/completions", json=body) as r:
                answer = await r.json()
                assert r.status == 200, answer
            assert answer["choices"][0]["text"]

            async def indexed() -> bool:
                async with s.post(url + "/debug/route", json=body) as r:
                    doc = await r.json()
                return doc["worker"]["instance_id"] == "v0" and doc["index_blocks"] >= 3
            await wait_until(indexed, what="the router's index shows v0 holding the prompt "
                             "(from vLLM's KV events)", detail=p.car.output)
    finally:
        await app.close()
