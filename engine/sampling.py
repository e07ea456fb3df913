"""Sampling parameters, the token sampler and stop-string handling.

Sampling is per request: a request's own ``torch.Generator`` (seeded from ``seed``, or from the OS
when no seed is given) draws its tokens, so a seeded request gives the same tokens whatever else
runs beside it. ``temperature == 0`` is greedy (first maximum on ties).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from engine.tokenizer import BOS_ID, EOS_ID, PAD_ID, IncrementalDetokenizer

MAX_SEED = 2**63 - 1


@dataclass
class SamplingParams:
    """What and how much to generate (SGLang's ``sampling_params`` fields)."""

    max_new_tokens: int = 128
    """Tokens to generate at most."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) keeps all."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation; the returned text stops before the match."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (EOS always does unless ``ignore_eos``)."""
    ignore_eos: bool = False
    """Keep generating after EOS."""
    seed: int | None = None
    """Seed of this request's generator; None draws one from the OS."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def make_generator(seed: int | None) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(
        seed if seed is not None else secrets.randbits(63))


_NEVER = torch.tensor([BOS_ID, PAD_ID])


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """One token id from float64 ``logits`` [vocab]; BOS and PAD are never produced."""
    x = logits.to(torch.float64).clone()
    x[_NEVER] = float("-inf")
    if params.greedy:
        return int(torch.argmax(x))
    x = x / params.temperature
    if params.top_k > 0 and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x[x < kth] = float("-inf")
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        sorted_x[before >= params.top_p] = float("-inf")
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


class TextStream:
    """Detokenizes a request's output and applies stop tokens and stop strings.

    Text that could be the start of a stop string is held back until it is known not to be, so
    streamed deltas never include (part of) a stop string.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.detok = IncrementalDetokenizer()
        self.emitted = 0
        self.text = ""  # final visible text once finished
        self.matched: int | str | None = None
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids.add(EOS_ID)

    def push(self, token: int) -> tuple[str, bool]:
        """Feed one generated token; returns (text delta, stopped)."""
        if token in self._stop_ids:
            self.matched = token
            return self._finish(), True
        self.detok.push(token)
        full = self.detok.text
        for s in self.params.stop:
            i = full.find(s, max(0, self.emitted - len(s)))
            if i >= 0:
                self.matched = s
                delta = full[self.emitted:i]
                self.text = full[:i]
                self.emitted = i
                return delta, True
        hold = self._holdback(full)
        end = len(full) - hold
        delta = full[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta, False

    def finish(self) -> str:
        """Generation ended for another reason (length): emit what was held back."""
        return self._finish()

    def _finish(self) -> str:
        self.detok.flush()
        full = self.detok.text
        delta = full[self.emitted:]
        self.emitted = len(full)
        self.text = full
        return delta

    def _holdback(self, full: str) -> int:
        best = 0
        for s in self.params.stop:
            for n in range(min(len(s) - 1, len(full)), best, -1):
                if full.endswith(s[:n]):
                    best = n
                    break
        return best
