"""Engine-reported load: each worker's own queue, running requests and KV-cache usage.

The router counts only the requests it sent itself; other routers' requests, and requests sent
to an engine directly, are invisible to it. Engines say what they carry on ``/metrics``, so the
scraper reads every worker's at least once a second (``--load-interval``) and understands:

- SGLang: ``sglang:num_queue_reqs``, ``sglang:num_running_reqs``, ``sglang:token_usage``;
- vLLM: ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
  ``vllm:kv_cache_usage_perc`` (older releases: ``vllm:gpu_cache_usage_perc``);
- kvatlas: ``kvatlas_engine_queue_length``, ``kvatlas_engine_running_requests``,
  ``kvatlas_engine_kv_pages_used`` / ``kvatlas_engine_kv_pages_total``.

Samples of one name (one per label set: model, DP rank) are summed; usage takes the largest.

Two uses (router/kv_aware.py, router/state.py):

- *cost*: a request queued at the engine that the router does not know of (the engine's queue
  beyond the router's own in-flight count there) adds the router's mean work per request, in
  blocks, to that worker's load;
- *busy thresholds*: a worker whose queue reaches ``busy_queue`` or whose KV usage reaches
  ``busy_kv_usage`` is not chosen while another is not busy (``PUT /admin/thresholds`` changes
  both at run time). A reading older than three intervals is ignored (the worker is judged on
  the router's own counts, as without scraping).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

QUEUE = ("sglang:num_queue_reqs", "vllm:num_requests_waiting", "kvatlas_engine_queue_length")
RUNNING = ("sglang:num_running_reqs", "vllm:num_requests_running",
           "kvatlas_engine_running_requests")
USAGE = ("sglang:token_usage", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PAGES = ("kvatlas_engine_kv_pages_used", "kvatlas_engine_kv_pages_total")
_WANTED = frozenset((*QUEUE, *RUNNING, *USAGE, *PAGES))
STALE_INTERVALS = 3


@dataclass(frozen=True)
class EngineLoad:
    """One reading of a worker's ``/metrics``."""

    queue: float
    running: float
    kv_usage: float | None
    at: float
    """Monotonic time of the reading."""

    def describe(self) -> dict[str, float | None]:
        return {"queue": self.queue, "running": self.running, "kv_usage": self.kv_usage}


def parse_metrics(text: str, at: float = 0.0) -> EngineLoad | None:
    """The load in a Prometheus text exposition; None when it names none of the metrics."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        if brace >= 0:
            name, rest = line[:brace], line[line.rfind("}") + 1:]  # label values may hold spaces
        else:
            name, _, rest = line.partition(" ")
        if name not in _WANTED:
            continue
        fields = rest.split()  # value [timestamp]
        try:
            value = float(fields[0])
        except (IndexError, ValueError):
            continue
        if math.isnan(value) or value < 0:
            continue
        if name in USAGE:
            sums[name] = max(sums.get(name, 0.0), value)
        else:
            sums[name] = sums.get(name, 0.0) + value
    if not sums:
        return None
    queue = next((sums[n] for n in QUEUE if n in sums), 0.0)
    running = next((sums[n] for n in RUNNING if n in sums), 0.0)
    usage = next((sums[n] for n in USAGE if n in sums), None)
    if usage is None and PAGES[1] in sums and sums[PAGES[1]] > 0:
        usage = sums.get(PAGES[0], 0.0) / sums[PAGES[1]]
    if usage is not None:
        usage = min(usage, 1.0)
    return EngineLoad(queue, running, usage, at)


@dataclass
class Thresholds:
    """When a worker counts as busy (None: that test is off). Changed at run time."""

    busy_queue: int | None = None
    busy_kv_usage: float | None = None
    disagg_tokens: int = 512
    """With both shapes serving (PD pairs and aggregated workers): a request whose prompt the
    best aggregated candidate lacks at least this many tokens of goes to a PD pair (a
    dedicated prefill pays for the hop); shorter ones stay aggregated (router/state.py)."""

    def __post_init__(self) -> None:
        check_thresholds(self.busy_queue, self.busy_kv_usage)
        check_disagg_tokens(self.disagg_tokens)

    def busy(self, load: EngineLoad | None) -> bool:
        if load is None:
            return False
        if self.busy_queue is not None and load.queue >= self.busy_queue:
            return True
        return (self.busy_kv_usage is not None and load.kv_usage is not None
                and load.kv_usage >= self.busy_kv_usage)

    def describe(self) -> dict[str, int | float | None]:
        return {"busy_queue": self.busy_queue, "busy_kv_usage": self.busy_kv_usage,
                "disagg_tokens": self.disagg_tokens}


def check_disagg_tokens(tokens: object) -> None:
    """ValueError naming ``disagg_tokens`` unless it is an integer >= 0."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"disagg_tokens must be an integer >= 0, got {tokens!r}")


def check_thresholds(queue: object, usage: object) -> None:
    """ValueError naming the bad one (the config and the admin API share it)."""
    if queue is not None and (isinstance(queue, bool) or not isinstance(queue, int)
                              or queue < 1):
        raise ValueError(f"busy_queue must be an integer >= 1 or null, got {queue!r}")
    if usage is not None and (isinstance(usage, bool) or not isinstance(usage, (int, float))
                              or not 0.0 < usage <= 1.0):
        raise ValueError(f"busy_kv_usage must be a fraction in (0, 1] or null, got {usage!r}")


def fresh(load: EngineLoad | None, now: float, interval: float) -> EngineLoad | None:
    """``load``, unless it is older than ``STALE_INTERVALS`` scrape intervals (or absent)."""
    if load is None or now - load.at > STALE_INTERVALS * interval:
        return None
    return load
