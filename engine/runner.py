"""Drives the scheduler from asyncio without blocking the event loop.

All engine state lives in one worker thread (a single-thread executor): every step, add, abort and
flush runs there, one after another, so the scheduler needs no locks. The event loop awaits one
step at a time (torch releases the GIL while it computes, so HTTP keeps being served) and hands
each step's outputs to the waiting requests' queues. KV events drained after each step go to an
optional sink (the ZMQ publisher) in the event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine.checkpoint import ModelSpec
from engine.config import ModelConfig
from engine.errors import DuplicateRequest
from engine.kv_pool import KVPool
from engine.model import Transformer
from engine.prefix_cache import PrefixCache
from engine.sampling import SamplingParams
from engine.scheduler import Request, RequestOutput, Scheduler
from index.events.types import KVEvent
from tokenization.base import Tokenizer

logger = logging.getLogger(__name__)

EventSink = Callable[[list[KVEvent]], None]


def load_model(spec: ModelSpec, device: str = "cpu", kv_heads: range | None = None
               ) -> tuple[Transformer, Tokenizer]:
    """The model of ``spec`` (its KV heads ``kv_heads``: a TP rank's shard; default all) with its
    weights, and its tokenizer (the byte tokenizer for a seeded config)."""
    from tokenization import load_tokenizer

    tok = load_tokenizer(spec.tokenizer_source)
    model = Transformer.from_spec(spec, device=device, kv_heads=kv_heads)
    if model.cfg.vocab_size < tok.vocab_size:
        logger.warning("model %s has %d embedding rows for a tokenizer of %d ids; ids past its "
                    "embedding are refused", spec.served_name, model.cfg.vocab_size,
                    tok.vocab_size)
    return model, tok


def build_scheduler(model_cfg: ModelConfig, num_pages: int, page_size: int = 16,
                    max_batch_tokens: int = 512, enable_prefix_cache: bool = True,
                    max_running: int = 256, model: Transformer | None = None,
                    device: str = "cpu", tokenizer: Tokenizer | None = None,
                    host_pages: int = 0) -> Scheduler:
    """A scheduler with a fresh pool and cache (pass ``model`` to share weights; default: the
    seeded weights of ``model_cfg``) whose requests ``tokenizer`` detokenizes (default: the
    byte tokenizer); ``host_pages``: the prefix cache's host tier, in blocks (0: none)."""
    model = model or Transformer(model_cfg, device=device)
    pool = KVPool(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim,
                  model_cfg.torch_dtype, num_pages, page_size, device=model.device)
    cache = PrefixCache(pool, enabled=enable_prefix_cache, host_pages=host_pages)
    return Scheduler(model, cache, max_batch_tokens=max_batch_tokens, max_running=max_running,
                     tokenizer=tokenizer)


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
        self._claims: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        # pages losing their last reference (``KVPool.unreferenced``): the count the engine
        # thread last reported, and the count the event loop knows, with the event its page
        # waiters sleep on (replaced at each report, so that every waiter sees it set)
        self._unreferenced_reported = 0
        self._unreferenced_known = 0
        self._pages_freed = asyncio.Event()

    @contextlib.contextmanager
    def claim(self, rids: Sequence[str]) -> Iterator[None]:
        """Hold ``rids`` as in flight for the block: a request (or batch) is refused whole with
        DuplicateRequest, before it touches any page, when one of its ids is claimed or still
        known to the engine, or appears twice in ``rids``.

        A PD half's request lives longer than its ``generate``: a decode's reservation and
        transfer come before it, a prefill's held pages and send after it. The claim covers that
        whole life, so that two requests under one id never share the scheduler's per-id state
        (held pages, reservations, aborts)."""
        seen: set[str] = set()
        for rid in rids:
            if rid in seen:
                raise DuplicateRequest(rid, within_batch=True)
            if rid in self._claims or rid in self._queues:
                raise DuplicateRequest(rid)
            seen.add(rid)
        self._claims |= seen
        try:
            yield
        finally:
            self._claims -= seen

    async def call(self, fn: Callable[..., object], *args: object) -> object:
        """Run ``fn(*args)`` in the engine thread, between steps (the only safe way to touch
        the scheduler, pool or cache from asyncio)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._in_thread, loop, fn, args)

    def _in_thread(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., object],
                   args: tuple[object, ...]) -> object:
        """Engine thread: ``fn(*args)``, then wake the page waiters if it freed pages. Told
        from here, not when the caller's await returns: a caller cancelled meanwhile never
        returns there, and its call may be the one that freed them."""
        try:
            return fn(*args)
        finally:
            freed = self.scheduler.pool.unreferenced
            if freed != self._unreferenced_reported:
                self._unreferenced_reported = freed
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                    loop.call_soon_threadsafe(self._report_freed, freed)

    def _report_freed(self, freed: int) -> None:
        # Posted only when the count moved, in order, and it only grows: always news.
        self._unreferenced_known = freed
        self._pages_freed.set()
        self._pages_freed = asyncio.Event()

    @property
    def freed_mark(self) -> int:
        """Engine thread: the pool's count of pages freed so far, to read in the same call as a
        page allocation that failed and hand to :meth:`wait_freed`."""
        return self.scheduler.pool.unreferenced

    async def wait_freed(self, mark: int, timeout: float) -> bool:
        """Wait until a page is freed (loses its last reference) after ``freed_mark`` read
        ``mark``: woken by the engine thread's call that freed it, not by polling. False when
        ``timeout`` seconds passed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._unreferenced_known <= mark:
            left = deadline - loop.time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._pages_freed.wait(), left)
        return True

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
                logger.exception("engine step failed")
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
            logger.exception("publishing %d KV events failed", n)
            return
        self.events_published += n

    async def generate(self, prompt: list[int], params: SamplingParams,
                       rid: str | None = None, hold_pages: bool = False
                       ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs; leaving the iterator early aborts it.

        ``hold_pages`` keeps the pages after the end (``scheduler.release_held(rid)`` in
        ``call``). Raises CapacityError before yielding when the request can never fit,
        DuplicateRequest when ``rid`` is already in flight (a caller holding ``claim(rid)`` may
        run it).
        """
        req = Request(rid or uuid.uuid4().hex, list(prompt), params, hold_pages=hold_pages)
        # closed explicitly: leaving this iterator early then aborts the request before
        # ``aclose`` returns, instead of whenever the garbage collector finalizes ``_run``
        async with contextlib.aclosing(self._run(req, lambda: self.scheduler.add(req))) as outs:
            async for out in outs:
                yield out

    async def generate_prefilled(self, req: Request, table: list[int], first_token: int
                                 ) -> AsyncIterator[RequestOutput]:
        """Decode ``req`` whose prompt K/V were written into ``table`` (from
        ``scheduler.reserve``), starting from the prefill's ``first_token``."""
        async with contextlib.aclosing(self._run(
                req, lambda: self.scheduler.add_prefilled(req, table, first_token))) as outs:
            async for out in outs:
                yield out

    async def _run(self, req: Request, submit: Callable[[], RequestOutput | None]
                   ) -> AsyncIterator[RequestOutput]:
        rid = req.rid
        if rid in self._queues:
            raise DuplicateRequest(rid)
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
            if finished or self._stopping:
                self._queues.pop(rid, None)
            else:
                # The id stays taken until the scheduler has dropped the request: freed sooner,
                # a new request under the same id could be queued first and be the one the
                # scheduler's abort-by-id finds, while this one ran on unowned.
                await asyncio.shield(asyncio.ensure_future(self._abort(rid, queue)))

    async def _abort(self, rid: str, queue: asyncio.Queue[RequestOutput]) -> None:
        try:
            await self.call(self.scheduler.abort, rid)
        except RuntimeError:  # executor already shut down
            pass
        finally:
            if self._queues.get(rid) is queue:
                del self._queues[rid]

    async def abort(self, rid: str) -> bool:
        out = await self.call(self.scheduler.abort, rid)
        if out is not None and (q := self._queues.get(rid)) is not None:
            q.put_nowait(out)  # type: ignore[arg-type]
        return out is not None

    async def flush_cache(self) -> int | None:
        n = await self.call(self.scheduler.flush_cache)
        self._publish(await self.call(self.scheduler.cache.drain_events))  # type: ignore[arg-type]
        return n  # type: ignore[return-value]
