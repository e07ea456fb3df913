"""Fixtures: started stub workers, and a factory for a router client in front of them."""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from router_stubs import StubWorker, router_app, router_config


@pytest.fixture
async def stubs() -> AsyncIterator[Callable[[str, int], Awaitable[list[StubWorker]]]]:
    started: list[StubWorker] = []

    async def make(role: str, n: int = 1) -> list[StubWorker]:
        out = [await StubWorker(role, f"{role}{i}").start() for i in range(n)]
        started.extend(out)
        return out

    yield make
    for s in started:
        await s.stop()


@pytest.fixture
def make_router(aiohttp_client: Any) -> Callable[..., Awaitable[TestClient]]:
    async def make(prefills: list[StubWorker], decodes: list[StubWorker],
                   **kw: Any) -> TestClient:
        return await aiohttp_client(router_app(router_config(prefills, decodes, **kw)))

    return make


@pytest.fixture
async def register(etcd: Any, layout: Any) -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """Registers instance keys under leases; whatever is still registered is revoked after."""
    from etcd_instances import Instance
    made: list[Instance] = []

    async def make(instance_id: str, record: dict[str, Any]) -> Instance:
        inst = await Instance(etcd, layout, instance_id, record).start()
        made.append(inst)
        return inst

    yield make
    for inst in made:
        if inst.tasks:
            await inst.stop()
