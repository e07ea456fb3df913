"""Drives the scheduler from asyncio without blocking the event loop.

All engine state lives in one worker thread (a single-thread executor): every step, add, abort and
flush runs there, one after another, so the scheduler needs no locks. The event loop awaits one
step at a time (torch releases the GIL while it computes, so HTTP keeps being served) and hands
each step's outputs to the waiting requests' queues. KV events drained after each step go to an
optional sink (the ZMQ publisher) in the event loop.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine.config import ModelConfig
from engine.errors import BadRequest
from engine.kv_pool import KVPool
from engine.model import Transformer
from engine.prefix_cache import PrefixCache
from engine.sampling import SamplingParams
from engine.scheduler import Request, RequestOutput, Scheduler
from index.events.types import KVEvent

log = logging.getLogger(__name__)

EventSink = Callable[[list[KVEvent]], None]


def build_scheduler(model_cfg: ModelConfig, num_pages: int, page_size: int = 16,
                    max_batch_tokens: int = 512, enable_prefix_cache: bool = True,
                    max_running: int = 256, model: Transformer | None = None,
                    device: str = "cpu") -> Scheduler:
    """A scheduler with a fresh pool and cache (pass ``model`` to share weights)."""
    model = model or Transformer(model_cfg, device=device)
    pool = KVPool(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim,
                  model_cfg.torch_dtype, num_pages, page_size, device=model.device)
    cache = PrefixCache(pool, enabled=enable_prefix_cache)
    return Scheduler(model, cache, max_batch_tokens=max_batch_tokens, max_running=max_running)


@dataclass
class Completed:
    rid: str
    output_ids: list[int]
    text: str
    finish_reason: dict[str, object] | None
    cached_tokens: int


def run_to_completion(sched: Scheduler, requests: list[Request]) -> dict[str, Completed]:
    """Synchronously run ``requests`` (all queued at once) until every one finishes."""
    for req in requests:
        sched.add(req)
    done: dict[str, Completed] = {}
    by_id = {r.rid: r for r in requests}
    while len(done) < len(requests):
        for out in sched.step():
            if out.finished:
                r = by_id[out.rid]
                done[out.rid] = Completed(out.rid, list(r.output), r.stream.text,
                                          out.finish_reason, r.cached_tokens)
        if not sched.has_work and len(done) < len(requests):
            raise RuntimeError("scheduler idle with unfinished requests")
    return done


class AsyncEngine:
    """The scheduler behind an asyncio interface; ``start``/``stop`` bracket its lifetime."""

    def __init__(self, scheduler: Scheduler, event_sink: EventSink | None = None) -> None:
        self.scheduler = scheduler
        self.event_sink = event_sink
        self.events_published = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    async def call(self, fn: Callable[..., object], *args: object) -> object:
        """Run ``fn(*args)`` in the engine thread, between steps (the only safe way to touch
        the scheduler, pool or cache from asyncio)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="engine-loop")

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    async def _loop(self) -> None:
        while not self._stopping:
            if not self.scheduler.has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                outputs, events = await self.call(self._step)  # type: ignore[misc]
            except Exception:  # the loop must survive anything a step throws
                log.exception("engine step failed")
                await asyncio.sleep(0.05)
                continue
            for out in outputs:
                q = self._queues.get(out.rid)
                if q is not None:
                    q.put_nowait(out)
            self._publish(events)
            await asyncio.sleep(0)

    def _step(self) -> tuple[list[RequestOutput], list[KVEvent]]:
        outputs = self.scheduler.step()
        return outputs, self.scheduler.cache.drain_events()

    def _publish(self, events: list[KVEvent]) -> None:
        if not events or self.event_sink is None:
            return
        n = len(events)
        try:
            self.event_sink(events)
        except Exception:
            log.exception("publishing %d KV events failed", n)
            return
        self.events_published += n

    async def generate(self, prompt: list[int], params: SamplingParams,
                       rid: str | None = None, hold_pages: bool = False
                       ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs; leaving the iterator early aborts it.

        ``hold_pages`` keeps the pages after the end (``scheduler.release_held(rid)`` in
        ``call``). Raises CapacityError before yielding when the request can never fit,
        BadRequest when ``rid`` is already in flight.
        """
        req = Request(rid or uuid.uuid4().hex, list(prompt), params, hold_pages=hold_pages)
        async for out in self._run(req, lambda: self.scheduler.add(req)):
            yield out

    async def generate_prefilled(self, req: Request, table: list[int], first_token: int
                                 ) -> AsyncIterator[RequestOutput]:
        """Decode ``req`` whose prompt K/V were written into ``table`` (from
        ``scheduler.reserve``), starting from the prefill's ``first_token``."""
        async for out in self._run(
                req, lambda: self.scheduler.add_prefilled(req, table, first_token)):
            yield out

    async def _run(self, req: Request, submit: Callable[[], RequestOutput | None]
                   ) -> AsyncIterator[RequestOutput]:
        rid = req.rid
        if rid in self._queues:
            raise BadRequest("rid", f"request {rid!r} is already in flight")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[rid] = queue
        finished = False
        try:
            first = await self.call(submit)
            if isinstance(first, RequestOutput):
                queue.put_nowait(first)
            self._wake.set()
            while True:
                out = await queue.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished and not self._stopping:
                await asyncio.shield(self._abort(rid))

    async def _abort(self, rid: str) -> None:
        try:
            await self.call(self.scheduler.abort, rid)
        except RuntimeError:  # executor already shut down
            pass

    async def abort(self, rid: str) -> bool:
        out = await self.call(self.scheduler.abort, rid)
        if out is not None and (q := self._queues.get(rid)) is not None:
            q.put_nowait(out)  # type: ignore[arg-type]
        return out is not None

    async def flush_cache(self) -> int | None:
        n = await self.call(self.scheduler.flush_cache)
        self._publish(await self.call(self.scheduler.cache.drain_events))  # type: ignore[arg-type]
        return n  # type: ignore[return-value]
