"""``kvatlas sidecar --engine vllm --role prefill|decode`` in front of stub vLLM PD halves
(tests/vllm_stub.py ``--kv-role producer|consumer``), real etcd, real processes: the records
carry vLLM's protocol and a push prefill's NIXL identity, the prefill's blocks are indexed, the
stubs speak vLLM 0.33's ``kv_transfer_params`` contract, bad flags are CLI errors naming the
flag, and ``kvatlas doctor`` walks the pair (modes, identities, a canary) and names what to
change."""
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

from index.etcd import EtcdClient, EtcdSettings
from index.hashing import block_hashes
from index.keys import KeyLayout
from index.pd_protocol import PREFILL_PARAMS, PDProtocol
from index.record import InstanceRecord
from index.segments import held_blocks
from kvatlas.etcd_proc import free_ports
from tokenization import load_tokenizer

MODEL = "tiny-vllm-pd"
PROMPT = "A prompt a vLLM prefill computes and a decode reads, several blocks of sixteen bytes."


class PDProcs:
    """A stub vLLM producer and consumer, a sidecar beside each; all killed on teardown."""

    def __init__(self, etcd: str, *, mode: str = "pull", prefill_car: tuple[str, ...] = (),
                 decode_car: tuple[str, ...] = (), engine_id: str = "prefill-engine-a",
                 side_port: int = 5600) -> None:
        self.pport, self.dport, self.events = free_ports(3)
        self.prefix = f"/kvatlas-test-{uuid.uuid4().hex[:12]}"
        self.etcd, self.mode, self.engine_id, self.side_port = etcd, mode, engine_id, side_port
        self.purl = f"http://127.0.0.1:{self.pport}"
        self.durl = f"http://127.0.0.1:{self.dport}"
        stub = [sys.executable, str(ROOT / "tests" / "vllm_stub.py")]
        common = ["--model", MODEL, "--block-size", "16", "--encoding", "map", "--kv-mode", mode]
        self.prefill = Spawned("vllm-producer", [
            "--port", str(self.pport), "--events-port", str(self.events), *common,
            "--kv-role", "producer", "--engine-id", engine_id, "--side-channel-port",
            str(side_port)], program=stub)
        self.decode = Spawned("vllm-consumer", [
            "--port", str(self.dport), "--no-kv-events", *common, "--kv-role", "consumer"],
            program=stub)
        self.prefill.wait_http(f"{self.purl}/health", 60)
        self.decode.wait_http(f"{self.durl}/health", 60)
        base = ["sidecar", "--engine", "vllm", "--model", MODEL, "--etcd", etcd,
                "--etcd-prefix", self.prefix, "--lease-ttl", "3", "--health-interval", "0.2"]
        self.pcar = Spawned("sidecar-p0", [
            *base, "--role", "prefill", "--instance-id", "p0", "--engine-url", self.purl,
            "--kv-events", f"tcp://*:{self.events}", *prefill_car])
        self.dcar = Spawned("sidecar-d0", [
            *base, "--role", "decode", "--instance-id", "d0", "--engine-url", self.durl,
            *decode_car])

    @property
    def layout(self) -> KeyLayout:
        return KeyLayout(prefix=self.prefix)

    def output(self) -> str:
        return self.pcar.output() + "\n" + self.dcar.output()

    def stop(self) -> None:
        for p in (self.pcar, self.dcar, self.prefill, self.decode):
            p.stop()


@pytest.fixture
def procs(etcd_endpoint: str) -> Iterator[list[PDProcs]]:
    made: list[PDProcs] = []
    yield made
    for p in made:
        p.stop()


async def records(etcd: EtcdClient, p: PDProcs) -> dict[str, InstanceRecord] | None:
    out = {}
    for iid in ("p0", "d0"):
        kv = await etcd.get(p.layout.instance(iid))
        if kv is None:
            return None
        out[iid] = InstanceRecord.from_json(kv.value)
    return out


async def post(url: str, body: dict[str, Any], rid: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async with s.post(f"{url}/v1/completions", json=body,
                          headers={"X-Request-Id": rid}) as resp:
            return resp.status, await resp.json(content_type=None)


async def seen(url: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async with s.get(f"{url}/debug/requests") as resp:
            return (await resp.json())["requests"]


async def wait_prompt_indexed(etcd: EtcdClient, p: Any, who: str) -> list[int]:
    """Until the index holds ``PROMPT``'s blocks under p0, from the KV events of ``who``
    (``p``: the PDProcs whose output explains a timeout); PROMPT's token ids."""
    ids = load_tokenizer("byte").encode(PROMPT)
    want = set(block_hashes(ids, 16))

    async def held() -> bool:
        _, kvs = await etcd.get_prefix(p.layout.blocks_prefix(MODEL, "p0"))
        return want <= set(held_blocks(kv.value for kv in kvs))
    await wait_until(held, what=f"the index holds the prompt's blocks under p0 (from the "
                     f"{who}'s KV events)", detail=p.output)
    return ids


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_vllm_pd_halves_are_registered_with_their_protocol_and_indexed(
        etcd_endpoint: str, etcd_settings: EtcdSettings, procs: list[PDProcs],
        mode: str) -> None:
    flags = ("--pd-protocol", f"vllm-{mode}")
    p = PDProcs(etcd_endpoint, mode=mode, side_port=5611,
                prefill_car=(*flags, "--nixl-engine-id", "prefill-engine-a", "--nixl-port",
                             "5611", "--tp-size", "2"),
                decode_car=flags)
    procs.append(p)
    async with EtcdClient(etcd_settings) as etcd:
        recs = await wait_until(lambda: records(etcd, p), what="both sidecars write records",
                                detail=p.output)
        assert recs is not None
        pre, dec = recs["p0"], recs["d0"]
        assert (pre.role, pre.engine, pre.url) == ("prefill", "vllm", p.purl)
        assert pre.pd_protocol == PDProtocol("vllm", mode, engine_id="prefill-engine-a",
                                             host="127.0.0.1", port=5611, tp_size=2)
        assert pre.tp_size == 2 and pre.bootstrap_host is None and pre.bootstrap_port is None
        assert (dec.role, dec.pd_protocol) == ("decode", PDProtocol("vllm", mode))

        # One exchange as a router drives it; the prefill's prompt blocks reach the index.
        status, answer = await post(p.purl, {"model": MODEL, "prompt": PROMPT, "max_tokens": 1,
                                             "stream": False,
                                             "kv_transfer_params": PREFILL_PARAMS}, "r1")
        assert status == 200, answer
        ids = await wait_prompt_indexed(etcd, p, "vLLM prefill")
    params = answer["kv_transfer_params"]
    assert params["transfer_mode"] == mode and params["remote_engine_id"] == "prefill-engine-a"
    assert params["remote_request_id"].startswith("cmpl-r1-")
    assert len(params["remote_block_ids"][0]) == len(ids) // 16
    assert ("remote_blocks_expiry_time" in params) == (mode == "pull")
    assert len(answer["choices"][0]["text"]) == 1


async def test_stub_consumer_refuses_push_without_identity_and_records_a_pull_recompute(
        procs: list[PDProcs], etcd_endpoint: str) -> None:
    """The stub's consumer behaves as vLLM's: what router tests rely on it to show."""
    for mode in ("push", "pull"):
        p = PDProcs(etcd_endpoint, mode=mode, prefill_car=("--pd-protocol", f"vllm-{mode}",
                                                           "--nixl-engine-id", "e"),
                    decode_car=("--pd-protocol", f"vllm-{mode}"))
        procs.append(p)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3,
                "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "e",
                                       "remote_host": "127.0.0.1", "remote_port": 5600}}
        status, answer = await post(p.durl, body, f"{mode}-1")
        got = (await seen(p.durl))[-1]
        assert got["x_request_id"] == f"{mode}-1" and got["request_id"].startswith(
            f"cmpl-{mode}-1-"), got
        if mode == "push":
            assert status == 400 and "tp_size" in answer["error"], answer
        else:
            assert status == 200 and answer["choices"][0]["text"] == PROMPT[:3], answer
            assert got["recomputed"] is True, got


@pytest.mark.parametrize(("args", "words"), [
    (("--role", "prefill", "--pd-protocol", "vllm-push"),
     ["--nixl-engine-id", "fresh uuid per start"]),
    (("--role", "decode", "--nixl-engine-id", "e1"), ["--nixl-engine-id", "for a vLLM prefill"]),
    (("--role", "aggregated", "--pd-protocol", "vllm"), ["--pd-protocol", "aggregated"]),
    (("--role", "prefill", "--pd-protocol", "sglang"), ["--pd-protocol sglang", "vllm-push"]),
    (("--role", "prefill", "--nixl-port", "70000"), ["--nixl-port", "65535"]),
    (("--role", "prefill", "--tp-size", "0"), ["--tp-size"]),
])
def test_bad_vllm_pd_flags_are_cli_errors_naming_the_flag(args: tuple[str, ...],
                                                          words: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvatlas", "sidecar", "--engine", "vllm", "--instance-id", "v0",
         "--engine-url", "http://127.0.0.1:1", "--model", MODEL, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    for w in words:
        assert w in out.stderr, out.stderr


def test_sglang_engine_refuses_vllm_pd_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvatlas", "sidecar", "--role", "prefill", "--instance-id", "s0",
         "--engine-url", "http://127.0.0.1:1", "--model", MODEL, "--nixl-host", "10.0.0.2"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--nixl-host" in out.stderr and "SGLang" in out.stderr, out


# --- kvatlas doctor ------------------------------------------------------------------------------

def doctor(p: PDProcs) -> dict[str, dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "kvatlas", "doctor", "--etcd", p.etcd, "--etcd-prefix", p.prefix,
         "--json", "--timeout", "10"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip(), out.stderr
    return {link["name"]: link for link in json.loads(out.stdout)}


PAIR = "p0 -> d0: vLLM PD canary"
DOCTOR_CASES = {
    # name: (mode, prefill sidecar flags, decode sidecar flags, {failing link: words in hint})
    "pull_ok": ("pull", (), (), {}),
    "push_ok": ("push", ("--pd-protocol", "vllm-push", "--nixl-engine-id", "prefill-engine-a"),
                ("--pd-protocol", "vllm-push"), {}),
    "modes_differ": ("push", ("--pd-protocol", "vllm-push", "--nixl-engine-id",
                              "prefill-engine-a"), ("--pd-protocol", "vllm-pull"),
                     {f"{MODEL}: vLLM PD modes agree": "same kv_connector"}),
    "wrong_engine_id": ("pull", ("--nixl-engine-id", "not-the-engines"), (),
                        {PAIR: "--nixl-engine-id prefill-engine-a"}),
    "wrong_side_port": ("push", ("--pd-protocol", "vllm-push", "--nixl-engine-id",
                                 "prefill-engine-a", "--nixl-port", "5700"),
                        ("--pd-protocol", "vllm-push"), {PAIR: "--nixl-port 5600"}),
    "engine_in_other_mode": ("push", (), (), {PAIR: "--pd-protocol vllm-push"}),
}


@pytest.mark.parametrize("case", sorted(DOCTOR_CASES))
async def test_doctor_walks_a_vllm_pd_pair_and_names_what_to_change(
        etcd_endpoint: str, etcd_settings: EtcdSettings, procs: list[PDProcs],
        case: str) -> None:
    mode, pcar, dcar, failing = DOCTOR_CASES[case]
    p = PDProcs(etcd_endpoint, mode=mode, prefill_car=pcar, decode_car=dcar)
    procs.append(p)
    async with EtcdClient(etcd_settings) as etcd:
        await wait_until(lambda: records(etcd, p), what="both sidecars write records",
                         detail=p.output)
    links = await asyncio.to_thread(doctor, p)
    pd = {name: link for name, link in links.items() if "vLLM PD" in name or "push identity"
          in name}
    bad = {name for name, link in pd.items() if not link["ok"]}
    assert bad == set(failing), (pd, p.output())
    for name, words in failing.items():
        assert words in pd[name]["hint"], pd[name]
    assert links["instances registered"]["ok"], links
    if not failing:
        assert pd[PAIR]["ok"] and f"{MODEL}: vLLM PD pair registered" in pd, pd
        for stub, rid_field in ((p.purl, "do_remote_decode"), (p.durl, "do_remote_prefill")):
            got = [r for r in await seen(stub)
                   if str(r["x_request_id"]).startswith("kvatlas-doctor-")]
            assert len(got) == 1 and got[0]["body"]["kv_transfer_params"][rid_field], got
            assert not got[0]["recomputed"], got
        if mode == "push":
            assert "push identity" in " ".join(pd), pd
