"""``kvatlas bootstrap serve`` as a real process: SIGKILL and SIGTERM, and the CLI over its mirror."""
from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable

import aiohttp
from bootstrap_helpers import TOPOLOGY_QUERY, ServerProcess, rank_body, run_cli

from index.etcd import EtcdClient
from index.keys import KeyLayout
from kvatlas.etcd_proc import free_port

TTL = 2


async def _register(url: str, n: int, token: str | None = None) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession(headers=headers) as s:
        for tp in range(n):
            async with s.put(f"{url}/route", json=rank_body(tp=tp, tp_size=n, port=25000 + tp)) as r:
                assert r.status == 200, await r.text()
        async with s.get(f"{url}/route", params=TOPOLOGY_QUERY) as r:
            assert r.status == 200


async def _keys(etcd: EtcdClient, layout: KeyLayout, iid: str) -> int:
    inst = await etcd.get(layout.instance(iid))
    _, ranks = await etcd.get_prefix(layout.ranks_prefix(iid))
    return len(ranks) + (inst is not None)


async def _wait_keys(etcd: EtcdClient, layout: KeyLayout, iid: str, n: int,
                     timeout: float = 60.0) -> None:
    """Wait until ``iid`` has ``n`` keys in etcd; the default deadline is far past anything a
    loaded box needs, so only keys that never come (or never go) reach it."""
    deadline = time.monotonic() + timeout
    while (count := await _keys(etcd, layout, iid)) != n:
        assert time.monotonic() < deadline, f"{iid}: {count} keys in etcd, want {n}"
        await asyncio.sleep(0.05)


async def test_kill_and_term_and_cli(server_process: Callable[..., ServerProcess],
                                     etcd: EtcdClient, etcd_endpoint: str, key_prefix: str,
                                     layout: KeyLayout) -> None:
    common = ["--model", "org/m-7b", "--etcd", etcd_endpoint, "--etcd-prefix", key_prefix,
              "--lease-ttl", str(TTL)]
    killed = await asyncio.to_thread(server_process, "--instance-id", "killed", *common)
    termed = await asyncio.to_thread(server_process, "--instance-id", "termed", "--auth-token",
                                     "tok", *common)
    await _register(killed.url, 4)
    await _register(termed.url, 2, token="tok")
    await _wait_keys(etcd, layout, "killed", 5)
    await _wait_keys(etcd, layout, "termed", 3)

    # The CLI reads the mirror (run off the event loop: it is a blocking subprocess).
    cli = ["--etcd", etcd_endpoint, "--etcd-prefix", key_prefix]
    res = await asyncio.to_thread(run_cli, "instances", *cli)
    assert res.returncode == 0, res.stderr
    rows = {line.split()[1]: line for line in res.stdout.splitlines() if "prefill" in line}
    assert set(rows) == {"killed", "termed"}
    assert "org/m-7b" in rows["killed"] and f"127.0.0.1:{killed.port}" in rows["killed"]
    assert "4/4" in rows["killed"] and "yes" in rows["killed"] and "2/2" in rows["termed"]

    res = await asyncio.to_thread(run_cli, "instances", "--json", *cli)
    listed = {i["instance_id"]: i for i in json.loads(res.stdout)}
    assert listed["killed"]["bootstrap_port"] == killed.port and listed["killed"]["ready"] is True
    assert 0 <= listed["termed"]["age_s"] < 60

    res = await asyncio.to_thread(run_cli, "bootstrap", "show", "killed", *cli)
    assert res.returncode == 0, res.stderr
    assert "ranks 4/4" in res.stdout and "ready" in res.stdout
    for tp in range(4):
        assert str(25000 + tp) in res.stdout
    res = await asyncio.to_thread(run_cli, "bootstrap", "show", "killed", "--json", *cli)
    shown = json.loads(res.stdout)
    assert [(r["tp"], r["rank_port"]) for r in shown["ranks"]] == [(t, 25000 + t) for t in range(4)]
    assert shown["instance"]["topology"]["attn_tp_size"] == 4

    res = await asyncio.to_thread(run_cli, "bootstrap", "show", "nosuch", *cli)
    assert res.returncode == 2 and res.stdout == ""
    assert len(res.stderr.strip().splitlines()) == 1 and "'nosuch'" in res.stderr

    # SIGKILL: nothing revokes the lease, so the keys go when it expires.
    lease = (await etcd.get(layout.instance("killed"))).lease  # type: ignore[union-attr]
    killed.signal(signal.SIGKILL)
    # SIGTERM: a clean shutdown revokes the lease before the process exits, so the keys are
    # gone by the time it has exited (an ordering, not a race against a clock).
    termed.signal(signal.SIGTERM)
    assert await asyncio.to_thread(termed.proc.wait, 30) == 0
    assert await _keys(etcd, layout, "termed") == 0
    await _wait_keys(etcd, layout, "killed", 0)
    assert await etcd.lease_ttl(lease) <= 0  # gone with its lease, which nobody kept alive


def test_cli_errors_are_one_line_exit_2() -> None:
    dead = f"127.0.0.1:{free_port()}"
    for args in (["instances"], ["instances", "--json"], ["bootstrap", "show", "x"]):
        res = run_cli(*args, "--etcd", dead, "--etcd-timeout", "1")
        assert res.returncode == 2, res
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvatlas: error:"), res.stderr
        assert dead in lines[0] and "Traceback" not in res.stderr
    res = run_cli("bootstrap", "serve", "--instance-id", "bad id!", "--model", "m")
    assert res.returncode == 2 and "instance id" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


async def test_a_second_live_process_with_the_same_id_is_refused(
        server_process: Callable[..., ServerProcess], etcd: EtcdClient, etcd_endpoint: str,
        key_prefix: str, layout: KeyLayout) -> None:
    common = ["--instance-id", "dup", "--model", "m", "--etcd", etcd_endpoint,
              "--etcd-prefix", key_prefix, "--lease-ttl", str(TTL)]
    first = await asyncio.to_thread(server_process, *common)
    await _wait_keys(etcd, layout, "dup", 1)
    second = ServerProcess(common, free_port())
    try:
        assert await asyncio.to_thread(second.proc.wait, 30) == 2
        out = second.output()
        assert "kvatlas: error: instance id 'dup' is in use by a live process" in out
        assert f"127.0.0.1:{first.port}" in out and "Traceback" not in out
    finally:
        second.stop()
    # The first one was left alone: still serving, still the record's holder.
    record = await etcd.get(layout.instance("dup"))
    assert record is not None and str(first.port).encode() in record.value
    # Once it is dead (SIGKILL: its lease is left to expire), a restart takes the id over.
    first.signal(signal.SIGKILL)
    await asyncio.to_thread(first.proc.wait, 10)
    third = await asyncio.to_thread(server_process, *common)
    deadline = time.monotonic() + 10
    while True:
        record = await etcd.get(layout.instance("dup"))
        if record is not None and str(third.port).encode() in record.value:
            break
        assert time.monotonic() < deadline, "the restarted process never took the record"
        await asyncio.sleep(0.05)
