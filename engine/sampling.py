"""Sampling parameters, the token sampler and stop-string handling.

Sampling is per request: a request's own ``torch.Generator`` (seeded from ``seed``, or from the OS
when no seed is given) draws its tokens, so a seeded request gives the same tokens whatever else
runs beside it. A temperature below ``SAMPLING_EPS`` is greedy (first maximum on ties), like
vLLM's ``_SAMPLING_EPS``: dividing logits by a subnormal temperature overflows to inf and the
softmax to NaN.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from tokenization.base import Tokenizer

MAX_SEED = 2**63 - 1
SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy."""
MAX_STOP_STRINGS = 32
"""Stop strings one request may give."""
MAX_STOP_CHARS = 256
"""Characters of one stop string at most."""


@dataclass
class SamplingParams:
    """What and how much to generate (SGLang's ``sampling_params`` fields)."""

    max_new_tokens: int = 128
    """Tokens to generate at most."""
    temperature: float = 1.0
    """Softmax temperature; below ``SAMPLING_EPS`` (1e-5) means greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) keeps all."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation; the returned text stops before the match."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (the tokenizer's ``eos_ids`` always do unless
    ``ignore_eos``)."""
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
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not s or len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop strings must have 1 to {MAX_STOP_CHARS} characters")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1


def make_generator(seed: int | None) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(
        seed if seed is not None else secrets.randbits(63))


def banned_ids(tok: Tokenizer, model_vocab: int) -> torch.Tensor:
    """Ids the sampler must never produce for a model of ``model_vocab`` logits: the tokenizer's
    ``never_ids`` (e.g. BOS, PAD) and every id past its vocabulary (a checkpoint's embedding
    rows padded beyond the tokenizer's, which decode to nothing)."""
    ids = {i for i in tok.never_ids if 0 <= i < model_vocab}
    ids.update(range(tok.vocab_size, model_vocab))
    return torch.tensor(sorted(ids), dtype=torch.long)


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator,
           banned: torch.Tensor | None = None) -> int:
    """One token id from ``logits`` [vocab]; the ids in ``banned`` (``banned_ids``) are never
    produced."""
    x = logits.to(torch.float64).clone()
    if banned is not None and banned.numel():
        x[banned] = float("-inf")
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
    if not bool(torch.isfinite(probs).all()):
        # overflow (huge logits over a tiny temperature): the distribution's limit is the argmax
        return int(torch.argmax(x))
    return int(torch.multinomial(probs, 1, generator=gen))


class _StopMatcher:
    """KMP automaton of one stop string fed the text a character at a time: ``state`` is the
    length of the longest prefix of ``s`` that ends the text so far, so matching and the
    hold-back cost O(1) amortized per generated character instead of rescanning the tail."""

    def __init__(self, s: str) -> None:
        self.s = s
        self.state = 0
        self.fail = [0] * len(s)
        k = 0
        for i in range(1, len(s)):
            while k and s[i] != s[k]:
                k = self.fail[k - 1]
            if s[i] == s[k]:
                k += 1
            self.fail[i] = k

    def feed(self, ch: str) -> bool:
        """Advance by one character; True when the whole stop string now ends the text."""
        s, k = self.s, self.state
        while k and s[k] != ch:
            k = self.fail[k - 1]
        if s[k] == ch:
            k += 1
        if k == len(s):
            self.state = self.fail[k - 1]
            return True
        self.state = k
        return False


class TextStream:
    """Detokenizes a request's output and applies stop tokens and stop strings.

    Text that could be the start of a stop string is held back until it is known not to be, so
    streamed deltas never include (part of) a stop string. The first stop string to be completed
    (the earliest end in the text) ends generation.
    """

    def __init__(self, params: SamplingParams, tok: Tokenizer) -> None:
        self.params = params
        self.detok = tok.detokenizer()
        self.emitted = 0
        self.text = ""  # final visible text once finished
        self.matched: int | str | None = None
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids |= tok.eos_ids
        self._matchers = [_StopMatcher(s) for s in params.stop]

    def push(self, token: int) -> tuple[str, bool]:
        """Feed one generated token; returns (text delta, stopped)."""
        if token in self._stop_ids:
            self.matched = token
            return self._finish(), True
        new = self.detok.push(token)
        full = self.detok.text
        base = len(full) - len(new)
        for j, ch in enumerate(new):
            for m in self._matchers:
                if m.feed(ch):
                    # held-back text never reaches past a possible match start, so i >= emitted
                    i = max(self.emitted, base + j + 1 - len(m.s))
                    self.matched = m.s
                    delta = full[self.emitted:i]
                    self.text = full[:i]
                    self.emitted = i
                    return delta, True
        hold = max((m.state for m in self._matchers), default=0)
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

