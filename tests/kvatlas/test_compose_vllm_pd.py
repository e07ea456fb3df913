"""``deploy/vllm/docker-compose.pd.yml`` and ``docker-compose.pd-push.yml``: each committed file
is the generator's output, compose accepts it, the engines' ``--kv-transfer-config`` and NIXL
side channel agree with their sidecars' flags, and every kvatlas command line parses with the
real CLI (the sidecar's own validation included)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_compose_vllm import ROOT, _flag, compose_config

from kvatlas.launcher.compose_vllm import (
    PD_FILES,
    VllmTopology,
    vllm_compose_document,
    vllm_pd_compose_topology,
    vllm_pd_compose_yaml,
)

MODES = sorted(PD_FILES)


def _path(mode: str) -> Path:
    return ROOT / "deploy" / "vllm" / PD_FILES[mode][1]


@pytest.mark.parametrize("mode", MODES)
def test_vllm_pd_committed_file_is_generated_from_the_topology(mode: str) -> None:
    arg, name = PD_FILES[mode]
    assert _path(mode).read_text() == vllm_pd_compose_yaml(mode), (
        f"deploy/vllm/{name} differs from the topology: regenerate it with "
        f"`python -m kvatlas.launcher.compose_vllm {arg} > deploy/vllm/{name}`")
    out = subprocess.run([sys.executable, "-m", "kvatlas.launcher.compose_vllm", arg], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == _path(mode).read_text(), out.stderr


@pytest.mark.parametrize("mode", MODES)
def test_vllm_pd_engines_and_sidecars_agree(mode: str) -> None:
    from kvatlas.cli import build_parser
    from sidecar.config import SidecarConfig

    services = vllm_compose_document(vllm_pd_compose_topology(mode))["services"]
    connector = {"vllm-pull": "NixlConnector", "vllm-push": "NixlPushConnector"}[mode]
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        engine = services[f"{role}-0"]
        car = services[f"{role}-0-sidecar"]["command"]
        transfer = json.loads(_flag(engine["command"], "--kv-transfer-config"))
        assert transfer == {"kv_connector": connector, "kv_role": kv_role,
                            "engine_id": f"{role}-0"}
        assert engine["image"].endswith(":v0.33.0")
        args = build_parser().parse_args(car[car.index("sidecar"):])
        assert (args.engine, args.role, args.pd_protocol) == ("vllm", role, mode)
        cfg = SidecarConfig.from_cli_args(args)  # the sidecar's own checks pass
        env = dict(e.split("=", 1) for e in engine["environment"] if "=" in e)
        if role == "prefill":
            # What the router tells a push decode is what the engine's side channel is.
            proto = cfg.pd_protocol
            assert proto is not None and proto.engine_id == transfer["engine_id"]
            assert (proto.host, str(proto.port)) == (env["VLLM_NIXL_SIDE_CHANNEL_HOST"],
                                                     env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
            assert "--kv-events-config" in engine["command"] and "--kv-events" in car
        else:
            # A decode's cache is not indexed: no events published, none subscribed.
            assert "--kv-events-config" not in engine["command"] and "--kv-events" not in car
    router = services["router"]["command"]
    assert "--etcd" in router and "--prefill" not in router and "--decode" not in router
    with pytest.raises(ValueError, match="pd_protocol must be one of"):
        VllmTopology(prefill=1, decode=1, aggregated=0, pd_protocol="sglang")


def test_the_generator_names_its_arguments() -> None:
    out = subprocess.run([sys.executable, "-m", "kvatlas.launcher.compose_vllm", "bogus"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "pd|pd-push" in out.stderr, out


@pytest.mark.parametrize("mode", MODES)
def test_vllm_pd_docker_compose_config_validates(mode: str) -> None:
    resolved = compose_config(_path(mode))
    assert set(resolved) == set(vllm_compose_document(vllm_pd_compose_topology(mode))
                                ["services"])
    assert resolved["prefill-0"]["command"][:2] == ["serve", "Qwen/Qwen3-0.6B"]
    assert resolved["prefill-0"]["environment"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "prefill-0"
