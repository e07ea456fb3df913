"""Traces and offline bounds for ``bench/routing_quality.py``.

Traces are lists of :class:`Req` whose prompts are ASCII text (sent as ``text``, so every router
under test, sglang-router's text radix tree included, sees the same input). The engine and the
router both tokenize text as ``[BOS] + utf-8 bytes``, which :func:`prompt_tokens` reproduces.

Two sources:

- :func:`synthetic_trace`: seeded, reuse-heavy chat traffic. Several system-prompt groups; each
  conversation belongs to one group, and its turn *t* prompt is the system prompt, the previous
  turns (user text and an assistant reply) and the new user text. A bounded set of conversations
  is active at once and the next turn comes from a random active one, so turns of different
  conversations interleave (reuse distance > 1) the way chat traffic does.
- :func:`rounds_trace`: conversations taking their turns in rounds, no prefix shared between
  them: the reuse distance is the whole working set (the host-tier scenario).
- :func:`hot_prefix_trace`: a burst of prompts sharing one long prefix (the load-imbalance
  scenario).
- :func:`mooncake_trace`: Mooncake JSONL (``timestamp``, ``input_length``, ``output_length``,
  ``hash_ids``; one hash id per 512 tokens). Each hash id maps deterministically to
  ``block_chars`` characters, so requests that share leading hash ids share a text prefix; the
  input length is scaled by ``block_chars / 512`` and capped at ``max_chars`` (the tiny model's
  2048 positions), truncating from the end so shared prefixes stay shared.

:func:`replay` sends a trace through a router's ``/generate`` (``text``, greedy, streamed) at a
bounded concurrency in trace order; a request of a session waits until the session's previous
request has finished (a chat client sends turn *t+1* after reading turn *t*). It measures TTFT
as the time to the first streamed SSE event and sums the responses' ``meta_info.cached_tokens``.

Offline figures (all on the trace order, with the engine's block size and hashing):

- :func:`belady_bound` (*the oracle*): an upper bound on the prefix-cache hits of ANY routing
  over N instances of C pages each. Argument: at every moment the union of the N caches holds at
  most N*C blocks, gains exactly the blocks of each served request (the chosen instance stores
  them all) and loses blocks only by eviction, so it is a feasible schedule of ONE cache of
  N*C blocks over the flattened block-access sequence; a request's prefix hit on its instance
  is at most the number of its blocks present in that union. Belady's MIN maximizes the block
  hits of one cache over a known sequence, so its hit count bounds every router from above.
  (It also ignores that the engine recomputes at least the last prompt token, so it is loose by
  at most one block per request whose length is a multiple of the block size.)
- :func:`infinite_bound`: the longest prefix of each prompt seen in ANY earlier request
  (unbounded caches): what reuse the trace contains at all.
- :func:`simulate`: LRU caches of C pages per instance under a routing rule (``round_robin``, or
  ``greedy``: the longest cached prefix when it covers more than ``threshold`` of the prompt,
  else the instance with the fewest cached blocks, as sglang's cache_aware does but with exact
  knowledge of the caches). Not a bound, a reference: what a perfect-information prefix-affinity
  router gets on the same capacities, sequentially (no concurrency).
"""
from __future__ import annotations

import asyncio
import heapq
import json
import random
import statistics
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BOS_ID = 256
BLOCK = 16
MAX_POSITIONS = 2048

_WORDS = ("alpha beta gamma delta kernel cache route token block prefix decode prefill worker "
          "cluster etcd lease page tensor batch queue stream model index policy ratio system "
          "user assistant reply question answer budget latency window shard rank group vector "
          "matrix reduce gather scatter commit revision watch event store evict replay").split()


@dataclass(frozen=True)
class Req:
    rid: int
    text: str
    max_new_tokens: int
    session: str | None = None
    """Requests of one session run in order: each waits for the previous one to finish."""


def prompt_tokens(text: str) -> list[int]:
    return [BOS_ID, *text.encode("utf-8")]


def _words(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(_WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


def synthetic_trace(seed: int = 0, groups: int = 4, conversations: int = 18, turns: int = 5,
                    active: int = 6, system_chars: int = 400,
                    user_chars: tuple[int, int] = (90, 160),
                    reply_chars: int = 60, max_new_tokens: int = 6) -> list[Req]:
    """The seeded multi-turn, shared-system-prompt trace (see the module docstring)."""
    rng = random.Random(seed)
    systems = [f"<|system|>\nGroup {g}: " + _words(rng, system_chars) + "\n"
               for g in range(groups)]
    pending = list(range(conversations))
    history: dict[int, str] = {}
    left: dict[int, int] = {}
    live: list[int] = []
    reqs: list[Req] = []
    while pending or live:
        while pending and len(live) < active:
            c = pending.pop(0)
            live.append(c)
            history[c] = systems[c % groups]
            left[c] = rng.randint(max(2, turns - 2), turns + 1)
        c = rng.choice(live)
        user = f"<|user|>\nconv {c}: " + _words(rng, rng.randint(*user_chars)) + "\n"
        prompt = history[c] + user + "<|assistant|>\n"
        reqs.append(Req(len(reqs), prompt, max_new_tokens, session=f"conv-{c}"))
        history[c] = prompt + _words(rng, reply_chars) + "\n"
        left[c] -= 1
        if left[c] == 0 or len(history[c]) + 400 > MAX_POSITIONS - 64:
            live.remove(c)
    return reqs


def hot_prefix_trace(seed: int = 0, requests: int = 256, prefix_chars: int = 511,
                     suffix_chars: int = 24, max_new_tokens: int = 4) -> list[Req]:
    """A burst of ``requests`` prompts sharing one long prefix (32 blocks by default), each with
    a short suffix of its own: sent at once, they test whether a router spreads a hot prefix
    once queueing at its holder costs more than recomputing it elsewhere."""
    rng = random.Random(seed)
    prefix = "<|system|>\nHot prefix: " + _words(rng, prefix_chars)
    prefix = prefix[:prefix_chars]
    return [Req(i, f"{prefix}\nq{i}: " + _words(rng, suffix_chars), max_new_tokens)
            for i in range(requests)]

def rounds_trace(seed: int = 0, conversations: int = 36, turns: int = 4, opener_chars: int = 300,
                 user_chars: tuple[int, int] = (90, 160), reply_chars: int = 60,
                 max_new_tokens: int = 6) -> list[Req]:
    """Conversations that take their turns in rounds: every one takes turn *t* (in a shuffled
    order) before any takes turn *t+1*, and none shares a prefix with another. A
    conversation's reuse distance is then the whole working set: sized past the device pools
    but within device + host, its blocks are all evicted to the host tier between two of its
    turns, and only a router that credits host blocks finds it again."""
    rng = random.Random(seed)
    history = {c: f"<|system|>\nConversation {c} of the rounds trace: " + _words(rng, opener_chars)
               + "\n" for c in range(conversations)}
    reqs: list[Req] = []
    for _ in range(turns):
        order = list(range(conversations))
        rng.shuffle(order)
        for c in order:
            user = f"<|user|>\nconv {c}: " + _words(rng, rng.randint(*user_chars)) + "\n"
            prompt = history[c] + user + "<|assistant|>\n"
            if len(prompt) > MAX_POSITIONS - 64:
                continue
            reqs.append(Req(len(reqs), prompt, max_new_tokens, session=f"conv-{c}"))
            history[c] = prompt + _words(rng, reply_chars) + "\n"
    return reqs


def mooncake_trace(path: str | Path, block_chars: int = 64, max_chars: int = 1900,
                   max_new_tokens: int = 6, limit: int | None = None) -> list[Req]:
    """Requests of a Mooncake-format JSONL trace (see the module docstring)."""
    reqs: list[Req] = []
    cache: dict[int, str] = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            ids = [int(h) for h in row["hash_ids"]]
            for h in ids:
                if h not in cache:
                    r = random.Random(h * 1_000_003 + 17)
                    cache[h] = "".join(chr(r.randint(97, 122)) for _ in range(block_chars))
            text = "".join(cache[h] for h in ids)
            want = max(1, round(int(row["input_length"]) * block_chars / 512))
            text = text[:min(want, len(text), max_chars)] or "x"
            out = max(1, min(int(row.get("output_length", max_new_tokens)), max_new_tokens))
            reqs.append(Req(len(reqs), text, out))
            if limit is not None and len(reqs) >= limit:
                break
    return reqs


# --- replay -----------------------------------------------------------------------------------

async def closed_loop(reqs: Sequence[Req], concurrency: int, timeout: float,
                      one: Callable[[Any, Req], Awaitable[None]],
                      failed: Callable[[Req, Exception], None]) -> None:
    """Send ``reqs`` in trace order from ``concurrency`` clients (``one(session, req)``), a
    session's request only once its previous one finished (a chat client sends turn *t+1*
    after reading turn *t*); ``failed`` hears of a request whose call raised a timeout or an
    HTTP client error."""
    import aiohttp

    done: dict[int, asyncio.Event] = {r.rid: asyncio.Event() for r in reqs}
    prev: dict[int, int] = {}
    last_of: dict[str, int] = {}
    for r in reqs:
        if r.session is not None:
            if r.session in last_of:
                prev[r.rid] = last_of[r.session]
            last_of[r.session] = r.rid
    queue: asyncio.Queue[Req] = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)

    async def client(session: aiohttp.ClientSession) -> None:
        while True:
            try:
                r = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            if r.rid in prev:
                await done[prev[r.rid]].wait()
            try:
                await one(session, r)
            except (TimeoutError, aiohttp.ClientError) as exc:
                failed(r, exc)
            finally:
                done[r.rid].set()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))


async def replay(url: str | list[str], reqs: list[Req], concurrency: int,
                 timeout: float, api: str = "generate") -> dict[str, Any]:
    """Replay ``reqs`` through the router at ``url``; given several routers, request ``i`` goes
    to router ``i mod n``, so the turns of one conversation are sprayed across them.
    ``api``: ``generate`` (SGLang's body) or ``completions`` (OpenAI's ``/v1/completions``)."""
    import aiohttp

    urls = [url] if isinstance(url, str) else list(url)

    ttft: list[float] = []
    ttft_by_rid: dict[int, float] = {}
    e2e: list[float] = []
    errors: list[str] = []
    meta_cached = 0

    async def one(session: aiohttp.ClientSession, r: Req) -> None:
        nonlocal meta_cached
        body: dict[str, Any] = {"text": r.text, "stream": True, "sampling_params": {
            "max_new_tokens": r.max_new_tokens, "temperature": 0.0}}
        path = "/generate"
        if api == "completions":
            body = {"prompt": r.text, "stream": True, "max_tokens": r.max_new_tokens,
                    "temperature": 0.0}
            path = "/v1/completions"
        t0 = time.perf_counter()
        first = None
        last_meta: dict[str, Any] = {}
        async with session.post(f"{urls[r.rid % len(urls)]}{path}", json=body) as resp:
            if resp.status != 200:
                errors.append(f"{resp.status}: {(await resp.text())[:200]}")
                return
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    line = event.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    if first is None:
                        first = time.perf_counter() - t0
                    try:
                        last_meta = json.loads(data).get("meta_info") or last_meta
                    except ValueError:
                        pass
        if first is None:
            errors.append("no streamed event")
            return
        ttft.append(first)
        ttft_by_rid[r.rid] = round(1000 * first, 2)
        e2e.append(time.perf_counter() - t0)
        meta_cached += int(last_meta.get("cached_tokens") or 0)

    t0 = time.perf_counter()
    await closed_loop(reqs, concurrency, timeout, one,
                      lambda r, exc: errors.append(f"{type(exc).__name__}: {exc}"))
    wall = time.perf_counter() - t0

    def pct(xs: list[float], q: float) -> float | None:
        if not xs:
            return None
        xs = sorted(xs)
        return round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 2)

    return {"requests": len(reqs), "ok": len(ttft), "errors": len(errors),
            "error_samples": errors[:5], "wall_s": round(wall, 2),
            "ttft_p50_ms": pct(ttft, 0.5), "ttft_p90_ms": pct(ttft, 0.9),
            "e2e_p50_ms": pct(e2e, 0.5),
            "ttft_mean_ms": round(1000 * statistics.fmean(ttft), 2) if ttft else None,
            "meta_cached_tokens": meta_cached,
            "ttft_ms_by_rid": ttft_by_rid}
    # ttft_ms_by_rid: each answered request's TTFT (ms), for benches that split the trace


# --- offline figures ------------------------------------------------------------------------

def request_blocks(reqs: Sequence[Req], block: int = BLOCK) -> list[list[int]]:
    """Each request's chained full-block hashes, as the engine's prefix cache keys them."""
    from index.hashing import BASE_SEED, block_hashes

    return [block_hashes(prompt_tokens(r.text), block, BASE_SEED) for r in reqs]


def usable(blocks: list[int], n_tokens: int, block: int = BLOCK) -> int:
    """Blocks a request may take from cache: the engine computes at least its last token."""
    return min(len(blocks), (n_tokens - 1) // block)


def infinite_bound(reqs: Sequence[Req], block: int = BLOCK) -> int:
    seen: set[int] = set()
    hits = 0
    for r, blocks in zip(reqs, request_blocks(reqs, block)):
        u = usable(blocks, len(prompt_tokens(r.text)), block)
        m = 0
        while m < u and blocks[m] in seen:
            m += 1
        hits += m * block
        seen.update(blocks)
    return hits


def belady_bound(reqs: Sequence[Req], capacity_blocks: int, block: int = BLOCK) -> int:
    """Token hits of Belady's MIN with ``capacity_blocks`` over the flattened block accesses."""
    seq = [h for blocks in request_blocks(reqs, block) for h in blocks]
    inf = len(seq) + 1
    nxt = [inf] * len(seq)
    last: dict[int, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        nxt[i] = last.get(seq[i], inf)
        last[seq[i]] = i
    resident: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block); stale entries skipped
    hits = 0
    for i, h in enumerate(seq):
        if h in resident:
            hits += 1
        resident[h] = nxt[i]
        heapq.heappush(heap, (-nxt[i], h))
        while len(resident) > capacity_blocks:
            neg, victim = heapq.heappop(heap)
            if resident.get(victim) == -neg:
                del resident[victim]
    return hits * block


def simulate(reqs: Sequence[Req], instances: int, capacity_blocks: int, rule: str,
             block: int = BLOCK, threshold: float = 0.3) -> int:
    """Token hits of per-instance LRU caches under ``rule`` (``round_robin`` or ``greedy``)."""
    caches = [OrderedDict[int, None]() for _ in range(instances)]
    used = [0] * instances
    hits = 0
    for i, (r, blocks) in enumerate(zip(reqs, request_blocks(reqs, block))):
        u = usable(blocks, len(prompt_tokens(r.text)), block)

        def match(c: OrderedDict[int, None], u: int = u, blocks: list[int] = blocks) -> int:
            m = 0
            while m < u and blocks[m] in c:
                m += 1
            return m

        if rule == "round_robin":
            k = i % instances
        elif rule == "greedy":
            ms = [match(c) for c in caches]
            best = max(ms)
            if u and best / u > threshold:
                k = max(range(instances), key=lambda j: (ms[j], -used[j]))
            else:
                k = min(range(instances), key=lambda j: (len(caches[j]), used[j]))
        else:
            raise ValueError(f"unknown rule {rule!r}")
        used[k] += 1
        cache = caches[k]
        hits += match(cache) * block
        for h in blocks:
            cache[h] = None
            cache.move_to_end(h)
        # the engine releases a request's pages tail first: the head stays most recent
        for h in reversed(blocks):
            cache.move_to_end(h)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hits


def total_prompt_tokens(reqs: Sequence[Req]) -> int:
    return sum(len(prompt_tokens(r.text)) for r in reqs)


def distinct_blocks(reqs: Sequence[Req], block: int = BLOCK) -> int:
    return len({h for blocks in request_blocks(reqs, block) for h in blocks})
