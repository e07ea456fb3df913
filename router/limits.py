"""The workers' limits, so that the router refuses what no worker would take (an over-long
prompt: 400 naming the limit, before a worker sees it; an over-large body: 413) instead of
sending it on, and routes what some take only to those.

A worker states them in its etcd instance record or its ``/server_info`` (asked once per worker
by the health checks): ``max_prompt_tokens``, else ``context_length - 1`` (SGLang and the
reference engine refuse a prompt of ``context_length`` tokens: one position is left to generate
into), and ``max_body_bytes``.

Only the limits of workers that can serve count (ready and healthy; a starting or broken engine
refuses nothing): per role, the largest limit among them (a worker that states none takes any
body, and its tokenizer's ``model_max_length`` less one in prompt tokens), and a request must fit
one worker of each role, so the refusal bound is the smaller of the two roles'. A request under
it is routed only among the workers whose own limits it fits (``WorkerLimits.unfit``).
``--max-prompt-tokens`` bounds the prompt whatever the workers say, ``--max-payload-size`` the
body.

A stated limit no real worker could have (a prompt limit below the block size, a body limit
below ``MIN_BODY_BYTES``) is ignored as if unstated, logged once per worker and value, and shown
in ``kvatlas_router_worker_limit_ignored``.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sized
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)

FLAG = "router --max-prompt-tokens"
MIN_BODY_BYTES = 1024
"""A stated body limit below this is ignored: a minimal chat request with the bootstrap fields
the router adds does not fit in much less."""


@dataclass(frozen=True)
class Limit:
    """A bound (prompt tokens or body bytes), and where that number comes from."""

    value: int
    source: str

    def prompt_reason(self, tokens: str | int) -> str:
        return f"prompt has {tokens} tokens; at most {self.value} are taken ({self.source})"


@dataclass(frozen=True)
class Stated:
    """What one worker says it takes."""

    prompt: Limit | None = None
    body: Limit | None = None
    ignored: tuple[tuple[str, int], ...] = ()
    """(field, value) of each absurd limit it stated, ignored (``stated_limits``)."""


class HasMaxLength(Protocol):
    """What ``WorkerLimits.prompt`` reads of a tokenizer (``tokenization.Tokenizer``)."""

    @property
    def name(self) -> str: ...

    @property
    def max_length(self) -> int | None: ...


class StatesLimits(Protocol):
    """What ``WorkerLimits.rebuild`` reads of a worker (``router.workers.Worker``); a protocol,
    so that this module does not import the one that imports it."""

    @property
    def instance_id(self) -> str: ...

    @property
    def role(self) -> str: ...

    @property
    def model(self) -> str | None: ...

    @property
    def limits(self) -> Stated: ...

    @property
    def ready(self) -> bool: ...

    @property
    def healthy(self) -> bool: ...


def stated_limits(info: Any, instance_id: str, block_size: int = 1) -> Stated:
    """The limits a worker states in ``info`` (its /server_info or etcd record); an absurd one
    (a prompt limit under ``block_size`` tokens, a body limit under ``MIN_BODY_BYTES``) is
    left out and listed in ``ignored``."""
    if not isinstance(info, dict):
        return Stated()
    prompt = body = None
    ignored: list[tuple[str, int]] = []
    n = info.get("max_prompt_tokens")
    c = info.get("context_length")
    if n.__class__ is int and n >= 1:
        if n >= block_size:
            prompt = Limit(n, f"max_prompt_tokens of worker {instance_id}")
        else:
            ignored.append(("max_prompt_tokens", n))
    if prompt is None and c.__class__ is int and c >= 2:
        if c - 1 >= block_size:
            prompt = Limit(c - 1, f"context_length {c} of worker {instance_id}, less the "
                                  "position to generate into")
        else:
            ignored.append(("context_length", c))
    b = info.get("max_body_bytes")
    if b.__class__ is int and b >= 1:
        if b >= MIN_BODY_BYTES:
            body = Limit(b, f"max_body_bytes of worker {instance_id}")
        else:
            ignored.append(("max_body_bytes", b))
    return Stated(prompt, body, tuple(ignored))


def prefer(first: Stated, then: Stated) -> Stated:
    """``first``'s limits, ``then``'s where ``first`` states none; the ignored of both."""
    return Stated(first.prompt or then.prompt, first.body or then.body,
                  tuple(dict.fromkeys(first.ignored + then.ignored)))


def _smallest(limits: list[Limit]) -> Limit | None:
    return min(limits, key=lambda lim: lim.value) if limits else None


def _largest(limits: list[Limit]) -> Limit | None:
    return max(limits, key=lambda lim: lim.value) if limits else None


@dataclass(frozen=True)
class RoleBound:
    """What the workers of one role that can serve a model take in prompt tokens."""

    largest: Limit | None
    """The largest limit they state (None: none states one)."""
    complete: bool
    """Every one states one; else those that state none take their tokenizer's length."""


class WorkerLimits:
    """Per model, the longest prompt a worker of each role that can serve it takes (bounded by
    the flag); the largest body likewise; and each worker's own limits, to route a request only
    to those it fits.

    Read by parser threads (large bodies are parsed off the event loop): ``prompt`` reads one
    dict that ``rebuild`` replaces whole, never changes in place."""

    def __init__(self, max_prompt_tokens: int | None, block_size: int = 1) -> None:
        self.flag = Limit(max_prompt_tokens, FLAG) if max_prompt_tokens is not None else None
        self.block_size = block_size
        """Prompt limits below it are ignored (``stated_limits``)."""
        self._prompt: dict[str | None, tuple[RoleBound, ...]] = {}
        self.body: Limit | None = None
        """The largest body a worker of every role takes (None: one takes any)."""
        self._own: tuple[tuple[str, Stated], ...] = ()
        """(instance id, limits) of the workers that state one: ``unfit`` reads it."""
        self._noted: set[tuple[str, str, int]] = set()

    def stated(self, info: Any, instance_id: str) -> Stated:
        """``stated_limits`` with this router's block size."""
        return stated_limits(info, instance_id, self.block_size)

    def note_ignored(self, instance_id: str, stated: Stated) -> None:
        """Log each absurd limit of ``instance_id`` once (not per request nor per record
        write)."""
        for name, value in stated.ignored:
            if (instance_id, name, value) in self._noted:
                continue
            self._noted.add((instance_id, name, value))
            floor = (f"the block size {self.block_size}" if name != "max_body_bytes"
                     else f"{MIN_BODY_BYTES} bytes, a minimal request")
            logger.warning("worker %s states %s %d, below %s: ignored (requests are not "
                           "limited by it); fix the engine's settings or its record",
                           instance_id, name, value, floor)

    def forget(self, instance_id: str) -> None:
        self._noted = {k for k in self._noted if k[0] != instance_id}

    def prompt(self, model: str | None, tokenizer: HasMaxLength | None = None) -> Limit | None:
        """The prompt limit for a request naming ``model`` (None: whichever worker serves):
        the longest prompt some worker of each role takes; ``tokenizer``'s ``max_length``
        stands in for a worker that states none."""
        by_model = self._prompt
        roles = by_model.get(model if model in by_model else None, ())
        own = None
        if tokenizer is not None and tokenizer.max_length is not None \
                and tokenizer.max_length >= 2:
            n = tokenizer.max_length
            own = Limit(n - 1, f"model_max_length {n} of tokenizer {tokenizer.name}, less the "
                               "position to generate into")
        bounds: list[Limit] = [self.flag] if self.flag is not None else []
        for role in roles or (RoleBound(None, False),):
            bound = role.largest
            if not role.complete:
                # A worker that states none takes what its tokenizer encodes (or anything).
                bound = None if own is None else _largest([own, *([bound] if bound else [])])
            if bound is not None:
                bounds.append(bound)
        return _smallest(bounds)

    def rebuild(self, workers: Iterable[StatesLimits]) -> None:
        """Recompute from the (counted) ``workers``: only the ready and healthy ones' limits
        bound what the router takes; every one's limits keep a request from it (``unfit``)."""
        workers = list(workers)
        serving = [w for w in workers if w.ready and w.healthy]
        roles = sorted({w.role for w in serving})
        by_model: dict[str | None, tuple[RoleBound, ...]] = {}
        # None: a request naming no model may land on any worker; a worker of no stated
        # model may serve any model.
        for model in {None, *(w.model for w in serving if w.model is not None)}:
            bounds = []
            for role in roles:
                found = [w.limits.prompt for w in serving
                         if w.role == role and (model is None or w.model in (model, None))]
                if found:
                    stated = [lim for lim in found if lim is not None]
                    bounds.append(RoleBound(_largest(stated), len(stated) == len(found)))
            by_model[model] = tuple(bounds)
        self._prompt = by_model
        body: list[Limit] = []
        for role in roles:
            found = [w.limits.body for w in serving if w.role == role]
            if all(lim is not None for lim in found):
                body.append(_largest(found))  # type: ignore[arg-type]
        self.body = _smallest(body)
        self._own = tuple((w.instance_id, w.limits) for w in workers
                          if w.limits.prompt is not None or w.limits.body is not None)

    def unfit(self, prompts: Iterable[Sized], body_bytes: int) -> frozenset[str]:
        """The workers that state a limit a request of ``prompts`` (token ids; empty: not
        tokenized) in a body of ``body_bytes`` exceeds: it is not routed to them."""
        own = self._own
        if not own:
            return frozenset()
        prompt_tokens = max(map(len, prompts), default=0)
        return frozenset(
            iid for iid, s in own
            if (s.prompt is not None and prompt_tokens > s.prompt.value)
            or (s.body is not None and body_bytes > s.body.value))
