"""Fixtures: started stub workers, and a factory for a router client in front of them."""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from router_stubs import RouterClient, StubWorker, router_app, router_config


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
async def start_router() -> AsyncIterator[Callable[..., Awaitable[RouterClient]]]:
    """Starts routers for a test (``await start_router(config)``); all are closed after."""
    started: list[RouterClient] = []

    async def start(config: Any) -> RouterClient:
        client = await RouterClient(router_app(config)).start()
        started.append(client)
        return client

    yield start
    for client in started:
        await client.close()


@pytest.fixture
def make_router(start_router: Any) -> Callable[..., Awaitable[RouterClient]]:
    async def make(prefills: list[StubWorker], decodes: list[StubWorker],
                   **kw: Any) -> RouterClient:
        return await start_router(router_config(prefills, decodes, **kw))

    return make


@pytest.fixture
async def register(etcd: Any, layout: Any) -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """Registers instance keys under leases; whatever is still registered is revoked after.
    A record that says nothing of its tokenizer names the byte tokenizer, as the reference
    engine's do (pass ``"tokenizer": None`` for one that names none)."""
    from etcd_instances import Instance
    made: list[Instance] = []

    async def make(instance_id: str, record: dict[str, Any]) -> Instance:
        record = {"tokenizer": "byte", **record}
        inst = await Instance(etcd, layout, instance_id, record).start()
        made.append(inst)
        return inst

    yield make
    for inst in made:
        if inst.tasks:
            await inst.stop()
