"""Steady client traffic through the router, small probes of a running PD cluster, and the
monolithic reference its answers are checked against (a 200 with wrong tokens is a failure)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from waiting import wait_until

from engine.config import get_model_config
from engine.protocol import encode_text
from engine.runner import build_scheduler, run_to_completion
from engine.sampling import SamplingParams
from engine.scheduler import Request
from index.etcd import EtcdClient
from index.keys import KeyLayout
from index.segments import held_blocks
from kvatlas.launcher.state import ClusterState

SYSTEM = ("You are a careful assistant. Answer in one sentence, cite nothing, and be kind to the "
          "user whatever they ask. ")
LEASE_TTL = 3
"""Instance lease TTL of the fault clusters: faults show within seconds."""
HEALTH_INTERVAL = 1.0
"""Router health interval of the fault clusters."""
CLIENT_TIMEOUT = 30.0
"""A request that takes longer than this counts as hung."""
MAX_NEW = 4
"""Tokens generated per request (greedy, EOS ignored, so that the reference is exact)."""
MODEL = "tiny"
"""The fault clusters' model (the launcher's default)."""


def sampling() -> dict[str, Any]:
    return {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}


@dataclass
class Outcome:
    started: float
    elapsed: float
    status: int
    """HTTP status; 0 when the client saw no answer (hang or transport error)."""
    error: str | None
    clean: bool
    """200, or an error answer with a JSON ``error`` naming the problem."""
    prompt: str = ""
    tokens: list[int] | None = None
    """The answer's ``output_ids``."""


@dataclass
class Traffic:
    """Requests at a fixed rate until stopped; every outcome is recorded."""

    url: str
    rate: float = 8.0
    prefix: str = SYSTEM
    outcomes: list[Outcome] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def _one(self, session: aiohttp.ClientSession, n: int) -> None:
        t0 = time.monotonic()
        prompt = f"{self.prefix}Question {n}: what is {n} plus {n}?"
        body = {"text": prompt, "sampling_params": sampling()}
        try:
            async with session.post(f"{self.url}/generate", json=body) as resp:
                doc: Any = await resp.json(content_type=None)
                err = doc.get("error") if isinstance(doc, dict) else None
                clean = resp.status == 200 or isinstance(err, str)
                tokens = doc.get("output_ids") if isinstance(doc, dict) else None
                self.outcomes.append(Outcome(t0, time.monotonic() - t0, resp.status, err, clean,
                                             prompt, tokens))
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            self.outcomes.append(Outcome(t0, time.monotonic() - t0, 0, repr(exc), False, prompt))

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT)
        pending: set[asyncio.Task[None]] = set()
        async with aiohttp.ClientSession(timeout=timeout) as session:
            n = 0
            start = time.monotonic()
            while not self._stop.is_set():
                task = asyncio.create_task(self._one(session, n))
                pending.add(task)
                task.add_done_callback(pending.discard)
                n += 1
                delay = start + n / self.rate - time.monotonic()
                try:
                    await asyncio.wait_for(self._stop.wait(), max(0.0, delay))
                except TimeoutError:
                    pass
            if pending:
                await asyncio.wait(pending)

    def start(self) -> Traffic:
        self._task = asyncio.create_task(self._run())
        return self

    async def until_answered(self, n: int, during: str, since: float = 0.0) -> None:
        """Let the traffic run until ``n`` of the requests started at or after ``since`` (a
        time.monotonic()) have an outcome: a count of requests through a fault, not a duration
        (which a loaded machine would fill with fewer)."""
        def answered() -> int:
            return sum(o.started >= since for o in self.outcomes)

        await wait_until(lambda: answered() >= n, what=f"{n} requests answered {during}",
                         timeout=max(30.0, 4 * n / self.rate), interval=0.1,
                         detail=lambda: f"{answered()} answered")

    async def stop(self) -> list[Outcome]:
        self._stop.set()
        assert self._task is not None
        await self._task
        return self.outcomes

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status != 200]


async def get_json(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.get(url) as resp:
            return resp.status, await resp.json(content_type=None)


async def get_text(url: str, timeout: float = 5.0) -> tuple[int, str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.get(url) as resp:
            return resp.status, await resp.text()


async def route(router: str, prompt: str) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        async with s.post(f"{router}/debug/route", json={"text": prompt}) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()


async def generate(router: str, prompt: str, timeout: float = CLIENT_TIMEOUT) -> dict[str, Any]:
    """POST ``prompt``; the answer must be a 200 with the monolithic engine's tokens."""
    body = {"text": prompt, "sampling_params": sampling()}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.post(f"{router}/generate", json=body) as resp:
            doc = await resp.json(content_type=None)
            assert resp.status == 200, doc
    assert_reference_tokens([answered(prompt, doc)])
    return doc


def answered(prompt: str, doc: Any) -> Outcome:
    """A 200 answer to ``prompt``, as an outcome to check with ``assert_reference_tokens``."""
    tokens = doc.get("output_ids") if isinstance(doc, dict) else None
    return Outcome(0.0, 0.0, 200, None, True, prompt, tokens)


def reference_tokens(prompts: Iterable[str]) -> dict[str, list[int]]:
    """Greedy tokens of the one-process engine for each prompt: what PD must answer."""
    order = sorted(set(prompts))
    sched = build_scheduler(get_model_config(MODEL), num_pages=2048)
    reqs = [Request(f"ref{i}", encode_text(p, "text"), SamplingParams(**sampling()))
            for i, p in enumerate(order)]
    done = run_to_completion(sched, reqs)
    return {p: done[r.rid].output_ids for p, r in zip(order, reqs)}


def assert_reference_tokens(outcomes: Iterable[Outcome]) -> None:
    """Every answered request (status 200) carried the monolithic engine's tokens."""
    answered = [o for o in outcomes if o.status == 200]
    assert answered, "no request was answered"
    want = reference_tokens(o.prompt for o in answered)
    wrong = [(o.prompt, o.tokens, want[o.prompt]) for o in answered if o.tokens != want[o.prompt]]
    assert not wrong, f"{len(wrong)} of {len(answered)} answers differ from monolithic: {wrong[:3]}"


async def etcd_keys(state: ClusterState, instance_id: str) -> dict[str, int]:
    """How many instance, rank and block keys of ``instance_id`` etcd holds."""
    layout = KeyLayout()
    settings = state.etcd_settings(timeout=3.0)
    async with EtcdClient(settings) as client:
        inst = await client.get(layout.instance(instance_id))
        _, ranks = await client.get_prefix(layout.ranks_prefix(instance_id))
        _, blocks = await client.get_prefix(layout.blocks_prefix(state.model, instance_id))
    return {"instance": int(inst is not None), "ranks": len(ranks),
            "blocks": len(held_blocks(kv.value for kv in blocks))}


async def wait_for(predicate: Any, timeout: float, interval: float = 0.1, *, what: str) -> float:
    """``waiting.wait_until`` for an async predicate, returning the seconds it took (reported by
    the fault tests, never bounded: speed is bench/'s business); the AssertionError on timeout
    names ``what`` never happened."""
    t0 = time.monotonic()
    await wait_until(predicate, what=what, timeout=timeout, interval=interval)
    return time.monotonic() - t0
