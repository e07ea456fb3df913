"""The workers' limits, so that the router refuses what they would refuse (an over-long prompt:
400 naming the limit, before a worker sees it; an over-large body: 413) instead of sending it on.

A model's prompt limit is the smallest of ``--max-prompt-tokens`` and what its workers take;
a model none of whose workers states one takes its tokenizer's ``model_max_length`` less one
instead (``--max-prompt-tokens`` still bounds it). The body limit is the smallest any worker
takes (``--max-payload-size`` bounds it anyway). A worker states them in its etcd instance
record or its ``/server_info`` (asked once per worker by the health checks):
``max_prompt_tokens``, else ``context_length - 1`` (SGLang and the reference engine refuse a
prompt of ``context_length`` tokens: one position is left to generate into), and
``max_body_bytes``.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

FLAG = "router --max-prompt-tokens"


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
    def model(self) -> str | None: ...

    @property
    def limits(self) -> Stated: ...


def stated_limits(info: Any, instance_id: str) -> Stated:
    """The limits a worker states in ``info`` (its /server_info or etcd record)."""
    if not isinstance(info, dict):
        return Stated()
    prompt = body = None
    n = info.get("max_prompt_tokens")
    c = info.get("context_length")
    if n.__class__ is int and n >= 1:
        prompt = Limit(n, f"max_prompt_tokens of worker {instance_id}")
    elif c.__class__ is int and c >= 2:
        prompt = Limit(c - 1, f"context_length {c} of worker {instance_id}, less the position "
                              "to generate into")
    b = info.get("max_body_bytes")
    if b.__class__ is int and b >= 1:
        body = Limit(b, f"max_body_bytes of worker {instance_id}")
    return Stated(prompt, body)


def _smallest(limits: list[Limit]) -> Limit | None:
    return min(limits, key=lambda lim: lim.value) if limits else None


class WorkerLimits:
    """Per model, the smallest prompt limit among its workers and the flag; the smallest body
    limit of all.

    Read by parser threads (large bodies are parsed off the event loop): ``prompt`` reads one
    dict that ``rebuild`` replaces whole, never changes in place."""

    def __init__(self, max_prompt_tokens: int | None) -> None:
        self.flag = Limit(max_prompt_tokens, FLAG) if max_prompt_tokens is not None else None
        self._prompt: dict[str | None, Limit] = {}
        self._stated: frozenset[str | None] = frozenset()
        """Models (None: a request naming none) some worker states a prompt limit for."""
        self.body: Limit | None = None
        """The smallest body limit a worker states (None: none does)."""

    def prompt(self, model: str | None, tokenizer: HasMaxLength | None = None) -> Limit | None:
        """The prompt limit for a request naming ``model`` (None: whichever worker serves);
        when no worker states one, ``tokenizer``'s ``max_length`` stands in for them."""
        by_model = self._prompt
        key = model if model in by_model else None
        found = by_model.get(key, self.flag)
        if tokenizer is None or tokenizer.max_length is None or key in self._stated:
            return found
        n = tokenizer.max_length
        if n < 2:
            return found
        own = Limit(n - 1, f"model_max_length {n} of tokenizer {tokenizer.name}, less the "
                           "position to generate into")
        return own if found is None or own.value < found.value else found

    def rebuild(self, workers: Iterable[StatesLimits]) -> None:
        stated = [(w.model, w.limits) for w in workers]
        prompts = [(m, s.prompt) for m, s in stated if s.prompt is not None]
        by_model: dict[str | None, Limit] = {}
        stated_for: set[str | None] = set()
        # None: a request naming no model may land on any worker; a worker of no stated
        # model may serve any model.
        for model in {None, *(m for m, _ in prompts if m is not None)}:
            found = [lim for m, lim in prompts if model is None or m in (model, None)]
            if found:
                stated_for.add(model)
            smallest = _smallest(found + ([self.flag] if self.flag is not None else []))
            if smallest is not None:
                by_model[model] = smallest
        self._stated = frozenset(stated_for)
        self._prompt = by_model
        self.body = _smallest([s.body for _, s in stated if s.body is not None])
