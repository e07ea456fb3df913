"""Continuous batching: a FIFO queue, a token budget per step, prefill chunks and decode tokens in
one forward.

Admission reserves every page a request can ever need (prompt plus ``max_new_tokens``) minus the
pages its cached prefix supplies, so a running request never stalls for memory and the queue can
never deadlock. A request that does not fit now waits at the head of the queue (FIFO, so a large
request is not starved by small ones); one that needs more pages than the pool has is refused
before it is queued (``CapacityError``, HTTP 503).

Disaggregation hooks (used by the PD workers): ``hold_pages`` keeps a finished prefill's pages
until its KV is sent (``release_held``); ``reserve`` + ``add_prefilled`` start a decode from KV
written into reserved pages by page id.

Not thread-safe by design: one thread (the engine's single worker) calls every method.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.errors import CapacityError
from engine.model import SeqChunk, Transformer
from engine.prefix_cache import PrefixCache
from engine.sampling import SamplingParams, TextStream, banned_ids, make_generator, sample
from tokenization.base import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class Request:
    """One generation request and its state in the engine."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    gen: torch.Generator = field(init=False)
    stream: TextStream = field(init=False)
    """Set by the scheduler that takes the request (its tokenizer detokenizes and stops)."""
    table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    computed: int = 0
    cached_tokens: int = 0
    hold_pages: bool = False
    """Keep the pages when the request finishes (a prefill whose KV is still to be sent);
    ``Scheduler.release_held`` gives them back."""
    cacheable: bool = True
    """Store this request's full blocks in the prefix cache (False for KV that arrived from a
    prefill instance)."""
    finish_reason: dict[str, object] | None = None
    arrived: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.gen = make_generator(self.params.seed)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def in_prefill(self) -> bool:
        return self.computed < len(self.prompt)


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    rid: str
    new_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: dict[str, object] | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    error: str | None = None


@dataclass
class StepStats:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    seconds: float = 0.0


class Scheduler:
    """Owns the model, the pool (via the prefix cache) and every request's state.

    ``tokenizer`` (default: the byte tokenizer) decides what ends a request (its EOS ids, stop
    strings in its text) and which ids are never sampled; every TP rank of a group must use the
    same one, so that they all finish a request at the same step."""

    def __init__(self, model: Transformer, cache: PrefixCache, max_batch_tokens: int = 512,
                 max_running: int = 256, tokenizer: Tokenizer | None = None) -> None:
        if max_batch_tokens < 1 or max_running < 1:
            raise ValueError("max_batch_tokens and max_running must be >= 1")
        if tokenizer is None:
            from tokenization import ByteTokenizer

            tokenizer = ByteTokenizer()
        self.tokenizer = tokenizer
        self.banned = banned_ids(tokenizer, model.cfg.vocab_size)
        self.model = model
        self.cache = cache
        self.pool = cache.pool
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held: dict[str, list[int]] = {}
        self.last_step = StepStats()
        self.totals = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0,
                       "prefill_computed_tokens": 0, "requests": 0, "aborted": 0}

    # -- intake ----------------------------------------------------------------------------
    def pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        # the last generated token is never fed back, so it needs no KV slot
        return -(-(prompt_len + max_new_tokens - 1) // self.pool.page_size)

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise CapacityError when the request could never be admitted."""
        need = self.pages_needed(prompt_len, max_new_tokens)
        if need > self.pool.num_pages:
            raise CapacityError(need, self.pool.num_pages, self.pool.page_size)

    def add(self, req: Request) -> None:
        self.check_fits(len(req.prompt), req.params.max_new_tokens)
        req.stream = TextStream(req.params, self.tokenizer)
        self.waiting.append(req)

    def abort(self, rid: str) -> RequestOutput | None:
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                break
        else:
            for req in self.running:
                if req.rid == rid:
                    self.running.remove(req)
                    self.cache.release(req.table)
                    req.table = []
                    break
            else:
                return None
        self.totals["aborted"] += 1
        req.finish_reason = {"type": "abort", "message": "aborted"}
        return self._output(req, [], "", finished=True)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def flush_cache(self) -> int | None:
        """Drop all cached blocks when idle; None (nothing done) while requests are in flight."""
        if self.has_work or self.held:
            return None
        return self.cache.clear()

    # -- disaggregation hooks --------------------------------------------------------------
    def release_held(self, rid: str) -> bool:
        """Give back the pages a finished ``hold_pages`` request kept."""
        pages = self.held.pop(rid, None)
        if pages is None:
            return False
        self.cache.release(pages)
        return True

    def reserve(self, prompt_len: int, max_new_tokens: int) -> list[int] | None:
        """Pages for a request whose prompt KV will be written from outside (a decode instance
        receiving a prefill's KV): None when they are not free now; CapacityError when they
        never will be. Hand them to ``add_prefilled`` or ``release_reserved``."""
        self.check_fits(prompt_len, max_new_tokens)
        need = self.pages_needed(prompt_len, max_new_tokens)
        if need > self.cache.available():
            return None
        return self.cache.allocate(need)

    def release_reserved(self, pages: list[int]) -> None:
        self.cache.release(pages)

    def add_prefilled(self, req: Request, table: list[int], first_token: int) -> RequestOutput:
        """Start decoding ``req`` whose prompt K/V are already in ``table`` (from ``reserve``)
        and whose first output token was sampled by the prefill; returns that token's output."""
        if len(table) != self.pages_needed(len(req.prompt), req.params.max_new_tokens):
            raise ValueError(f"request {req.rid}: {len(table)} pages do not cover its prompt "
                             f"and output")
        req.table = list(table)
        req.computed = len(req.prompt)
        req.cacheable = False
        req.stream = TextStream(req.params, self.tokenizer)
        if not req.params.greedy:
            # the prefill drew the first token from this seed's stream; advance ours past that
            # draw (its consumption does not depend on the logits) so that seeded sampling
            # continues exactly as in one process
            sample(torch.zeros(self.model.cfg.vocab_size, dtype=torch.float64), req.params,
                   req.gen, self.banned)
        self.running.append(req)
        self.totals["requests"] += 1
        return self._emit(req, first_token)

    # -- stepping --------------------------------------------------------------------------
    def _admit(self) -> None:
        b = self.pool.page_size
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            hashes = self.cache.hashes(req.prompt) if self.cache.enabled else []
            # at least one prompt token must be computed to get the first logits
            usable = hashes[:(len(req.prompt) - 1) // b]
            matched = self.cache.match(usable)
            need = self.pages_needed(len(req.prompt), req.params.max_new_tokens) - len(matched)
            if need > self.cache.available():
                self.cache.release(matched)
                return
            req.table = matched + self.cache.allocate(need)
            req.hashes = list(usable[:len(matched)])
            req.computed = req.cached_tokens = len(matched) * b
            self.totals["prompt_tokens"] += len(req.prompt)
            self.totals["cached_tokens"] += req.cached_tokens
            self.totals["requests"] += 1
            self.waiting.popleft()
            self.running.append(req)

    def _plan(self) -> list[tuple[Request, int]]:
        budget = self.max_batch_tokens
        plan: list[tuple[Request, int]] = []
        for req in self.running:
            if not req.in_prefill and budget > 0:
                plan.append((req, 1))
                budget -= 1
        for req in self.running:
            if req.in_prefill and budget > 0:
                n = min(len(req.prompt) - req.computed, budget)
                plan.append((req, n))
                budget -= n
        return plan

    def step(self) -> list[RequestOutput]:
        """Admit what fits, run one batched forward, sample, retire finished requests."""
        self._admit()
        plan = self._plan()
        if not plan:
            return []
        t0 = time.perf_counter()
        chunks = []
        for req, n in plan:
            toks = req.tokens
            chunks.append(SeqChunk(toks[req.computed:req.computed + n], req.computed, req.table))
        try:
            logits = self.model.forward(chunks, self.pool).cpu()
        except Exception as exc:  # never let one bad batch kill the engine
            logger.exception("forward failed for %d requests", len(plan))
            return [self._fail(req, f"forward failed: {exc}") for req, _ in plan]
        outputs = []
        stats = StepStats(seconds=0.0)
        for (req, n), row in zip(plan, logits):
            if req.in_prefill:
                stats.prefill_tokens += n
            else:
                stats.decode_tokens += n
            token = None
            if req.computed + n >= len(req.prompt):
                # per request: one request's sampler failure must not touch the others, and a
                # request whose token was not produced must not look one position further on
                try:
                    token = sample(row, req.params, req.gen, self.banned)
                except Exception as exc:
                    logger.exception("sampling failed for request %s", req.rid)
                    outputs.append(self._fail(req, f"sampling failed: {exc}"))
                    continue
            req.computed += n
            self._commit_blocks(req)
            if token is None:
                continue
            try:
                outputs.append(self._emit(req, token))
            except Exception as exc:
                logger.exception("emitting a token failed for request %s", req.rid)
                outputs.append(self._fail(req, f"output failed: {exc}"))
        self.totals["prefill_computed_tokens"] += stats.prefill_tokens
        stats.seconds = time.perf_counter() - t0
        self.last_step = stats
        return outputs

    def _commit_blocks(self, req: Request) -> None:
        if not self.cache.enabled or not req.cacheable:
            return
        b = self.pool.page_size
        full = req.computed // b
        done = len(req.hashes)
        if full <= done:
            return
        toks = req.tokens[done * b:full * b]
        parent = req.hashes[-1] if req.hashes else None
        new = self.cache.hashes(toks, parent)
        self.cache.store(req.table, done, new, parent, toks)
        req.hashes.extend(new)

    def _emit(self, req: Request, token: int) -> RequestOutput:
        req.output.append(token)
        self.totals["generated_tokens"] += 1
        delta, stopped = req.stream.push(token)
        if stopped:
            req.finish_reason = {"type": "stop", "matched": req.stream.matched}
        elif len(req.output) >= req.params.max_new_tokens:
            delta += req.stream.finish()
            req.finish_reason = {"type": "length", "length": len(req.output)}
        finished = req.finish_reason is not None
        if finished:
            self.running.remove(req)
            if req.hold_pages:
                self.held[req.rid] = req.table
            else:
                self.cache.release(req.table)
            req.table = []
        return self._output(req, [token], delta, finished)

    def _fail(self, req: Request, message: str) -> RequestOutput:
        if req in self.running:
            self.running.remove(req)
            self.cache.release(req.table)
            req.table = []
        req.finish_reason = {"type": "abort", "message": message}
        return self._output(req, [], "", finished=True, error=message)

    def _output(self, req: Request, ids: list[int], delta: str, finished: bool,
                error: str | None = None) -> RequestOutput:
        return RequestOutput(rid=req.rid, new_ids=ids, text_delta=delta, finished=finished,
                             finish_reason=req.finish_reason, prompt_tokens=len(req.prompt),
                             cached_tokens=req.cached_tokens,
                             completion_tokens=len(req.output), error=error)
