"""The kv_aware scoring flags of ``kvatlas router serve`` (``RouterConfig``'s fields of the same
names say what each one does): registered and read here so that the config module stays one
screenful of the router's own settings."""
from __future__ import annotations

import argparse
from typing import Any

from index.tiers import TierWeights


def add_kv_aware_args(parser: argparse.ArgumentParser, d: Any) -> None:
    """The cost model's flags, defaults from ``d`` (a default ``RouterConfig``)."""
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


def kv_aware_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``RouterConfig`` keyword arguments of the flags ``add_kv_aware_args`` registered."""
    return dict(
        overlap_weight=args.overlap_weight, temperature=args.temperature,
        load_interval=args.load_interval, send_weight=args.send_weight,
        busy_queue=args.busy_queue, busy_kv_usage=args.busy_kv_usage,
        tier_weights=TierWeights(args.gpu_hit_weight, args.host_hit_weight,
                                 args.disk_hit_weight),
        prediction_ttl=args.prediction_ttl, prediction_catch_up=args.prediction_catch_up,
        work_half_life=args.work_half_life, share_predictions=args.share_predictions,
        share_window=args.share_window, router_id=args.router_id)
