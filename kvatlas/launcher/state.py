"""The run directory of a local cluster: ``cluster.json`` (processes, ports, tokens) and logs.

``cluster.json`` is what other commands read to find the running cluster: ``etcd`` (the client
endpoints, ``host:port,...``), ``index_etcd`` (one ``host:port`` per index shard, if any) and
``router.url`` are stable keys (``kvatlas index``, ``route`` and
``generate`` read them). It holds the cluster's tokens, so the directory is 0700 and the file 0600.
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from index.etcd import EtcdSettings
from kvatlas.launcher.etcd_auth import user_name

STATE_FILE = "cluster.json"
STATE_VERSION = 1


def proc_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), or None.

    Stored with each pid so that ``cluster down`` never signals a recycled pid.
    """
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = text[text.rfind(")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def proc_rss(pid: int) -> int | None:
    """Resident set size in bytes, from /proc (None when the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class ProcessRecord:
    """One started process as recorded in cluster.json."""

    name: str
    role: str
    pid: int
    start_time: int | None
    command: list[str]
    url: str
    health_url: str
    log: str
    ports: dict[str, int] = field(default_factory=dict)

    def alive(self) -> bool:
        """True while the recorded process (same pid *and* start time) is running."""
        if self.start_time is None:
            return False
        state = _proc_state(self.pid)
        return state is not None and state != "Z" and proc_start_time(self.pid) == self.start_time

    def signal_group(self, sig: int) -> bool:
        """Signal the process group (the process and any rank children); False if gone."""
        if not self.alive():
            return False
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            return False
        except PermissionError:
            os.kill(self.pid, sig)
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the group, wait up to ``timeout``, then SIGKILL it."""
        if not self.signal_group(signal.SIGTERM):
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                break
            time.sleep(0.05)
        # Rank children may outlive their leader: the group gets a SIGKILL either way.
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _proc_state(pid: int) -> str | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()[0]


@dataclass
class ClusterState:
    """Everything ``cluster.json`` holds."""

    run_dir: str
    etcd: str
    router: dict[str, str]
    model: str
    topology: dict[str, Any]
    index_etcd: list[str] = field(default_factory=list)
    """The index shards' etcds (``--index-etcd``), when the cluster has any."""
    processes: list[ProcessRecord] = field(default_factory=list)
    supervisor_pid: int | None = None
    started_at: float = field(default_factory=time.time)
    version: int = STATE_VERSION

    def process(self, name: str) -> ProcessRecord:
        for p in self.processes:
            if p.name == name:
                return p
        raise KeyError(f"no process {name!r} in {self.run_dir}/{STATE_FILE}")

    def etcd_credentials(self, kind: str = "reader") -> tuple[str, str] | None:
        """(user, password) of ``kind`` on the embedded etcds (``etcd_auth.WRITES``); None when
        the cluster runs without etcd auth (an external etcd)."""
        auth = self.topology.get("etcd_auth")
        if not isinstance(auth, dict):
            return None
        try:
            return user_name(kind), str(auth["passwords"][kind])
        except (KeyError, TypeError):
            raise ValueError(f"{self.run_dir}/{STATE_FILE}: no etcd password for {kind!r}; "
                             "restart the cluster with this kvatlas") from None

    def etcd_settings(self, kind: str = "reader", timeout: float = 5.0,
                      shard: int | None = None) -> EtcdSettings:
        """How a ``kind`` client reaches the main etcd (``shard``: that index shard's)."""
        creds = self.etcd_credentials(kind)
        user, password = creds if creds else (None, None)
        endpoints = self.etcd if shard is None else self.index_etcd[shard]
        return EtcdSettings.from_text(endpoints, timeout=timeout, user=user, password=password)

    def by_role(self, role: str) -> list[ProcessRecord]:
        return [p for p in self.processes if p.role == role]

    def save(self) -> Path:
        run_dir = Path(self.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = run_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f, indent=2)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, run_dir: str | Path) -> ClusterState:
        path = Path(run_dir) / STATE_FILE
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no cluster in {run_dir}: {path} does not exist "
                                    "(start one with `kvatlas cluster up`)") from None
        except ValueError as exc:
            raise ValueError(f"{path} is not valid JSON ({exc}); remove the run dir after "
                             "stopping its processes") from None
        if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION:
            raise ValueError(f"{path} is not a kvatlas cluster state (version {STATE_VERSION})")
        procs = [ProcessRecord(**p) for p in doc.pop("processes", [])]
        return cls(processes=procs, **doc)
