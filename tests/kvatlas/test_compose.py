"""docker-compose.yml is the launcher's topology: same commands, same flags, nothing drifts."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvatlas.etcd_proc import COMPACTION_ARGS
from kvatlas.launcher.compose import compose_document, compose_topology, compose_yaml
from kvatlas.launcher.topology import SECRET_FLAGS, LocalNetwork, Service, normalized, process_args

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"


def _local_list() -> list[Service]:
    return compose_topology().services(LocalNetwork(data_root="/tmp/x"))


def test_committed_file_is_generated_from_the_topology() -> None:
    assert COMPOSE.read_text() == compose_yaml(), (
        "docker-compose.yml differs from the topology: regenerate it with "
        "`kvatlas cluster compose > docker-compose.yml`")


def test_compose_and_launcher_run_the_same_commands() -> None:
    doc = compose_document()
    local = {s.name: s for s in _local_list()}
    assert set(doc["services"]) == set(local) == {
        "etcd0", "etcd1", "etcd2", "prefill-0", "prefill-1", "decode-0", "router"}
    for name, svc in doc["services"].items():
        program, *args = svc["command"]
        if name.startswith("etcd"):
            assert program.endswith("etcd")
            for flag in COMPACTION_ARGS:
                assert flag in args, f"{name} lacks the compaction setting {flag}"
            assert [a.split("=")[0] for a in args] == [a.split("=")[0] for a in local[name].args]
        else:
            assert program == "kvatlas"
            argv, secrets = process_args(local[name])
            assert normalized(args) == normalized(argv), name
            # The same secrets, from the environment in both.
            assert set(svc.get("environment", {})) == set(secrets), name


def test_parsed_yaml_matches_the_topology() -> None:
    """The emitted YAML means what the document says (parsed by PyYAML, not by our emitter)."""
    try:
        import yaml
    except ImportError:
        pytest.fail("PyYAML is needed to parse docker-compose.yml: add 'pyyaml>=6' to the "
                    "test extra in pyproject.toml")
    parsed = yaml.safe_load(COMPOSE.read_text())
    doc = compose_document()
    assert parsed == doc
    local = {s.name: s for s in _local_list()}
    for name, svc in parsed["services"].items():
        if svc["command"][0] == "kvatlas":
            assert normalized(svc["command"][1:]) == normalized(process_args(local[name])[0])


def test_health_gates_and_loopback_publishing() -> None:
    doc = compose_document()
    for name, svc in doc["services"].items():
        assert "healthcheck" in svc, name
        for dep, cond in svc.get("depends_on", {}).items():
            assert cond == {"condition": "service_healthy"}, (name, dep)
    assert set(doc["services"]["router"]["depends_on"]) == {"prefill-0", "prefill-1", "decode-0"}
    assert set(doc["services"]["prefill-0"]["depends_on"]) == {"etcd0", "etcd1", "etcd2"}
    # Only the router is published, and only on the host's loopback.
    published = {n: s["ports"] for n, s in doc["services"].items() if "ports" in s}
    assert published == {"router": ["127.0.0.1:8000:8000"]}
    assert "/readiness" in " ".join(doc["services"]["router"]["healthcheck"]["test"])


def test_secrets_are_required_not_defaulted_and_kept_off_command_lines() -> None:
    services = compose_document()["services"]
    assert services["router"]["environment"]["KVATLAS_ADMIN_TOKEN"].startswith(
        "${KVATLAS_ADMIN_TOKEN:?")
    # Bootstrap writes are guarded: every prefill requires the token, every decode sends it.
    for name in ("prefill-0", "prefill-1", "decode-0"):
        args = services[name]["command"]
        token = services[name]["environment"]["KVATLAS_AUTH_TOKEN"]
        assert token.startswith("${KVATLAS_AUTH_TOKEN:?"), (name, token)
        # KV transfers are MAC'd with one key that every prefill and decode requires.
        key = services[name]["environment"]["KVATLAS_TRANSFER_KEY"]
        assert key.startswith("${KVATLAS_TRANSFER_KEY:?"), (name, key)
        # Peers dial the service name (etcd url, bootstrap host, rank_ip), not 0.0.0.0.
        assert args[args.index("--advertise-host") + 1] == name
    for name, svc in services.items():
        assert not SECRET_FLAGS & set(svc["command"]), name


def _compose_required() -> bool:
    """Under CI (and when asked) a missing docker-compose is a failure, never a skip."""
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes")
               for v in ("CI", "KVATLAS_REQUIRE_COMPOSE"))


def test_docker_compose_config_validates() -> None:
    tool = shutil.which("docker-compose")
    if tool is None:
        if _compose_required():
            pytest.fail("docker-compose is not installed: .ci/run installs it with apt-get")
        pytest.skip("docker-compose is not installed (CI installs it); the YAML is still "
                    "checked by the other tests")
    env = {**os.environ, "KVATLAS_AUTH_TOKEN": "test-token-1", "KVATLAS_ADMIN_TOKEN": "admin-token-1",
           "KVATLAS_TRANSFER_KEY": "transfer-key-0123456789"}
    out = subprocess.run([tool, "-f", str(COMPOSE), "config", "--services"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) == set(compose_document()["services"])
    # Without the secrets compose refuses to start instead of running with a default token.
    env.pop("KVATLAS_ADMIN_TOKEN")
    out = subprocess.run([tool, "-f", str(COMPOSE), "config"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "KVATLAS_ADMIN_TOKEN" in out.stderr
    env["KVATLAS_ADMIN_TOKEN"] = "admin-token-1"
    env.pop("KVATLAS_AUTH_TOKEN")
    out = subprocess.run([tool, "-f", str(COMPOSE), "config"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "KVATLAS_AUTH_TOKEN" in out.stderr


def test_every_generated_command_parses_with_the_real_cli() -> None:
    """The flags the topology writes exist in the commands it runs (engine, router)."""
    from kvatlas.cli import build_parser
    parser = build_parser()
    for name, svc in compose_document()["services"].items():
        program, *args = svc["command"]
        if program != "kvatlas":
            continue
        args = ["secret-token-1" if a.startswith("${") else a for a in args]
        parsed = parser.parse_args(args)
        assert callable(parsed.func), name


def _without_tools(tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH has bash and coreutils' ``id`` but no docker-compose or apt-get."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("bash", "id"):
        found = shutil.which(name)
        assert found, name
        (bin_dir / name).symlink_to(found)
    return {"PATH": str(bin_dir), "HOME": str(tmp_path)}


def test_ci_fails_loudly_when_docker_compose_cannot_be_installed(tmp_path: Path) -> None:
    run = (ROOT / ".ci" / "run").read_text()
    assert ".ci/install-compose" in run and "warning" not in run
    out = subprocess.run(["bash", str(ROOT / ".ci" / "install-compose")],
                         env=_without_tools(tmp_path), capture_output=True, text=True, timeout=60)
    assert out.returncode != 0, "CI went on without docker-compose"
    assert "docker-compose" in out.stderr and "error" in out.stderr


def test_compose_check_fails_under_ci_without_docker_compose(tmp_path: Path) -> None:
    env = {**_without_tools(tmp_path), "CI": "true"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"{Path(__file__)}::test_docker_compose_config_validates"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "1 failed" in out.stdout and "skipped" not in out.stdout, out.stdout[-2000:]
