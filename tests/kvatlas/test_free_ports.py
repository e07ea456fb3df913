"""Free loopback ports for tests and the local launcher: distinct, bindable, and taken from
below the kernel's ephemeral range, where no outgoing connection is given its source port."""
from __future__ import annotations

import contextlib
import socket
import sys

import pytest

from kvatlas import etcd_proc
from kvatlas.etcd_proc import PORT_FLOOR, free_ports


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's port range")
def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        first_ephemeral = int(f.read().split()[0])
    ports = free_ports(64)
    assert len(set(ports)) == 64
    assert all(PORT_FLOOR <= p < first_ephemeral for p in ports), ports
    with contextlib.ExitStack() as stack:
        for p in ports:
            stack.enter_context(socket.socket()).bind(("127.0.0.1", p))


class Scripted:
    """Stands in for the random picker: hands out the given ports in order."""

    def __init__(self, *ports: int) -> None:
        self.ports = list(ports)

    def randint(self, low: int, high: int) -> int:
        return self.ports.pop(0)


def test_a_port_in_use_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free = probe.getsockname()[1]
        monkeypatch.setattr(etcd_proc, "_below_ephemeral", lambda: (PORT_FLOOR, 65535))
        monkeypatch.setattr(etcd_proc, "_pick", Scripted(taken, taken, free))
        assert free_ports(1) == [free]


def test_a_span_with_nothing_free_falls_back_to_the_kernels_pick(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(etcd_proc, "_below_ephemeral", lambda: (taken, taken))
        monkeypatch.setattr(etcd_proc, "_pick", Scripted(*[taken] * 64))
        (port,) = free_ports(1)
        assert port != taken
        assert etcd_proc._pick.ports == []  # every try was spent on the span first
