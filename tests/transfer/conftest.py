"""Fixtures of the transfer tests: every behaviour test runs on the zmq and the fake backend."""
from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from transfer_helpers import Rig


@pytest.fixture(params=["zmq", "fake"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
async def rig(backend: str) -> AsyncIterator[Rig]:
    r = Rig(backend)
    try:
        yield r
    finally:
        await r.close()
