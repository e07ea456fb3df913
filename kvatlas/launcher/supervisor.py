"""Start, watch and stop a topology's processes on this machine.

Each process runs in its own session (so a Ctrl-C in the terminal reaches only the launcher,
which then stops everything in order) and its own process group (so stopping an instance also
stops its rank children). Output goes to ``<run-dir>/logs/<name>.log``.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from index.keys import KeyLayout
from kvatlas.etcd_proc import find_etcd_binary
from kvatlas.launcher.etcd_auth import provision
from kvatlas.launcher.state import ClusterState, ProcessRecord, proc_start_time
from kvatlas.launcher.topology import (
    ENGINE_ROLES,
    SECRET_FLAGS,
    LocalNetwork,
    Service,
    Topology,
    process_args,
)

logger = logging.getLogger(__name__)

Progress = Callable[[str, str], None]
"""Called with (process name, event) while starting: "starting", "ready"."""


class StartError(RuntimeError):
    """A process did not come up; names it, why, and the log to read."""

    def __init__(self, name: str, reason: str, log: str) -> None:
        self.name, self.reason, self.log = name, reason, log
        tail = log_tail(log)
        super().__init__(f"{name} {reason}; see {log}" + (f" (last lines: {tail})" if tail else ""))


def log_tail(path: str, lines: int = 3) -> str:
    try:
        text = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(t.strip() for t in text[-lines:])


def http_status(url: str, timeout: float = 1.0) -> tuple[int, bytes]:
    """(status, body) of a GET; status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, ValueError):
        return 0, b""


def healthy(role: str, url: str, timeout: float = 1.0) -> bool:
    status, body = http_status(url, timeout)
    if role == "etcd":
        return status == 200 and b'"health":"true"' in body
    return status == 200


def redacted(cmd: list[str]) -> str:
    """The command line for logs and tables, with token and password values hidden."""
    out = list(cmd)
    for i, arg in enumerate(out[:-1]):
        if arg in SECRET_FLAGS:
            out[i + 1] = "***"
    return " ".join(out)


class LocalCluster:
    """A topology's processes on this host, recorded in ``<run_dir>/cluster.json``."""

    def __init__(self, topology: Topology, run_dir: Path, host: str = "127.0.0.1",
                 ports: dict[tuple[str, str], int] | None = None) -> None:
        self.topology = topology
        self.run_dir = Path(run_dir).resolve()
        self.log_dir = self.run_dir / "logs"
        self.net = LocalNetwork(listen_host=host, data_root=str(self.run_dir / "etcd"),
                                fixed=dict(ports or {}))
        self.services = topology.services(self.net)
        router = self.service("router")
        topo = asdict(topology)
        self.state = ClusterState(run_dir=str(self.run_dir), etcd=topology.etcd_endpoints(self.net),
                                  router={"url": router.url}, model=topology.model,
                                  topology=topo, supervisor_pid=os.getpid(),
                                  index_etcd=topology.index_etcd_endpoints(self.net))
        self._popen: dict[str, subprocess.Popen[bytes]] = {}

    def service(self, name: str) -> Service:
        for s in self.services:
            if s.name == name:
                return s
        raise KeyError(name)

    # --- starting --------------------------------------------------------------------------

    def command(self, svc: Service) -> tuple[list[str], dict[str, str]]:
        """(argv, secrets for the environment) of ``svc``'s process."""
        if svc.role == "etcd":
            return [find_etcd_binary(), *svc.args], {}
        argv, secrets = process_args(svc)
        return [sys.executable, "-m", "kvatlas", *argv], secrets

    def launch(self, svc: Service) -> ProcessRecord:
        """Start one process (again, for a restart: same command, same ports)."""
        self.log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        log_path = self.log_dir / f"{svc.name}.log"
        cmd, secrets = self.command(svc)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **secrets}
        with open(log_path, "ab") as log:
            log.write(f"--- {time.strftime('%H:%M:%S')} starting: {redacted(cmd)}\n".encode())
            log.flush()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                    cwd=self.run_dir)
        self._popen[svc.name] = proc
        rec = ProcessRecord(name=svc.name, role=svc.role, pid=proc.pid,
                            start_time=proc_start_time(proc.pid), command=cmd, url=svc.url,
                            health_url=svc.health_url, log=str(log_path),
                            ports={"http": svc.port, **svc.extra_ports})
        self.state.processes = [p for p in self.state.processes if p.name != svc.name] + [rec]
        self.state.save()
        return rec

    def wait_ready(self, names: list[str], timeout: float,
                   progress: Progress | None = None) -> None:
        pending = list(names)
        deadline = time.monotonic() + timeout
        while pending:
            for name in list(pending):
                svc = self.service(name)
                proc = self._popen.get(name)
                if proc is not None and proc.poll() is not None:
                    raise StartError(name, f"exited with code {proc.returncode}",
                                     str(self.log_dir / f"{name}.log"))
                if healthy(svc.role, svc.health_url):
                    pending.remove(name)
                    if progress:
                        progress(name, "ready")
            if not pending:
                return
            if time.monotonic() > deadline:
                name = pending[0]
                svc = self.service(name)
                status, body = http_status(svc.health_url)
                why = f"answered {status}: {body[:300].decode(errors='replace')}" if status \
                    else "did not answer"
                raise StartError(name, f"not ready after {timeout:.0f}s ({svc.health_url} {why})",
                                 str(self.log_dir / f"{name}.log"))
            time.sleep(0.1)

    def start(self, timeout: float = 120.0, progress: Progress | None = None) -> ClusterState:
        """Start every process in dependency order; on failure stop what started and raise."""
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        deadline = time.monotonic() + timeout
        stages = [[s.name for s in self.services if s.role == "etcd"],
                  [s.name for s in self.services if s.role in ENGINE_ROLES],
                  ["router"]]
        try:
            for names in stages:
                for name in names:
                    if progress:
                        progress(name, "starting")
                    self.launch(self.service(name))
                self.wait_ready(names, max(1.0, deadline - time.monotonic()), progress)
                if names and self.service(names[0]).role == "etcd":
                    self.provision_etcd()
        except BaseException:
            self.stop()
            raise
        return self.state

    def provision_etcd(self) -> None:
        """Users, roles and auth on every embedded etcd (main and index shards) before any
        other process dials them (``kvatlas.launcher.etcd_auth``)."""
        auth = self.topology.etcd_auth
        if auth is None:
            return
        layout = KeyLayout(prefix=self.topology.etcd_client.prefix)
        clusters = [self.state.etcd] if self.topology.etcd_names() else []
        for endpoints in [*clusters, *self.state.index_etcd]:
            provision(endpoints, auth, layout)

    # --- faults and stopping ---------------------------------------------------------------

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal one process's group (fault injection) and reap it."""
        rec = self.state.process(name)
        rec.signal_group(sig)
        proc = self._popen.get(name)
        if proc is not None:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                rec.signal_group(signal.SIGKILL)
                proc.wait()

    def restart(self, name: str, timeout: float = 60.0) -> ProcessRecord:
        """Start a stopped process again with its recorded command and ports; wait for it."""
        rec = self.launch(self.service(name))
        self.wait_ready([name], timeout)
        return rec

    def stop(self) -> None:
        """Stop everything, router first and etcd last, so instances revoke their leases."""
        stop_processes(self.state)
        for proc in self._popen.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._popen.clear()


def stop_processes(state: ClusterState, timeout: float = 10.0) -> list[str]:
    """Stop a recorded cluster's processes in reverse start order; the names that were running."""
    order = {"router": 0, "decode": 1, "aggregated": 1, "prefill": 2, "etcd": 3}
    stopped = []
    for rec in sorted(state.processes, key=lambda p: order.get(p.role, 1)):
        if rec.alive():
            stopped.append(rec.name)
        rec.stop(timeout)
    return stopped
