"""Start paths that close what they opened when a later step fails.

A service starts in steps (a socket, an etcd client, a lease, background tasks, a listener).
When step 4 fails, steps 1 to 3 must be undone, in reverse order, or the process keeps a task
that renews a lease nobody uses, a bound port, or a ZMQ socket that blocks ``ctx.term()``::

    async with undo_on_failure() as undo:
        await client.connect()
        undo.push_async_callback(client.close)
        task = asyncio.create_task(session.run())
        undo.push_async_callback(cancel_and_wait, task)
        ...

If the block raises (a cancellation included), every undo registered so far runs, newest first,
and the error goes on. If it completes, the undos are dropped: what started now belongs to the
service, whose ``close()`` stops it. One mechanism for every start path (bootstrap server, index
agent, router, engine instances), so that none of them grows its own try/except ladder.
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator


@contextlib.asynccontextmanager
async def undo_on_failure() -> AsyncIterator[contextlib.AsyncExitStack]:
    """An ``AsyncExitStack`` that is unwound only when the block fails (see the module)."""
    async with contextlib.AsyncExitStack() as stack:
        yield stack
        stack.pop_all()  # success: the undos are dropped unrun
