"""`kvatlas cluster up|status|down` with real processes: nothing is left running afterwards."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvatlas.etcd_proc import free_port
from kvatlas.launcher.state import ClusterState

pytestmark = pytest.mark.timeout(120)

# One prefill and one decode keep these quick; tests/faults/ runs the default two prefills.
FAST = ["--prefill", "1", "--decode", "1", "--model", "tiny"]  # the fast byte model


def kvatlas(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvatlas", *args], capture_output=True,
                          text=True, timeout=timeout)


def _all_gone(state: ClusterState) -> list[str]:
    return [p.name for p in state.processes if p.alive()]


def admin_status(state: ClusterState, token: str) -> int:
    """Status of an admin call to the router (removing a worker that does not exist)."""
    req = urllib.request.Request(state.router["url"] + "/workers?url=http://127.0.0.1:9",
                                 method="DELETE", headers={"authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def chat_twice(state: ClusterState, content: str) -> list[dict[str, Any]]:
    """One chat request through the router, twice (2 tokens each): the answers' usages."""
    chat = json.dumps({"messages": [{"role": "user", "content": content}],
                       "max_tokens": 2}).encode()
    usages = []
    for _ in range(2):
        with urllib.request.urlopen(state.router["url"] + "/v1/chat/completions", chat,
                                    timeout=30) as r:
            usages.append(json.loads(r.read())["usage"])
    return usages


def test_up_status_generate_down(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    up = kvatlas("cluster", "up", *FAST, "--detach", "--router-port", str(free_port()),
                 "--run-dir", str(run_dir))
    assert up.returncode == 0, up.stderr
    state = ClusterState.load(run_dir)
    try:
        assert {p.role for p in state.processes} == {"etcd", "prefill", "decode", "router"}
        assert all(p.alive() for p in state.processes)
        # Other commands find the cluster through these two keys.
        doc = json.loads((run_dir / "cluster.json").read_text())
        assert doc["etcd"] == state.etcd and doc["router"]["url"].startswith("http://127.0.0.1:")
        assert stat.S_IMODE((run_dir / "cluster.json").stat().st_mode) == 0o600, "holds tokens"
        for p in state.processes:
            assert Path(p.log).is_file()
        # Tokens reach the processes through their environment: `ps` shows no secret.
        tokens = [state.topology["auth_token"].encode(), state.topology["admin_token"].encode()]
        for p in state.processes:
            cmdline = Path(f"/proc/{p.pid}/cmdline").read_bytes()
            assert not any(t in cmdline for t in tokens), p.name
        assert admin_status(state, state.topology["admin_token"]) == 404  # admitted; no such worker
        assert admin_status(state, "wrong-token-123") == 401
        st = kvatlas("cluster", "status", "--json", "--run-dir", str(run_dir))
        assert st.returncode == 0, st.stderr
        status = json.loads(st.stdout)
        assert status["ready"] and all(p["alive"] and p["healthy"] for p in status["processes"])
        assert len(status["workers"]["prefill"]) == 1 and len(status["workers"]["decode"]) == 1
        gen = kvatlas("generate", "--run-dir", str(run_dir), "--prompt", "hello",
                      "--max-new-tokens", "4", "--json")
        assert gen.returncode == 0, gen.stderr
        assert json.loads(gen.stdout)["meta_info"]["completion_tokens"] == 4
        # A batch through the router: each prompt gets its own room on both halves.
        batch = json.dumps({"text": ["a first prompt", "a second one"],
                            "sampling_params": {"max_new_tokens": 3}}).encode()
        with urllib.request.urlopen(state.router["url"] + "/generate", batch, timeout=30) as r:
            answers = json.loads(r.read())
        assert [a["meta_info"]["completion_tokens"] for a in answers] == [3, 3]
        assert len({a["meta_info"]["bootstrap_room"] for a in answers}) == 2
        # OpenAI requests through the router; the repeat finds its prefix cached.
        usages = chat_twice(state, "a question " * 8)
        assert [u["completion_tokens"] for u in usages] == [2, 2]
        assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0
        again = kvatlas("cluster", "up", *FAST, "--detach", "--run-dir", str(run_dir))
        assert again.returncode == 2 and "already running" in again.stderr
        # doctor walks the whole chain, then names the first broken link.
        doc = kvatlas("doctor", "--run-dir", str(run_dir), "--json")
        assert doc.returncode == 0, doc.stdout + doc.stderr
        links = json.loads(doc.stdout)
        names = [link["name"] for link in links]
        assert all(link["ok"] for link in links) and "prefill-0: probe consumed" in names
        assert names[-1] == "probe through the router consumed"
        state.process("router").stop()
        doc = kvatlas("doctor", "--run-dir", str(run_dir))
        assert doc.returncode == 1
        assert "[FAIL] router ready" in doc.stdout and "next:" in doc.stdout
    finally:
        down = kvatlas("cluster", "down", "--run-dir", str(run_dir))
    assert down.returncode == 0, down.stderr
    assert _all_gone(state) == []
    st = kvatlas("cluster", "status", "--json", "--run-dir", str(run_dir))
    assert st.returncode == 1 and not any(p["alive"] for p in json.loads(st.stdout)["processes"])


def _wait_ready(run_dir: Path, proc: subprocess.Popen[bytes]) -> ClusterState:
    """Read the foreground `up`'s output until it says it is running (pytest's timeout bounds
    this); then the cluster is ready."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if b"Ctrl-C stops everything" in line:
            state = ClusterState.load(run_dir)
            with urllib.request.urlopen(state.router["url"] + "/readiness", timeout=5) as r:
                assert r.status == 200
            return state
    raise AssertionError(f"the foreground `cluster up` exited early ({proc.wait()})")


@contextlib.contextmanager
def foreground_up(run_dir: Path, stderr: int = subprocess.PIPE
                  ) -> Iterator[subprocess.Popen[bytes]]:
    """A foreground ``cluster up``; whatever happens, nothing of it is left afterwards."""
    proc = subprocess.Popen([sys.executable, "-m", "kvatlas", "cluster", "up", *FAST,
                             "--router-port", str(free_port()), "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=stderr)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        kvatlas("cluster", "down", "--run-dir", str(run_dir))


def test_ctrl_c_on_a_foreground_up_stops_everything(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with foreground_up(run_dir) as proc:
        state = _wait_ready(run_dir, proc)
        assert len(state.processes) == 4
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        assert b"nothing left running" in out
        assert _all_gone(state) == []


def test_signals_at_once_and_twice_still_stop_everything(tmp_path: Path) -> None:
    """SIGTERM the moment the cluster says it runs, and again during the stop: the stop is
    neither skipped nor cut short, so nothing is left in the processes' own sessions."""
    run_dir = tmp_path / "run"
    with foreground_up(run_dir, stderr=subprocess.DEVNULL) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if b"Ctrl-C stops everything" in line:
                break
        proc.send_signal(signal.SIGTERM)
        assert b"stopping the cluster" in proc.stdout.readline() + proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and b"nothing left running" in out
        state = ClusterState.load(run_dir)
        assert len(state.processes) == 4 and _all_gone(state) == []


def test_ctrl_c_while_starting_stops_what_started(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with foreground_up(run_dir) as proc:
        assert proc.stderr is not None
        for line in proc.stderr:
            if b"ready" in line:  # etcd is up; the instances are still starting
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        # Interrupted while starting (the instances take seconds), or, on a very fast start,
        # just after: either way everything is stopped.
        assert (proc.returncode, b"stopping what started" in err) == (130, True) or \
            (proc.returncode, b"nothing left running" in out) == (0, True), (out, err)
        state = ClusterState.load(run_dir)
        assert state.processes and _all_gone(state) == []


def test_a_failed_start_names_the_process_and_leaves_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        up = kvatlas("cluster", "up", *FAST, "--detach", "--router-port", str(port),
                     "--timeout", "30", "--run-dir", str(run_dir))
    assert up.returncode == 2
    assert "router" in up.stderr and "router.log" in up.stderr
    state = ClusterState.load(run_dir)
    assert _all_gone(state) == []


def test_down_without_a_cluster_says_how_to_start_one(tmp_path: Path) -> None:
    out = kvatlas("cluster", "down", "--run-dir", str(tmp_path / "none"))
    assert out.returncode == 2 and "kvatlas cluster up" in out.stderr
    assert os.listdir(tmp_path) == []


def test_a_cluster_with_index_shards_indexes_its_prefill_on_its_shard(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    up = kvatlas("cluster", "up", *FAST, "--index-shards", "2", "--detach",
                 "--router-port", str(free_port()), "--run-dir", str(run_dir))
    assert up.returncode == 0, up.stderr
    state = ClusterState.load(run_dir)
    try:
        assert len(state.index_etcd) == 2 and state.etcd not in state.index_etcd
        assert len(state.by_role("etcd")) == 3
        usages = chat_twice(state, "a sharded question " * 8)
        assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0
        # `index stats` finds the shards through cluster.json: the prefill's blocks are on the
        # one shard its id is placed on.
        st = kvatlas("index", "stats", "--json", "--sample", "0", "--run-dir", str(run_dir))
        assert st.returncode == 0, st.stderr
        doc = json.loads(st.stdout)
        assert [s["endpoint"] for s in doc["index_shards"]] == state.index_etcd
        assert sorted(s["instances"] for s in doc["index_shards"]) == [0, 1]
        row = next(r for r in doc["instances"] if r["instance_id"] == "prefill-0")
        assert row["blocks"] > 0
        with urllib.request.urlopen(state.router["url"] + "/readiness", timeout=5) as r:
            index = json.loads(r.read())["index"]
        assert [s["state"] for s in index["shards"]] == ["live", "live"]
        doc = kvatlas("doctor", "--run-dir", str(run_dir), "--json")
        assert doc.returncode == 0, doc.stdout + doc.stderr
        names = [link["name"] for link in json.loads(doc.stdout)]
        assert names[1:3] == ["index shard 0 reachable", "index shard 1 reachable"]
        state.process("etcd-index1").stop()
        doc = kvatlas("doctor", "--run-dir", str(run_dir))
        assert doc.returncode == 1 and "[FAIL] index shard 1 reachable" in doc.stdout
    finally:
        down = kvatlas("cluster", "down", "--run-dir", str(run_dir))
    assert down.returncode == 0, down.stderr
    assert _all_gone(state) == []
