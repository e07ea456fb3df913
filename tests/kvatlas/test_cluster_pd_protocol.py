"""``kvatlas cluster up|compose --pd-protocol``: the prefill and decode engines serve the protocol
(their command lines, the compose file's too), SGLang's bootstrap stays the default with the
lines it always had, and a real ``cluster up --pd-protocol vllm-push`` serves requests that the
router drives as vLLM PD pairs."""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kvatlas.cli import build_parser
from kvatlas.commands.cluster import topology_from_args
from kvatlas.etcd_proc import free_port
from kvatlas.launcher.compose import compose_document, compose_topology
from kvatlas.launcher.state import ClusterState
from kvatlas.launcher.topology import LocalNetwork, Topology

pytestmark = pytest.mark.timeout(120)


def _protocol_of(args: list[str]) -> str | None:
    return args[args.index("--pd-protocol") + 1] if "--pd-protocol" in args else None


@pytest.mark.parametrize("protocol", ["vllm", "vllm-pull", "vllm-push"])
def test_up_starts_the_pd_engines_in_the_protocol(protocol: str, tmp_path: Path) -> None:
    args = build_parser().parse_args(["cluster", "up", "--pd-protocol", protocol,
                                      "--run-dir", str(tmp_path)])
    services = topology_from_args(args).services(LocalNetwork(data_root="/tmp/x"))
    got = {s.name: _protocol_of(s.args) for s in services if s.role != "etcd"}
    assert got == {"prefill-0": protocol, "prefill-1": protocol, "decode-0": protocol,
                   "router": None}, got  # the router reads each pair's from its records


def test_sglang_is_the_default_and_adds_no_flag(tmp_path: Path) -> None:
    args = build_parser().parse_args(["cluster", "up", "--run-dir", str(tmp_path)])
    assert args.pd_protocol == "sglang"
    services = topology_from_args(args).services(LocalNetwork(data_root="/tmp/x"))
    assert not [s.name for s in services if "--pd-protocol" in s.args]


def test_the_compose_file_carries_the_protocol() -> None:
    doc = compose_document(compose_topology(1, 1, pd_protocol="vllm-push"))
    got = {name: _protocol_of(svc["command"]) for name, svc in doc["services"].items()
           if name.startswith(("prefill", "decode"))}
    assert got == {"prefill-0": "vllm-push", "decode-0": "vllm-push"}, got
    out = subprocess.run([sys.executable, "-m", "kvatlas", "cluster", "compose", "--prefill",
                          "1", "--decode", "1", "--pd-protocol", "vllm"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count('- "--pd-protocol"\n      - "vllm"\n') == 2, out.stdout


@pytest.mark.parametrize("argv", [
    ["cluster", "up", "--engine-mode", "monolithic", "--pd-protocol", "vllm", "--run-dir"],
    ["cluster", "up", "--aggregated", "1", "--pd-protocol", "vllm-push", "--run-dir"],
    ["cluster", "up", "--pd-protocol", "vllm-pul", "--run-dir"],
    ["cluster", "compose", "--engine", "sglang", "--pd-protocol", "vllm"],
])
def test_a_protocol_without_pd_engines_is_a_cli_error(argv: list[str], tmp_path: Path) -> None:
    if argv[-1] == "--run-dir":
        argv = [*argv, str(tmp_path)]
    out = subprocess.run([sys.executable, "-m", "kvatlas", *argv], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert "--pd-protocol" in out.stderr, out.stderr


def test_topology_refuses_a_vllm_protocol_without_pd_engines() -> None:
    with pytest.raises(ValueError, match="--pd-protocol vllm is the protocol of prefill"):
        Topology(engine_mode="monolithic", pd_protocol="vllm")
    with pytest.raises(ValueError, match="PD protocol must be"):
        Topology(pd_protocol="nixl")


def test_a_vllm_push_cluster_serves_through_the_router(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    up = subprocess.run([sys.executable, "-m", "kvatlas", "cluster", "up", "--prefill", "1",
                         "--decode", "1", "--model", "tiny", "--pd-protocol", "vllm-push",
                         "--detach", "--router-port", str(free_port()), "--run-dir",
                         str(run_dir)], capture_output=True, text=True, timeout=100)
    assert up.returncode == 0, up.stderr
    try:
        state = ClusterState.load(run_dir)
        url = state.router["url"]
        body = json.dumps({"prompt": "a prompt through a vLLM push pair", "max_tokens": 3,
                           "temperature": 0}).encode()
        with urllib.request.urlopen(url + "/v1/completions", body, timeout=30) as r:
            doc = json.loads(r.read())
        assert doc["usage"]["completion_tokens"] == 3, doc
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert ('kvatlas_router_vllm_pd_requests_total{mode="push",params="given"} 1.0'
                in metrics), [m for m in metrics.splitlines() if "vllm_pd" in m]
    finally:
        down = subprocess.run([sys.executable, "-m", "kvatlas", "cluster", "down", "--run-dir",
                               str(run_dir)], capture_output=True, text=True, timeout=60)
        assert down.returncode == 0, down.stderr
