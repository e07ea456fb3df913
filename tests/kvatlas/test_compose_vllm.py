"""``deploy/vllm/docker-compose.yml``: the committed file is the generator's output, compose
accepts it, and every kvatlas command line in it parses with the real CLI."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvatlas.launcher.compose_vllm import VllmTopology, vllm_compose_document, vllm_compose_yaml
from kvatlas.launcher.etcd_auth import KINDS, ROOT_USER, password_env

ROOT = Path(__file__).resolve().parents[2]
VLLM_COMPOSE = ROOT / "deploy" / "vllm" / "docker-compose.yml"
ETCD_PASSWORDS = {password_env(k): f"etcd-{k}-password" for k in (ROOT_USER, *KINDS)}


def _flag(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, (flag, argv)
    return argv[argv.index(flag) + 1]


def test_vllm_committed_file_is_generated_from_the_topology() -> None:
    assert VLLM_COMPOSE.read_text() == vllm_compose_yaml(), (
        "deploy/vllm/docker-compose.yml differs from the topology: regenerate it with "
        "`python -m kvatlas.launcher.compose_vllm > deploy/vllm/docker-compose.yml`")
    assert yaml.safe_load(VLLM_COMPOSE.read_text()) == vllm_compose_document()


def test_vllm_engines_and_sidecars_agree_on_block_size_and_events() -> None:
    from kvatlas.cli import build_parser
    services = vllm_compose_document()["services"]
    for i in range(2):
        engine = services[f"aggregated-{i}"]["command"]
        car = services[f"aggregated-{i}-sidecar"]["command"]
        assert "--enable-prefix-caching" in engine
        events = json.loads(_flag(engine, "--kv-events-config"))
        assert events["enable_kv_cache_events"] and events["endpoint"] == "tcp://*:5557"
        assert _flag(engine, "--block-size") == _flag(car, "--block-size") == \
            _flag(services["router"]["command"], "--block-size")
        assert _flag(car, "--kv-events") == f"tcp://aggregated-{i}:5557"
        assert _flag(car, "--topic") == events["topic"]
        parsed = build_parser().parse_args(car[car.index("sidecar"):])
        assert (parsed.engine, parsed.role) == ("vllm", "aggregated")
    with pytest.raises(ValueError, match="not both in one file"):
        VllmTopology(prefill=1, decode=1, aggregated=1)


def compose_config(path: Path) -> dict[str, Any]:
    """The services ``docker-compose config`` resolves from ``path`` with the required secrets
    set and the optional variables unset (skips where docker-compose is not installed)."""
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip("docker-compose is not installed (CI installs it)")
    env = {**os.environ, "KVATLAS_ADMIN_TOKEN": "admin-token-1", **ETCD_PASSWORDS}
    for var in ("KVATLAS_MODEL", "KVATLAS_TOKENIZER", "KVATLAS_IMAGE"):
        env.pop(var, None)
    out = subprocess.run([tool, "-f", str(path), "config"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)["services"]


def test_vllm_docker_compose_config_validates() -> None:
    resolved = compose_config(VLLM_COMPOSE)
    assert set(resolved) == set(vllm_compose_document()["services"])
    assert _flag(resolved["router"]["command"], "--tokenizer") == "Qwen/Qwen3-0.6B=qwen3"
    assert resolved["aggregated-0"]["command"][:2] == ["serve", "Qwen/Qwen3-0.6B"]
