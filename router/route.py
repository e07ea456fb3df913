"""One routing decision for a parsed request: where it goes and why.

``decide`` is the one place a request's route is chosen. The model is resolved once, by the
parser (``Parsed.route_model``, from ``Tokenizers.for_request``), the prompt is hashed once by
the shared memoized hasher (``router.prompt_hashes``; a large body's hashes come from the
parser's thread, by the same hasher), the policies read one index view through
``RouterState`` (match, tiers, version, guards, predictions) and score the candidates. The
result is a typed ``Decision`` that ``dispatch`` executes and that ``/debug/route``,
``kvatlas route`` and the ``X-Kvatlas-Route`` header print (``Decision.describe`` / ``Decision.explain``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from router.capacity import Need
from router.explain import explain
from router.policy import RouteContext
from router.requests import GENERATE, Parsed
from router.state import Pair, RouterState


def route_context(parsed: Parsed) -> RouteContext:
    """What the policies look at for ``parsed``: built once per request and kept across its
    retries, so that its prompt is hashed once whatever the number of attempts. Its model is
    the one the parser settled (``Parsed.route_model``)."""
    return RouteContext(parsed.prompts[0], parsed.route_model, parsed.hashes, parsed.samples,
                        vllm_pd=parsed.api != GENERATE and parsed.batch is None)


@dataclass(frozen=True)
class Decision:
    """Where a request goes: the chosen prefill/decode pair and what the choice was made of."""

    pair: Pair
    """The prefill's and the decode's ``Choice`` (worker, matched blocks, candidates)."""
    model: str | None
    """The model the request was routed as (``Parsed.route_model``)."""
    policy: str
    """The prefill policy's name."""
    decision_us: float
    """Time the choice took, in microseconds."""

    def explain(self, state: RouterState) -> str:
        """The ``X-Kvatlas-Route`` header value (router/explain.py)."""
        return explain(self.pair, state.config, self.policy)

    @property
    def shape(self) -> str:
        """``pd`` (a prefill and a decode) or ``aggregated`` (one worker serves it whole)."""
        return self.pair.shape

    def describe(self, state: RouterState) -> dict[str, Any]:
        """The decision as ``/debug/route`` answers it (``kvatlas route`` prints it)."""
        p, d = self.pair.prefill, self.pair.decode
        where: dict[str, Any]
        if d is None:
            where = {"worker": {"instance_id": p.worker.instance_id, "url": p.worker.url},
                     "policy": {"worker": self.policy}}
        else:
            where = {"pd_protocol": p.worker.protocol.label,
                     "prefill": {"instance_id": p.worker.instance_id, "url": p.worker.url,
                                 "bootstrap_host": p.worker.bootstrap_host,
                                 "bootstrap_port": p.worker.bootstrap_port},
                     "decode": {"instance_id": d.worker.instance_id, "url": d.worker.url},
                     "policy": {"prefill": self.policy, "decode": state.decode_policy.name}}
        return {
            "shape": self.shape, "disaggregation": self.pair.why, **where,
            "model": self.model,
            "prompt_blocks": p.prompt_blocks, "matched_blocks": p.matched_blocks,
            "index_blocks": p.indexed_blocks, "block_size": state.config.block_size,
            "candidates": p.candidates, "decision_us": self.decision_us,
        }


def decide(state: RouterState, ctx: RouteContext, exclude: set[str] | None = None,
           need: Need | None = None, unfit: frozenset[str] = frozenset()) -> Decision:
    """The decision for the request of ``ctx`` (``route_context``), avoiding ``exclude`` (the
    instances that failed it already), among the workers with room for ``need`` and whose
    limits it fits (``unfit``). Raises NoWorkers / NoRoom as ``RouterState.select_pair``."""
    t0 = time.perf_counter()
    pair = state.select_pair(ctx, exclude, need, unfit=unfit)
    return Decision(pair, ctx.model, state.prefill_policy.name,
                    round((time.perf_counter() - t0) * 1e6, 1))
