"""etcd auth of the embedded etcd: a real etcd provisioned from ``etcd_auth.WRITES``, and a real
``cluster up`` whose etcd refuses a record from a local process without credentials."""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from index.errors import EtcdAuthError
from index.etcd import EtcdClient, EtcdSettings
from index.keys import KeyLayout
from kvatlas.etcd_proc import EtcdCluster, free_port
from kvatlas.launcher.compose import compose_document
from kvatlas.launcher.etcd_auth import (
    KEY_FAMILIES,
    KINDS,
    WRITES,
    EtcdAuth,
    password_env,
    provision,
    user_name,
)
from kvatlas.launcher.state import ClusterState
from kvatlas.launcher.topology import LocalNetwork, Topology, process_args

LAYOUT = KeyLayout()
FAKE_DECODE = json.dumps({"instance_id": "evil", "role": "decode",
                          "url": "http://127.0.0.1:9/capture"}).encode()


@pytest.fixture
def provisioned(tmp_path: Path) -> Iterator[tuple[str, EtcdAuth]]:
    auth = EtcdAuth.generate()
    with EtcdCluster(1, base_dir=tmp_path / "etcd") as cluster:
        assert provision(cluster.endpoints, auth, LAYOUT) is True
        yield cluster.endpoints, auth


def _settings(endpoints: str, auth: EtcdAuth | None, kind: str) -> EtcdSettings:
    user, password = auth.credentials(kind) if auth else (None, None)
    return EtcdSettings.from_text(endpoints, timeout=3.0, user=user, password=password)


async def test_each_kind_writes_only_its_key_families(
        provisioned: tuple[str, EtcdAuth]) -> None:
    endpoints, auth = provisioned
    for kind in KINDS:
        async with EtcdClient(_settings(endpoints, auth, kind)) as client:
            for family, prefix in KEY_FAMILIES.items():
                key = prefix(LAYOUT) + f"{kind}-probe".encode()
                if family in WRITES[kind]:
                    await client.put(key, b"x")
                    assert await client.delete(key) == 1
                else:
                    with pytest.raises(EtcdAuthError, match="permission denied"):
                        await client.put(key, b"x")
            # Every kind reads the whole prefix (records, blocks, other routers' predictions).
            await client.get_prefix(f"{LAYOUT.prefix}/".encode())
            # Nothing outside it, and no user administration.
            with pytest.raises(EtcdAuthError):
                await client.put(b"/elsewhere", b"x")


async def test_no_credentials_no_record_and_wrong_password_refused(
        provisioned: tuple[str, EtcdAuth]) -> None:
    endpoints, auth = provisioned
    async with EtcdClient(_settings(endpoints, None, "reader")) as anonymous:
        with pytest.raises(EtcdAuthError):
            await anonymous.put(LAYOUT.instance("evil"), FAKE_DECODE)
        with pytest.raises(EtcdAuthError):
            await anonymous.get(LAYOUT.instance("evil"))
    wrong = EtcdSettings.from_text(endpoints, timeout=3.0, user=user_name("decode"),
                                   password="not-the-password")
    with pytest.raises(EtcdAuthError):
        async with EtcdClient(wrong):
            pass


async def test_provisioning_again_leaves_auth_as_it_is(
        provisioned: tuple[str, EtcdAuth]) -> None:
    endpoints, auth = provisioned
    assert provision(endpoints, auth, LAYOUT) is False
    async with EtcdClient(_settings(endpoints, auth, "decode")) as client:
        await client.put(LAYOUT.instance("decode-0"), b"{}")


def test_local_processes_get_their_kind_user_and_the_password_only_in_env() -> None:
    topo = Topology(prefill=1, decode=1, model="tiny")
    assert topo.etcd_auth is not None
    kinds = {"prefill": "prefill", "decode": "decode", "router": "router"}
    for svc in topo.services(LocalNetwork()):
        if svc.role == "etcd":
            continue
        argv, env = process_args(svc)
        user, password = topo.etcd_auth.credentials(kinds[svc.role])
        assert argv[argv.index("--etcd-user") + 1] == user
        assert password not in argv and env["KVATLAS_ETCD_PASSWORD"] == password
    with pytest.raises(ValueError, match="external etcd"):
        Topology(etcd_client=Topology().etcd_client.__class__(user="u", password="p"))


def test_compose_provisions_auth_before_anything_dials_etcd() -> None:
    services = compose_document()["services"]
    init = services["etcd-auth"]
    assert set(init["environment"]) == {password_env(k) for k in ("root", *KINDS)}
    assert all(v.startswith("${KVATLAS_ETCD_") and ":?" in v for v in init["environment"].values())
    for name, svc in services.items():
        if name.startswith("etcd"):
            continue
        assert svc["depends_on"]["etcd-auth"] == {"condition": "service_completed_successfully"}
        assert svc["environment"]["KVATLAS_ETCD_PASSWORD"].startswith("${KVATLAS_ETCD_"), name


def kvatlas(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvatlas", *args], capture_output=True,
                          text=True, timeout=90)


@pytest.mark.timeout(120)
async def test_cluster_up_etcd_refuses_a_record_without_credentials(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    up = kvatlas("cluster", "up", "--prefill", "1", "--decode", "1", "--model", "tiny",
                 "--detach", "--router-port", str(free_port()), "--run-dir", str(run_dir))
    assert up.returncode == 0, up.stderr
    state = ClusterState.load(run_dir)
    try:
        # A local process without the run dir's credentials cannot forge a decode record.
        async with EtcdClient(EtcdSettings.from_text(state.etcd, timeout=3.0)) as anonymous:
            with pytest.raises(EtcdAuthError):
                await anonymous.put(LAYOUT.instance("evil"), FAKE_DECODE)
        # The CLI's read-only credentials read the records but cannot write one.
        async with EtcdClient(state.etcd_settings("reader", timeout=3.0)) as reader:
            _, records = await reader.get_prefix(LAYOUT.instances_prefix())
            assert {LAYOUT.parse_instance(kv.key) for kv in records} >= {"prefill-0", "decode-0"}
            with pytest.raises(EtcdAuthError, match="permission denied"):
                await reader.put(LAYOUT.instance("evil"), FAKE_DECODE)
        # The root password stays in the 0600 run state, out of every process's command line.
        root = state.topology["etcd_auth"]["root_password"].encode()
        for p in state.processes:
            assert root not in Path(f"/proc/{p.pid}/cmdline").read_bytes(), p.name
        # CLI reads find the cluster's credentials in the run dir.
        inst = kvatlas("instances", "--json", "--run-dir", str(run_dir))
        assert inst.returncode == 0, inst.stderr
        assert {r["instance_id"] for r in json.loads(inst.stdout)} == {"prefill-0", "decode-0"}
        show = kvatlas("bootstrap", "show", "prefill-0", "--json", "--run-dir", str(run_dir))
        assert show.returncode == 0, show.stderr
        # And the cluster serves end to end.
        body = json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 3,
                                                                    "ignore_eos": True}}).encode()
        with urllib.request.urlopen(state.router["url"] + "/generate", body, timeout=30) as r:
            assert json.loads(r.read())["meta_info"]["completion_tokens"] == 3
    finally:
        down = kvatlas("cluster", "down", "--run-dir", str(run_dir))
    assert down.returncode == 0, down.stderr
