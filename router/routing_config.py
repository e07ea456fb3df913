"""The router's routing settings (policies, the kv_aware cost model, predictions, canaries),
each next to its ``kvatlas router serve`` flag. ``RouterConfig`` takes these fields as its own."""
from __future__ import annotations

import argparse
import os
import re
import secrets
import socket
from dataclasses import dataclass, field
from typing import Any

from index.keys import validate_instance_id
from index.tiers import TierWeights
from router.engine_load import check_disagg_tokens, check_thresholds

POLICIES = ("kv_aware", "round_robin", "random", "power_of_two")
POLICY_ALIASES = {"cache_aware": "kv_aware"}
"""sglang-router's names, accepted so that its command lines work unchanged: its cache_aware
(an approximate per-router text tree) maps to kv_aware (the global block index)."""


def default_router_id() -> str:
    """``host-pid-random``, an instance id that differs for every router process."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64] or "router"
    if not host[0].isalnum():
        host = "r" + host
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass
class RoutingSettings:
    """How a request's prefill and decode workers are chosen."""

    policy: str = "kv_aware"
    """Default policy for both sides (decode falls back to power_of_two for kv_aware)."""
    prefill_policy: str | None = None
    """Prefill policy; None: ``policy``."""
    decode_policy: str | None = None
    """Decode policy; None: ``policy``, or power_of_two when that is kv_aware."""
    block_size: int = 16
    """Tokens per KV block; must equal the engines' page size so hashes match."""
    overlap_weight: float = 2.0
    """kv_aware: cost per prefill block left to compute; the load term counts 1 per block of
    prefill work. Above 1 because a hit also spares a duplicate copy of the prefix in another
    cache (bench/routing_quality.py, concurrency 6: 1.0 served ~6% fewer cached tokens than the
    old request-count load, 2.0 is within run-to-run noise of it)."""
    send_weight: float = 0.05
    """kv_aware: work of sending one block's KV to the decode, in blocks of prefill compute. A
    prefill sends every block of a prompt, cached or not, so a burst of fully cached requests
    still queues at their holder: this term is what makes one spread (``--send-weight``).
    bench/routing_quality.py: 0.25 spread a reuse trace enough to cost ~9% of its cached
    tokens; 0.05 cost none measurable and still spreads a 256-request burst (max/mean 1.25)."""
    tier_weights: TierWeights = field(default_factory=TierWeights)
    """kv_aware: what a matched block is worth by the cache tier holding it (device 1.0, host
    0.75, disk 0.25): a host or disk hit is copied to the device, not reused in place."""
    temperature: float = 0.0
    """0: lowest cost wins; > 0: softmax sampling over -cost / temperature."""
    load_interval: float = 1.0
    """Seconds between reads of every worker's ``/metrics`` (its own queue, running requests,
    KV usage: router/engine_load.py); 0 turns scraping off."""
    busy_queue: int | None = None
    """A worker whose engine reports this many queued requests is not chosen while another is
    not busy (None: off). ``PUT /admin/thresholds`` changes it at run time."""
    busy_kv_usage: float | None = None
    """The same for the engine's KV-cache usage, a fraction in (0, 1] (None: off)."""
    disagg_tokens: int = 512
    """With PD pairs and aggregated workers both serving: the uncached prompt tokens (what the
    best aggregated candidate lacks) from which a request goes to a PD pair; below, and when
    the prefills are busy and an aggregated worker is not, it is served aggregated.
    ``PUT /admin/thresholds`` changes it at run time."""
    explain_routes: bool = False
    """Every answer carries ``X-Kvatlas-Route`` (the decision and its cost terms); otherwise
    only answers to requests sending ``X-Kvatlas-Explain: 1``."""
    prediction_ttl: float = 120.0
    """Seconds a routed prompt's blocks count as held by the chosen prefill before events arrive."""
    prediction_catch_up: float = 5.0
    """Seconds a prediction on an instance whose events the index shows may bridge the index's
    lag; it is dropped sooner once the index shows that prompt stored there. Instances the index
    has never shown keep their predictions for ``prediction_ttl``."""
    work_half_life: float = 2.0
    """Half-life in seconds of finished prefill work in the kv_aware load term (0: count only
    in-flight work). Spreads new conversations at low concurrency."""
    share_predictions: bool = True
    """kv_aware with etcd: publish this router's predictions and follow the other routers'
    (router/shared_predictions.py), so that a conversation whose turns reach different routers
    finds its holder before the engines' KV events do. Costs one etcd put per
    ``share_window`` in which this router routed a prompt the index did not fully show."""
    share_window: float = 0.01
    """Seconds of predictions gathered into one etcd put."""
    router_id: str | None = None
    """This router's name among the routers sharing predictions (None: host-pid-random)."""
    prediction_max_blocks: int = 1_000_000
    """Bound on predicted (instance, block) entries; the oldest go first past it."""
    canary_delay: float = 2.0
    """Seconds after a prefill served a prompt before the router asks its block index whether
    that prefill holds the prompt's first block (a canary: router/canary.py). Long enough for
    the engine's KV events to reach etcd and the router's mirror."""
    canary_interval: float = 1.0
    """Seconds between two canaries taken for one prefill instance (0: one per served request,
    still at most 4 waiting per instance)."""
    cache_threshold: float | None = None
    """sglang-router's ``--cache-threshold``: a request whose best match covers less than this
    fraction of its prompt goes to the worker with the fewest requests in flight. None (the
    default): off, kv_aware's cost weighs a hit against load on its own."""
    balance_abs_threshold: int | None = None
    """sglang-router's ``--balance-abs-threshold``: with ``balance_rel_threshold``, when the
    candidates' requests in flight differ by more than this (and the most loaded has more than
    rel x the least's), the least loaded wins whatever its match. None: off."""
    balance_rel_threshold: float | None = None
    """sglang-router's ``--balance-rel-threshold`` (see ``balance_abs_threshold``)."""

    def __post_init__(self) -> None:
        for name in ("policy", "prefill_policy", "decode_policy"):
            value = POLICY_ALIASES.get(getattr(self, name), getattr(self, name))
            setattr(self, name, value)
            if value is not None and value not in POLICIES:
                raise ValueError(f"{name} {value!r} is unknown: use one of {', '.join(POLICIES)}")
        for name in ("block_size", "prediction_max_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.prediction_ttl > 0:
            raise ValueError(f"prediction_ttl must be > 0, got {self.prediction_ttl}")
        check_thresholds(self.busy_queue, self.busy_kv_usage)
        check_disagg_tokens(self.disagg_tokens)
        if self.cache_threshold is not None and not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be within [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold is not None and self.balance_abs_threshold < 0:
            raise ValueError("balance_abs_threshold must be >= 0, got "
                             f"{self.balance_abs_threshold}")
        if self.balance_rel_threshold is not None and self.balance_rel_threshold < 1.0:
            raise ValueError("balance_rel_threshold must be >= 1, got "
                             f"{self.balance_rel_threshold}")
        if not 0.001 <= self.share_window <= 1.0:
            raise ValueError(f"share_window must be within [0.001, 1] s, got {self.share_window}")
        if self.router_id is None:
            self.router_id = default_router_id()
        validate_instance_id(self.router_id)
        for name in ("overlap_weight", "temperature", "prediction_catch_up", "work_half_life",
                     "load_interval", "send_weight", "canary_delay", "canary_interval"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def effective_prefill_policy(self) -> str:
        return self.prefill_policy or self.policy

    @property
    def effective_decode_policy(self) -> str:
        if self.decode_policy:
            return self.decode_policy
        return "power_of_two" if self.policy == "kv_aware" else self.policy


def add_policy_args(parser: argparse.ArgumentParser) -> None:
    """``--policy``, ``--prefill-policy``, ``--decode-policy`` (sglang-router's flags)."""
    choices = [*POLICIES, *POLICY_ALIASES]
    parser.add_argument("--policy", default=RoutingSettings.policy, choices=choices,
                        help="policy for both sides (default kv_aware; decode uses "
                             "power_of_two then; cache_aware means kv_aware)")
    parser.add_argument("--prefill-policy", default=None, choices=choices)
    parser.add_argument("--decode-policy", default=None, choices=choices)


def add_kv_aware_args(parser: argparse.ArgumentParser) -> None:
    """The block size, the kv_aware cost model, predictions and canaries."""
    d = RoutingSettings
    parser.add_argument("--block-size", type=int, default=d.block_size,
                        help="tokens per KV block (the engines' page size)")
    parser.add_argument("--overlap-weight", type=float, default=d.overlap_weight)
    w = TierWeights()
    parser.add_argument("--gpu-hit-weight", type=float, default=w.device,
                        help=f"kv_aware: worth of a matched device block (default {w.device})")
    parser.add_argument("--host-hit-weight", type=float, default=w.host,
                        help="kv_aware: worth of a matched host (CPU) block "
                             f"(default {w.host})")
    parser.add_argument("--disk-hit-weight", type=float, default=w.disk,
                        help=f"kv_aware: worth of a matched disk block (default {w.disk})")
    parser.add_argument("--load-interval", type=float, default=d.load_interval,
                        help="seconds between reads of the workers' /metrics (engine queue, "
                             f"running, KV usage; 0: off; default {d.load_interval:g})")
    parser.add_argument("--busy-queue", type=int, default=None,
                        help="engine queue length at which a worker is busy (default off)")
    parser.add_argument("--busy-kv-usage", type=float, default=None,
                        help="engine KV usage (0..1] at which a worker is busy (default off)")
    parser.add_argument("--send-weight", type=float, default=d.send_weight,
                        help="kv_aware: cost of sending a block's KV to the decode, in "
                             f"blocks of compute (default {d.send_weight})")
    parser.add_argument("--temperature", type=float, default=d.temperature,
                        help="kv_aware softmax temperature (0: argmin)")
    parser.add_argument("--prediction-ttl", type=float, default=d.prediction_ttl,
                        help="hard bound on a kv_aware prediction's life, seconds")
    parser.add_argument("--prediction-catch-up", type=float, default=d.prediction_catch_up,
                        help="seconds a prediction bridges the index's lag (default 5)")
    parser.add_argument("--no-share-predictions", dest="share_predictions",
                        action="store_false",
                        help="with etcd: neither publish this router's predictions nor follow "
                             "the other routers' (default: shared)")
    parser.add_argument("--share-window", type=float, default=d.share_window,
                        help="seconds of predictions per etcd put (default "
                             f"{d.share_window:g})")
    parser.add_argument("--router-id", default=None,
                        help="this router's name among those sharing predictions (default: "
                             "host-pid-random)")
    parser.add_argument("--work-half-life", type=float, default=d.work_half_life,
                        help="half-life of finished prefill work in the load term, seconds")
    parser.add_argument("--explain-routes", action="store_true",
                        help="add X-Kvatlas-Route (the decision, its cost terms) to every "
                             "answer (default: only when the request sends "
                             "X-Kvatlas-Explain: 1)")
    parser.add_argument("--canary-delay", type=float, default=d.canary_delay,
                        help="seconds after a served prompt before the router checks that "
                             "the index shows it on its prefill (default 2)")
    parser.add_argument("--canary-interval", type=float, default=d.canary_interval,
                        help="seconds between two canaries of one prefill (default 1)")
    # sglang-router's cache_aware tuning: the thresholds mean what they mean there; its text
    # tree's size and eviction have nothing to tune here (the index follows engine events).
    parser.add_argument("--disagg-threshold-tokens", type=int, default=d.disagg_tokens,
                        dest="disagg_tokens",
                        help="PD pairs and aggregated workers both serving: uncached prompt "
                             f"tokens from which a request is disaggregated (default "
                             f"{d.disagg_tokens})")
    parser.add_argument("--cache-threshold", type=float, default=None,
                        help="below this matched fraction of the prompt, the least loaded "
                             "worker wins (sglang-router's flag; default off)")
    parser.add_argument("--balance-abs-threshold", type=int, default=None,
                        help="in-flight imbalance above which the least loaded wins "
                             "(sglang-router's flag; default off)")
    parser.add_argument("--balance-rel-threshold", type=float, default=None,
                        help="relative in-flight imbalance, with --balance-abs-threshold")
    parser.add_argument("--eviction-interval-secs", "--eviction-interval", type=float,
                        default=None, help="accepted for sglang-router command lines; unused "
                                           "(no text tree to evict)")
    parser.add_argument("--max-tree-size", type=int, default=None,
                        help="accepted for sglang-router command lines; unused")


def routing_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``RoutingSettings`` keyword arguments of the flags registered above."""
    return dict(
        policy=args.policy, prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy, block_size=args.block_size,
        overlap_weight=args.overlap_weight, temperature=args.temperature,
        load_interval=args.load_interval, send_weight=args.send_weight,
        busy_queue=args.busy_queue, busy_kv_usage=args.busy_kv_usage,
        disagg_tokens=args.disagg_tokens,
        tier_weights=TierWeights(args.gpu_hit_weight, args.host_hit_weight,
                                 args.disk_hit_weight),
        prediction_ttl=args.prediction_ttl, prediction_catch_up=args.prediction_catch_up,
        work_half_life=args.work_half_life, share_predictions=args.share_predictions,
        share_window=args.share_window, router_id=args.router_id,
        explain_routes=args.explain_routes, canary_delay=args.canary_delay,
        canary_interval=args.canary_interval, cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold)
