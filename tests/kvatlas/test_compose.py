"""docker-compose.yml is the launcher's topology: same commands, same flags, nothing drifts."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvatlas.etcd_proc import COMPACTION_ARGS
from kvatlas.launcher.compose import (
    ETCD_AUTH_SERVICE,
    compose_document,
    compose_topology,
    compose_yaml,
)
from kvatlas.launcher.etcd_auth import KINDS, ROOT_USER, password_env
from kvatlas.launcher.topology import SECRET_FLAGS, LocalNetwork, Service, normalized, process_args

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
ETCD_PASSWORDS = {password_env(k): f"etcd-{k}-password" for k in (ROOT_USER, *KINDS)}


def _local_list() -> list[Service]:
    return compose_topology().services(LocalNetwork(data_root="/tmp/x"))


def test_committed_file_is_generated_from_the_topology() -> None:
    assert COMPOSE.read_text() == compose_yaml(), (
        "docker-compose.yml differs from the topology: regenerate it with "
        "`kvatlas cluster compose > docker-compose.yml`")


def test_compose_and_launcher_run_the_same_commands() -> None:
    doc = compose_document()
    local = {s.name: s for s in _local_list()}
    # etcd-auth: compose's one-shot provisioning (cluster up provisions in-process).
    assert set(doc["services"]) - {ETCD_AUTH_SERVICE} == set(local) == {
        "etcd0", "etcd1", "etcd2", "prefill-0", "prefill-1", "decode-0", "router"}
    for name, svc in doc["services"].items():
        program, *args = svc["command"]
        if name == ETCD_AUTH_SERVICE:
            continue
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
        if svc["command"][0] == "kvatlas" and name != ETCD_AUTH_SERVICE:
            assert normalized(svc["command"][1:]) == normalized(process_args(local[name])[0])


def test_health_gates_and_loopback_publishing() -> None:
    doc = compose_document()
    for name, svc in doc["services"].items():
        assert "healthcheck" in svc or name == ETCD_AUTH_SERVICE, name
        for dep, cond in svc.get("depends_on", {}).items():
            want = "service_completed_successfully" if dep == ETCD_AUTH_SERVICE \
                else "service_healthy"
            assert cond == {"condition": want}, (name, dep)
    assert set(doc["services"]["router"]["depends_on"]) == {"prefill-0", "prefill-1", "decode-0",
                                                            ETCD_AUTH_SERVICE}
    assert set(doc["services"]["prefill-0"]["depends_on"]) == {"etcd0", "etcd1", "etcd2",
                                                               ETCD_AUTH_SERVICE}
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
           "KVATLAS_TRANSFER_KEY": "transfer-key-0123456789", **ETCD_PASSWORDS}
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
    env["KVATLAS_AUTH_TOKEN"] = "test-token-1"
    env.pop("KVATLAS_ETCD_DECODE_PASSWORD")
    out = subprocess.run([tool, "-f", str(COMPOSE), "config"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "KVATLAS_ETCD_DECODE_PASSWORD" in out.stderr


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
                          f"{Path(__file__)}::test_docker_compose_config_validates",
                          f"{Path(__file__)}::test_sglang_docker_compose_config_validates"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "2 failed" in out.stdout and "skipped" not in out.stdout, out.stdout[-2000:]


# --- In front of SGLang: deploy/sglang/docker-compose.yml -------------------------------------

SGLANG_COMPOSE = ROOT / "deploy" / "sglang" / "docker-compose.yml"
SIDECAR_FLAGS = {"--instance-id", "--role", "--engine-url", "--model", "--bootstrap-url",
                 "--kv-events", "--replay", "--topic", "--block-size", "--dp-size", "--tokenizer",
                 "--health-interval", "--unhealthy-grace", "--lease-ttl", "--etcd", "--etcd-prefix"}
"""The flags ``kvatlas sidecar`` takes (agreed with its implementation; the real parser is used
instead as soon as the command exists)."""


def _sglang_doc() -> dict:
    from kvatlas.launcher.compose_sglang import sglang_compose_document
    return sglang_compose_document()


def _flag(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, (flag, argv)
    return argv[argv.index(flag) + 1]


def test_sglang_committed_file_is_generated_from_the_topology() -> None:
    from kvatlas.launcher.compose_sglang import sglang_compose_yaml
    assert SGLANG_COMPOSE.read_text() == sglang_compose_yaml(), (
        "deploy/sglang/docker-compose.yml differs from the topology: regenerate it with "
        "`kvatlas cluster compose --engine sglang > deploy/sglang/docker-compose.yml`")
    import yaml
    assert yaml.safe_load(SGLANG_COMPOSE.read_text()) == _sglang_doc()


def test_cluster_compose_engine_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """``--engine kvatlas`` is the default and prints docker-compose.yml unchanged."""
    from kvatlas.cli import main
    from kvatlas.launcher.compose_sglang import sglang_compose_yaml
    for argv, expected in ((["cluster", "compose"], compose_yaml()),
                           (["cluster", "compose", "--engine", "kvatlas"], compose_yaml()),
                           (["cluster", "compose", "--engine", "sglang"], sglang_compose_yaml())):
        assert main(argv) == 0
        assert capsys.readouterr().out == expected, argv
    assert compose_yaml() == COMPOSE.read_text()
    with pytest.raises(SystemExit):
        main(["cluster", "compose", "--engine", "vllm"])


def test_sglang_topology_services_and_shared_parts() -> None:
    services = _sglang_doc()["services"]
    assert list(services) == ["etcd0", "etcd1", "etcd2", "prefill-0", "prefill-0-sidecar",
                              "prefill-1", "prefill-1-sidecar", "decode-0", "decode-0-sidecar",
                              "router", ETCD_AUTH_SERVICE]
    # etcd is built by the same code as docker-compose.yml's, byte for byte.
    kvatlas_services = compose_document()["services"]
    for name in ("etcd0", "etcd1", "etcd2"):
        assert services[name] == kvatlas_services[name]
    # The router too: the same command but for the model and its tokenizer, plus the policy and
    # the block size.
    model = "${KVATLAS_MODEL:-Qwen/Qwen3-0.6B}"
    router = services["router"]["command"]
    assert router[-6:] == ["--tokenizer", f"{model}=${{KVATLAS_TOKENIZER:-qwen3}}",
                           "--policy", "kv_aware", "--block-size", "16"]
    base = kvatlas_services["router"]["command"]
    assert base[-2] == "--tokenizer"
    base_model = _flag(base, "--model")
    assert router[:-6] == [model if a == base_model else a for a in base[:-2]]
    assert services["router"]["environment"] == kvatlas_services["router"]["environment"]
    # It waits for etcd, not for the engines' minutes of loading: it finds them in etcd.
    assert services["router"]["depends_on"] == {
        **{e: {"condition": "service_healthy"} for e in ("etcd0", "etcd1", "etcd2")},
        **{s: {"condition": "service_started"}
           for s in ("prefill-0-sidecar", "prefill-1-sidecar", "decode-0-sidecar")},
        ETCD_AUTH_SERVICE: {"condition": "service_completed_successfully"}}
    # Only the router is published, and only on the host's loopback.
    published = {n: s["ports"] for n, s in services.items() if "ports" in s}
    assert published == {"router": ["127.0.0.1:8000:8000"]}


def test_sglang_engines_and_sidecars_agree() -> None:
    """Page size = block size everywhere, the events endpoint is the sidecar's own host, the
    bootstrap URL is the prefill's bootstrap port: each mismatch would index nothing."""
    services = _sglang_doc()["services"]
    for name in ("prefill-0", "prefill-1", "decode-0"):
        engine, side = services[name], services[f"{name}-sidecar"]
        role = name.split("-")[0]
        cmd, scmd = engine["command"], side["command"]
        assert cmd[:3] == ["python3", "-m", "sglang.launch_server"]
        assert engine["image"].startswith("lmsysorg/sglang:v0.5.")
        assert _flag(cmd, "--disaggregation-mode") == role
        assert _flag(cmd, "--page-size") == _flag(scmd, "--block-size") == "16"
        assert _flag(cmd, "--host") == "0.0.0.0" and _flag(cmd, "--port") == "30000"
        assert "--enable-metrics" in cmd
        assert engine["deploy"]["resources"]["reservations"]["devices"] == [
            {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
        assert engine["ipc"] == "host"
        # Passed through only when set (no empty HF_TOKEN, no MC_FORCE_TCP unless asked).
        assert engine["environment"] == ["HF_TOKEN", "MC_FORCE_TCP"]
        assert "hf-cache:/root/.cache/huggingface" in engine["volumes"]
        assert "http://127.0.0.1:30000/health" in " ".join(engine["healthcheck"]["test"])
        assert engine["hostname"] == name and side["hostname"] == f"{name}-sidecar"
        assert scmd[:2] == ["kvatlas", "sidecar"]
        assert _flag(scmd, "--instance-id") == name and _flag(scmd, "--role") == role
        assert _flag(scmd, "--engine-url") == f"http://{name}:30000"
        assert _flag(scmd, "--model") == _flag(cmd, "--model-path")
        assert _flag(scmd, "--etcd") == "etcd0:2379,etcd1:2379,etcd2:2379"
        # The sidecar waits for its engine itself (binding its socket before the engine
        # publishes); it has no healthcheck of its own (it serves no HTTP).
        assert "healthcheck" not in side
        assert side["depends_on"] == {**{e: {"condition": "service_healthy"}
                                         for e in ("etcd0", "etcd1", "etcd2")},
                                      name: {"condition": "service_started"},
                                      ETCD_AUTH_SERVICE: {
                                          "condition": "service_completed_successfully"}}
        assert "depends_on" not in engine
        if role == "prefill":
            assert _flag(cmd, "--disaggregation-bootstrap-port") == "8998"
            assert _flag(scmd, "--bootstrap-url") == f"http://{name}:8998"
            config = json.loads(_flag(cmd, "--kv-events-config"))
            # A concrete host (the sidecar's own hostname): the engine connects, the sidecar binds.
            assert config == {"publisher": "zmq", "endpoint": f"tcp://{name}-sidecar:5557",
                              "topic": "kv"}
            assert _flag(scmd, "--kv-events") == config["endpoint"]
            assert _flag(scmd, "--topic") == config["topic"]
        else:
            # Decodes are not indexed and have no bootstrap server.
            for flag in ("--disaggregation-bootstrap-port", "--kv-events-config"):
                assert flag not in cmd
            for flag in ("--bootstrap-url", "--kv-events", "--topic"):
                assert flag not in scmd
    for svc in services.values():
        for dep, cond in svc.get("depends_on", {}).items():
            if cond == {"condition": "service_healthy"}:
                assert "healthcheck" in services[dep], f"{dep} is waited on but has no healthcheck"


def test_sglang_topology_scales_tp_and_attention_dp() -> None:
    from kvatlas.launcher.compose_sglang import SGLangTopology, sglang_compose_document
    from kvatlas.launcher.topology import LocalNetwork
    doc = sglang_compose_document(SGLangTopology(prefill=1, decode=1, etcd_members=1,
                                                 prefill_tp=4, prefill_dp=2, decode_tp=2))
    prefill, decode = doc["services"]["prefill-0"], doc["services"]["decode-0"]
    assert _flag(prefill["command"], "--tp-size") == "4"
    assert _flag(prefill["command"], "--dp-size") == "2" and "--enable-dp-attention" in \
        prefill["command"]
    assert _flag(doc["services"]["prefill-0-sidecar"]["command"], "--dp-size") == "2"
    assert prefill["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 4
    assert decode["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 2
    with pytest.raises(ValueError, match="multiple of its DP"):
        SGLangTopology(prefill_tp=3, prefill_dp=2)
    with pytest.raises(ValueError, match="page size"):
        SGLangTopology(page_size=0)
    # On one host (LocalNetwork) the endpoint is loopback, still a concrete host the sidecar binds.
    local = SGLangTopology(prefill=1).services(LocalNetwork(fixed={("prefill-0-sidecar",
                                                                    "kv_events"): 5557}))
    side = next(s for s in local if s.name == "prefill-0-sidecar")
    assert _flag(side.args, "--kv-events") == "tcp://127.0.0.1:5557"


def test_sglang_kvatlas_commands_parse() -> None:
    """The router's flags parse with the real CLI; the sidecars' too once ``kvatlas sidecar``
    exists, until then they must be among the flags agreed for it."""
    from kvatlas.cli import build_parser
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, svc in _sglang_doc()["services"].items():
        program, *args = svc["command"]
        if program != "kvatlas":
            continue
        if args[0] == "sidecar" and "sidecar" not in commands.choices:
            flags = {a for a in args if a.startswith("--")}
            assert flags <= SIDECAR_FLAGS, (name, flags - SIDECAR_FLAGS)
            continue
        parsed = parser.parse_args(args)
        assert callable(parsed.func), name


def test_sglang_docker_compose_config_validates() -> None:
    tool = shutil.which("docker-compose")
    if tool is None:
        if _compose_required():
            pytest.fail("docker-compose is not installed: .ci/run installs it with apt-get")
        pytest.skip("docker-compose is not installed (CI installs it); the YAML is still "
                    "checked by the other tests")
    env = {**os.environ, "KVATLAS_ADMIN_TOKEN": "admin-token-1", **ETCD_PASSWORDS}
    for var in ("KVATLAS_MODEL", "KVATLAS_TOKENIZER", "KVATLAS_IMAGE"):
        env.pop(var, None)
    out = subprocess.run([tool, "-f", str(SGLANG_COMPOSE), "config", "-q"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([tool, "-f", str(SGLANG_COMPOSE), "config"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    import yaml
    resolved = yaml.safe_load(out.stdout)["services"]
    assert set(resolved) == set(_sglang_doc()["services"])
    # The defaults compose fills in: the model, and the router's tokenizer for it.
    assert _flag(resolved["router"]["command"], "--tokenizer") == "Qwen/Qwen3-0.6B=qwen3"
    assert _flag(resolved["prefill-0"]["command"], "--model-path") == "Qwen/Qwen3-0.6B"
    assert resolved["router"]["image"] == "kvatlas:latest"
    # Without the admin token compose refuses to start instead of running with a default one.
    env.pop("KVATLAS_ADMIN_TOKEN")
    out = subprocess.run([tool, "-f", str(SGLANG_COMPOSE), "config", "-q"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "KVATLAS_ADMIN_TOKEN" in out.stderr


def test_aggregated_compose_file_validates(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`kvatlas cluster compose --aggregated 2` alone: two aggregated services registered in
    etcd (and no PD instances), gated on etcd and its users, which docker-compose accepts."""
    from kvatlas.cli import main

    assert main(["cluster", "compose", "--aggregated", "2"]) == 0
    text = capsys.readouterr().out
    services = compose_document(compose_topology(0, 0, 2))["services"]
    assert text == compose_yaml(compose_topology(0, 0, 2))
    engines = {n for n in services if n.startswith(("prefill", "decode", "aggregated"))}
    assert engines == {"aggregated-0", "aggregated-1"}
    for name in engines:
        cmd = services[name]["command"]
        assert cmd[cmd.index("--mode") + 1] == "monolithic" and "--etcd" in cmd
        assert cmd[cmd.index("--advertise-host") + 1] == name
        assert services[name]["depends_on"]["etcd-auth"] == {
            "condition": "service_completed_successfully"}
    assert set(services["router"]["depends_on"]) >= engines
    tool = shutil.which("docker-compose")
    if tool is None:
        if _compose_required():
            pytest.fail("docker-compose is not installed: .ci/run installs it with apt-get")
        pytest.skip("docker-compose is not installed (CI installs it)")
    path = tmp_path / "docker-compose.yml"
    path.write_text(text)
    env = {**os.environ, "KVATLAS_AUTH_TOKEN": "test-token-1",
           "KVATLAS_ADMIN_TOKEN": "admin-token-1",
           "KVATLAS_TRANSFER_KEY": "transfer-key-0123456789", **ETCD_PASSWORDS}
    out = subprocess.run([tool, "-f", str(path), "config", "--services"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) == set(services)
