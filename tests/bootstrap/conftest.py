"""Fixtures of the bootstrap tests."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from bootstrap_helpers import ServerProcess

from kvatlas.etcd_proc import free_port


@pytest.fixture
def server_process() -> Iterator[Callable[..., ServerProcess]]:
    """Factory of started, healthy server processes; each is killed after the test."""
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        proc = ServerProcess(list(args), free_port())
        started.append(proc)
        proc.wait_healthy()
        return proc

    yield start
    for proc in started:
        proc.stop()


