"""Prompt-token limits, so that an over-long prompt is refused at the router (400 naming the
limit) before it is tokenized, hashed and sent to a worker that would refuse it anyway.

A model's limit is the smallest of ``--max-prompt-tokens`` and what its workers take. A worker
says so in its etcd instance record or its ``/server_info`` (asked once per worker by the health
checks): ``max_prompt_tokens`` when given, else ``context_length - 1`` (SGLang and the reference
engine refuse a prompt of ``context_length`` tokens: one position is left to generate into).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.workers import Worker

FLAG = "router --max-prompt-tokens"


@dataclass(frozen=True)
class PromptLimit:
    """The most prompt tokens a request may carry, and where that number comes from."""

    tokens: int
    source: str

    def reason(self, tokens: str | int) -> str:
        return f"prompt has {tokens} tokens; at most {self.tokens} are taken ({self.source})"


def prompt_limit_of(info: Any, instance_id: str) -> PromptLimit | None:
    """The limit a worker states in ``info`` (its /server_info or etcd record), if any."""
    if not isinstance(info, dict):
        return None
    n = info.get("max_prompt_tokens")
    if n.__class__ is int and n >= 1:
        return PromptLimit(n, f"max_prompt_tokens of worker {instance_id}")
    n = info.get("context_length")
    if n.__class__ is int and n >= 2:
        return PromptLimit(n - 1, f"context_length {n} of worker {instance_id}, less the "
                                  "position to generate into")
    return None


class PromptLimits:
    """Per model, the smallest limit among its workers and the flag.

    Read by parser threads (large bodies are parsed off the event loop): ``of`` reads one dict
    that ``rebuild`` replaces whole, never changes in place."""

    def __init__(self, flag: int | None) -> None:
        self.flag = PromptLimit(flag, FLAG) if flag is not None else None
        self._by_model: dict[str | None, PromptLimit] = {}

    def of(self, model: str | None) -> PromptLimit | None:
        """The limit for a request naming ``model`` (None: whichever worker serves it)."""
        by_model = self._by_model
        return by_model[model] if model in by_model else by_model.get(None, self.flag)

    def rebuild(self, workers: Iterable[Worker]) -> None:
        learned = [(w.model, w.prompt_limit) for w in workers if w.prompt_limit is not None]
        by_model: dict[str | None, PromptLimit] = {}
        # None: a request naming no model may land on any worker; a worker of no stated
        # model may serve any model.
        for model in {None, *(m for m, _ in learned if m is not None)}:
            found = [lim for m, lim in learned if model is None or m in (model, None)]
            if self.flag is not None:
                found.append(self.flag)
            if found:
                by_model[model] = min(found, key=lambda lim: lim.tokens)
        self._by_model = by_model
