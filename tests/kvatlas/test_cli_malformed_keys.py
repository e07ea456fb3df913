"""The read commands show what etcd holds and leave out what no kvatlas wrote: a non-UTF-8
instance key is listed as refused by `kvatlas instances`, and a malformed rank key or value is
left out of `kvatlas bootstrap show`, never a traceback (real etcd, the real CLI)."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from typing import Any

import pytest

from bootstrap.mirror import rank_value
from bootstrap.table import RankEntry
from index.etcd import EtcdClient
from index.keys import KeyLayout, dumps

pytestmark = pytest.mark.timeout(120)


def _record(iid: str) -> dict[str, Any]:
    return {"role": "prefill", "url": "http://127.0.0.1:9", "bootstrap_host": "127.0.0.1",
            "bootstrap_port": 9, "model": "tiny", "started_at": 1.0, "instance_id": iid}


def _cli(etcd_endpoint: str, key_prefix: str, *args: str) -> subprocess.CompletedProcess[str]:
    # A run dir of its own, empty: the command reads the etcd it is named, nothing else.
    with tempfile.TemporaryDirectory() as run_dir:
        return subprocess.run([sys.executable, "-m", "kvatlas", *args, "--etcd", etcd_endpoint,
                               "--etcd-prefix", key_prefix, "--run-dir", run_dir, "--json"],
                              capture_output=True, text=True, timeout=60)


async def test_read_commands_skip_what_no_kvatlas_wrote(
        etcd: EtcdClient, layout: KeyLayout, etcd_endpoint: str, key_prefix: str) -> None:
    await etcd.put(layout.instance("p0"), dumps(_record("p0")))
    await etcd.put(layout.instances_prefix() + b"\xff\xfe-not-utf8", dumps(_record("x")))
    good = rank_value((0, 0, 0, 0), RankEntry("127.0.0.1", 7001, 1.0, None, None))
    await etcd.put(layout.rank("p0", 0, 0, 0, 0), dumps(good))
    await etcd.put(layout.rank("p0", 0, 0, 1, 0), dumps({**good, "tp": 1, "rank_port": True}))
    await etcd.put(layout.ranks_prefix("p0") + b"0/+0/0/0", dumps(good))

    res = _cli(etcd_endpoint, key_prefix, "instances")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    listed = {doc["instance_id"]: doc for doc in json.loads(res.stdout)}
    assert listed["p0"]["role"] == "prefill"
    [bad] = [doc for iid, doc in listed.items() if iid != "p0"]
    assert bad["refused"] == "bad_key" and "not-utf8" in bad["instance_id"], bad

    res = _cli(etcd_endpoint, key_prefix, "bootstrap", "show", "p0")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    ranks = json.loads(res.stdout)["ranks"]
    assert [(r["dp"], r["tp"], r["rank_port"]) for r in ranks] == [(0, 0, 7001)], ranks
