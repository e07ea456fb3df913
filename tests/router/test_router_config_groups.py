"""RouterConfig is split by concern (routing, resilience, the process's own settings), each
setting beside its flag; the keywords, flags and checks stay those of one config."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from router.config import RouterConfig
from router.resilience_config import ResilienceSettings
from router.routing_config import RoutingSettings


def _parse(argv: list[str]) -> RouterConfig:
    parser = argparse.ArgumentParser()
    RouterConfig.add_cli_args(parser)
    return RouterConfig.from_cli_args(parser.parse_args(argv))


def test_group_fields_are_router_config_keywords() -> None:
    names = {f.name for f in dataclasses.fields(RouterConfig)}
    for group in (RoutingSettings, ResilienceSettings):
        assert {f.name for f in dataclasses.fields(group)} <= names, group
    cfg = RouterConfig(policy="cache_aware", overlap_weight=1.0, retry_max_attempts=2,
                       max_body=1024, router_id="r1")
    assert (cfg.policy, cfg.effective_decode_policy, cfg.retry_max_attempts, cfg.max_body) == (
        "kv_aware", "power_of_two", 2, 1024)


@pytest.mark.parametrize("kwargs, field", [({"policy": "best"}, "policy"),
                                           ({"block_size": 0}, "block_size"),
                                           ({"retry_jitter": 1.0}, "retry_jitter"),
                                           ({"health_timeout": 0}, "health_timeout"),
                                           ({"queue_size": -1}, "queue_size")])
def test_every_groups_checks_run_for_router_config(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RouterConfig(**kwargs)  # type: ignore[arg-type]


def test_each_groups_flags_reach_its_fields() -> None:
    cfg = _parse(["--policy", "random", "--block-size", "32", "--gpu-hit-weight", "0.5",
                  "--canary-delay", "0", "--router-id", "r1", "--disable-retries",
                  "--cb-timeout-duration-secs", "7", "--retry-initial-backoff-ms", "100",
                  "--queue-size", "3", "--max-body", "2048"])
    assert (cfg.policy, cfg.block_size, cfg.tier_weights.device, cfg.canary_delay) == (
        "random", 32, 0.5, 0.0)
    assert (cfg.retry_max_attempts, cfg.breaker_timeout, cfg.retry_initial_backoff) == (
        1, 7.0, 0.1)
    assert (cfg.queue_size, cfg.max_body, cfg.router_id) == (3, 2048, "r1")


def test_flag_defaults_are_the_field_defaults() -> None:
    parsed = dataclasses.asdict(_parse(["--router-id", "r1"]))
    default = dataclasses.asdict(RouterConfig(router_id="r1"))
    assert parsed == default
