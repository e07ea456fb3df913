"""``kvatlas doctor`` on a sidecar'd cluster: every link holds on a healthy one, and each cause of
a silent zero hit, injected into a real cluster, is named once traffic shows it: a block-size
mismatch (with its rejected events), an engine whose KV events reach nobody, and blocks that
never match the router's hashes (the sidecar names another tokenizer than the engine uses)."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import aiohttp
import pytest
from conftest import SidecarCluster, start_cluster
from sidecar_procs import ROOT, Engine
from waiting import wait_until_sync

from kvatlas.etcd_proc import free_port

pytestmark = pytest.mark.slow

SAMPLING = {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True}
SYSTEM = "A system prompt shared by the doctor tests' traffic, long enough for a few blocks. "


def doctor(cluster: SidecarCluster) -> dict[str, dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "kvatlas", "doctor", "--etcd", cluster.etcd, "--etcd-prefix",
         cluster.prefix, "--router", cluster.router.url, "--json", "--timeout", "10"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip(), out.stderr
    return {link["name"]: link for link in json.loads(out.stdout)}


async def traffic(cluster: SidecarCluster, n: int = 6) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def one(i: int) -> None:
            body = {"text": f"{SYSTEM}question {i}", "sampling_params": SAMPLING}
            async with s.post(f"{cluster.router.url}/generate", json=body) as resp:
                assert resp.status == 200, await resp.text()
        await asyncio.gather(*(one(i) for i in range(n)))


def test_every_link_holds_on_a_healthy_sidecar_cluster(shared_cluster: SidecarCluster) -> None:
    asyncio.run(traffic(shared_cluster))
    links = doctor(shared_cluster)
    failing = {name: link for name, link in links.items() if not link["ok"]}
    assert not failing, (failing, shared_cluster.logs())
    for p in shared_cluster.prefills:
        for name in ("index settings match the router", "no KV events rejected",
                     "KV events arrive", "its blocks match the router's hashes"):
            assert f"{p.name}: {name}" in links, sorted(links)


def _wrong_events(engine: Engine) -> tuple[str, ...]:
    # The engine publishes on its own endpoint; this sidecar binds one nobody publishes to.
    return ("--kv-events", f"tcp://127.0.0.1:{free_port()}") if engine.mode == "prefill" else ()


FAULTS = {
    "block_size": (lambda e: ("--block-size", "32"), (),
                   {"index settings match the router": "block_size: router 16, instance 32",
                    "no KV events rejected": "block_size_mismatch"}),
    "no_events": (_wrong_events, (), {"KV events arrive":
                                       "0 event batches received, 0 publishers connected"}),
    "hashes": (lambda e: ("--tokenizer", "smollm2-135m"),
               ("--tokenizer", "smollm2-135m", "--canary-delay", "0.5", "--canary-interval",
                "0.1"),
               {"its blocks match the router's hashes": "0 found"}),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_doctor_names_each_cause_of_a_silent_zero_hit(
        etcd_endpoint: str, own_cluster: list[SidecarCluster], fault: str) -> None:
    sidecar_extra, router_extra, named = FAULTS[fault]
    cluster = start_cluster(etcd_endpoint, prefills=1, router_extra=router_extra,
                            sidecar_extra=sidecar_extra)
    own_cluster.append(cluster)
    asyncio.run(traffic(cluster))
    asyncio.run(traffic(cluster))  # more canaries: one per instance per interval
    links: dict[str, dict[str, Any]] = {}

    def p0_failing() -> dict[str, dict[str, Any]] | None:
        """The failing links of p0 once they include every named one; else more traffic."""
        links.clear()
        links.update(doctor(cluster))
        failing = {name.split(": ", 1)[1]: link for name, link in links.items()
                   if not link["ok"] and name.startswith("p0: ")}
        if set(named) <= set(failing):
            return failing
        asyncio.run(traffic(cluster, 2))
        return None
    failing = wait_until_sync(p0_failing, what=f"doctor names {sorted(named)} as failing",
                              timeout=60.0, detail=lambda: (links, cluster.logs()))
    for name, text in named.items():
        assert text in failing[name]["detail"], failing[name]
        assert failing[name]["hint"], failing[name]
    others = {n for n in failing if n not in named}
    assert not others, failing  # each fault names its own cause, not the others'
