"""etcd authentication of the etcds kvatlas starts itself (``cluster up``, ``docker-compose.yml``).

Without it, any local user who can reach the etcd port can write an instance record, for
example a decode whose URL is a capture server that then receives client bodies. So an embedded
etcd is provisioned before anything else starts: a ``root`` user (etcd requires it to enable
auth), and one user per kind of process (``kvatlas-<kind>``) whose role reads the whole key
prefix and writes only the key families that kind writes (``WRITES``, the one table both the
local launcher and compose use). The passwords are generated per cluster and kept in the run
state (``cluster.json``, 0600); each process gets its user as ``--etcd-user`` and its password
through the environment (``KVATLAS_ETCD_PASSWORD``), never on its command line.

Provisioning runs ``etcdctl`` (beside the etcd binary) with passwords on its stdin and the root
credentials in its environment, and it is idempotent: an etcd that already has auth on is left
alone, and a step that finds its user or role already there goes on.
"""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from index.agent_stats import stats_prefix
from index.keys import KeyLayout
from kvatlas.etcd_proc import EtcdBinaryNotFound, find_etcd_binary

logger = logging.getLogger(__name__)

ROOT_USER = "root"
KEY_FAMILIES: dict[str, Callable[[KeyLayout], bytes]] = {
    "instances": KeyLayout.instances_prefix,
    "ranks": lambda layout: layout.ranks_prefix(),
    "blocks": lambda layout: layout.blocks_prefix(),
    "stats": stats_prefix,
    "predictions": lambda layout: layout.predictions_prefix(),
}
"""The key prefixes a role may be given write access to, by name."""

WRITES: dict[str, tuple[str, ...]] = {
    # Instance record (also its id claim), rank table, block segments.
    "prefill": ("instances", "ranks", "blocks"),
    # Its instance record only.
    "decode": ("instances",),
    # Like a prefill, plus its KV-event ingestion counters.
    "sidecar": ("instances", "ranks", "blocks", "stats"),
    # `kvatlas index agent`: its record (source kv-events), blocks and counters.
    "agent": ("instances", "blocks", "stats"),
    # Its shared routing predictions; everything else it only reads.
    "router": ("predictions",),
    # CLI reads (instances, index, doctor, bootstrap show) and tests.
    "reader": (),
}
"""Each kind of process and the key families its role writes; every role reads the whole prefix."""

KINDS = tuple(WRITES)


def user_name(kind: str) -> str:
    """The etcd user (and role) of ``kind``."""
    if kind not in WRITES:
        raise ValueError(f"unknown etcd user kind {kind!r}; one of {', '.join(KINDS)}")
    return f"kvatlas-{kind}"


def password_env(kind: str) -> str:
    """The variable compose reads ``kind``'s password from (``root``: the root password)."""
    if kind != ROOT_USER:
        user_name(kind)
    return f"KVATLAS_ETCD_{kind.upper()}_PASSWORD"


@dataclass
class EtcdAuth:
    """The generated credentials of a cluster's embedded etcds."""

    root_password: str
    """Password of etcd's ``root`` user (provisioning only; no kvatlas process uses it)."""
    passwords: dict[str, str] = field(default_factory=dict)
    """Password of each kind's user (``user_name(kind)``), for every kind of ``WRITES``."""

    def __post_init__(self) -> None:
        missing = [k for k in KINDS if not self.passwords.get(k)]
        if not self.root_password or missing:
            raise ValueError("etcd auth needs a root password and one for each of "
                             f"{', '.join(KINDS)}; missing: {missing or ['root']}")
        # A password starting with "-" would read as a flag on etcdctl's or kvatlas's argv.
        if any(p.startswith("-") for p in (self.root_password, *self.passwords.values())):
            raise ValueError("etcd passwords must not start with '-'")

    @classmethod
    def generate(cls) -> EtcdAuth:
        return cls(secrets.token_hex(24), {k: secrets.token_hex(24) for k in KINDS})

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EtcdAuth:
        """From ``KVATLAS_ETCD_<KIND>_PASSWORD`` (compose's init step); names what is unset."""
        env = os.environ if env is None else env
        names = {k: password_env(k) for k in (ROOT_USER, *KINDS)}
        unset = [v for v in names.values() if not env.get(v)]
        if unset:
            raise ValueError(f"set {', '.join(unset)} (etcd passwords) in the environment")
        return cls(env[names[ROOT_USER]], {k: env[names[k]] for k in KINDS})

    @classmethod
    def compose_placeholders(cls) -> EtcdAuth:
        """``${VAR:?...}`` for every password: compose refuses to start without them."""
        def var(kind: str) -> str:
            return f"${{{password_env(kind)}:?set {password_env(kind)} (etcd {kind} password)}}"
        return cls(var(ROOT_USER), {k: var(k) for k in KINDS})

    def credentials(self, kind: str) -> tuple[str, str]:
        """(user, password) of ``kind``."""
        return user_name(kind), self.passwords[kind]


def read_prefix(layout: KeyLayout) -> bytes:
    """Everything kvatlas keeps under its prefix (``/v1/`` and ``/v2/`` alike)."""
    return f"{layout.prefix}/".encode()


def find_etcdctl_binary() -> str:
    """``KVATLAS_ETCDCTL_BIN``, else ``etcdctl`` beside the etcd binary, else on PATH."""
    env = os.environ.get("KVATLAS_ETCDCTL_BIN")
    if env:
        return env
    try:
        beside = Path(find_etcd_binary()).with_name("etcdctl")
    except EtcdBinaryNotFound:
        beside = None
    if beside is not None and os.access(beside, os.X_OK):
        return str(beside)
    on_path = shutil.which("etcdctl")
    if on_path:
        return on_path
    raise EtcdBinaryNotFound("no etcdctl to provision etcd auth: set KVATLAS_ETCDCTL_BIN or put "
                             "etcdctl on PATH (it ships with etcd)")


@dataclass(frozen=True)
class Step:
    """One etcdctl call of the provisioning."""

    args: tuple[str, ...]
    stdin: str | None = None
    """A password, given on stdin (``--interactive=false``) so that no argv carries it."""


def provision_steps(auth: EtcdAuth, layout: KeyLayout) -> list[Step]:
    """Roles, users and grants of ``WRITES`` under ``layout``, then ``auth enable``."""
    read = read_prefix(layout).decode()
    steps = [Step(("role", "add", ROOT_USER)),
             Step(("user", "add", ROOT_USER, "--interactive=false"), auth.root_password),
             Step(("user", "grant-role", ROOT_USER, ROOT_USER))]
    for kind, families in WRITES.items():
        user, password = auth.credentials(kind)
        steps += [Step(("role", "add", user)),
                  Step(("role", "grant-permission", user, "read", read, "--prefix"))]
        steps += [Step(("role", "grant-permission", user, "readwrite",
                        KEY_FAMILIES[f](layout).decode(), "--prefix")) for f in families]
        steps += [Step(("user", "add", user, "--interactive=false"), password),
                  Step(("user", "grant-role", user, user))]
    return [*steps, Step(("auth", "enable"))]


class ProvisionError(RuntimeError):
    """etcdctl refused a provisioning step; names the etcd, the step and etcdctl's answer."""


def _etcdctl(binary: str, endpoints: str, step: Step, env: dict[str, str],
             timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary, f"--endpoints={endpoints}", *step.args],
                          input=None if step.stdin is None else step.stdin + "\n",
                          capture_output=True, text=True, env=env, timeout=timeout)


def provision(endpoints: str, auth: EtcdAuth, layout: KeyLayout, etcdctl: str | None = None,
              timeout: float = 30.0) -> bool:
    """Provision the etcd at ``endpoints`` (``host:port[,...]``); False when auth was on already.

    Root's credentials go to etcdctl through ``ETCDCTL_USER`` (its environment, not ``ps``)."""
    binary = etcdctl or find_etcdctl_binary()
    env = {**os.environ, "ETCDCTL_DIAL_TIMEOUT": "5s"}
    env.pop("ETCDCTL_USER", None)
    as_root = {**env, "ETCDCTL_USER": f"{ROOT_USER}:{auth.root_password}"}
    status = _etcdctl(binary, endpoints, Step(("auth", "status")), as_root, timeout)
    if status.returncode == 0 and "Status: true" in status.stdout:
        logger.info("etcd %s already has auth enabled", endpoints)
        return False
    for step in provision_steps(auth, layout):
        done = _etcdctl(binary, endpoints, step, env, timeout)
        if done.returncode != 0 and "already" not in done.stderr:
            raise ProvisionError(f"etcd {endpoints}: `etcdctl {' '.join(step.args)}` failed: "
                                 f"{done.stderr.strip()[-500:]}")
    logger.info("etcd %s: auth enabled with users %s", endpoints,
                ", ".join(user_name(k) for k in KINDS))
    return True
