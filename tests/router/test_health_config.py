"""Health checks against real stubs, and the config/CLI surface."""
from __future__ import annotations

import argparse
import asyncio
from typing import Any

import pytest

from router.config import RouterConfig


async def test_health_checks_mark_unhealthy_and_back(stubs: Any, start_router: Any) -> None:
    (p,), decodes = await stubs("prefill"), await stubs("decode", 2)
    cfg = RouterConfig(prefill=[(p.url, None)], decode=[d.url for d in decodes],
                       health_interval=3600, health_failure_threshold=2,
                       health_success_threshold=2)
    client = await start_router(cfg)
    checker = client.app.health
    decodes[0].health_status = 503
    await checker.check_all()
    await checker.check_all()
    workers = await (await client.get("/workers")).json()
    health = {w["url"]: w["healthy"] for w in workers["decode"]}
    assert health == {decodes[0].url: False, decodes[1].url: True}
    for _ in range(4):
        assert (await (await client.post("/generate", json={"text": "x"})).json())["worker"] \
            == "decode1"
    await decodes[1].stop()  # connection refused counts as a failed check too
    await checker.check_all()
    await checker.check_all()
    resp = await client.post("/generate", json={"text": "x"})
    assert resp.status == 503 and "unhealthy" in (await resp.json())["error"]
    decodes[0].health_status = 200
    await checker.check_all()
    assert (await client.get("/readiness")).status == 503  # one success is not enough
    await checker.check_all()
    assert (await client.get("/readiness")).status == 200


async def test_without_health_checks_workers_stay_healthy(stubs: Any, start_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    d.health_status = 503
    cfg = RouterConfig(prefill=[(p.url, None)], decode=[d.url], health_interval=0.05,
                       health_failure_threshold=1, health_check_enabled=False)
    client = await start_router(cfg)
    await asyncio.sleep(0.3)  # several intervals: no round ran
    assert client.app.health.rounds == 0
    assert (await client.post("/generate", json={"text": "x"})).status == 200


async def test_head_answers_as_get_without_a_body(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d])
    for path in ("/health", "/liveness", "/readiness", "/v1/models"):
        got = await client.get(path)
        want = await got.read()
        resp = await client.request("HEAD", path)
        assert resp.status == got.status == 200, path
        assert resp.headers["content-length"] == str(len(want)) and want
        assert resp.headers["content-type"] == got.headers["content-type"]
        assert await resp.read() == b""
    resp = await client.request("HEAD", "/generate")
    assert resp.status == 405


def parse(argv: list[str]) -> RouterConfig:
    parser = argparse.ArgumentParser()
    RouterConfig.add_cli_args(parser)
    return RouterConfig.from_cli_args(parser.parse_args(argv))


def test_cli_mirrors_sglang_router_flags() -> None:
    cfg = parse(["--pd-disaggregation", "--prefill", "http://127.0.0.1:30000", "9001",
                 "--prefill", "http://127.0.0.1:30001", "none", "--prefill",
                 "http://127.0.0.1:30002", "--decode", "http://127.0.0.1:30010",
                 "--policy", "round_robin", "--decode-policy", "random",
                 "--admin-token", "tok-12345678"])
    assert cfg.prefill == [("http://127.0.0.1:30000", 9001), ("http://127.0.0.1:30001", None),
                           ("http://127.0.0.1:30002", None)]
    assert cfg.decode == ["http://127.0.0.1:30010"]
    assert cfg.effective_prefill_policy == "round_robin"
    assert cfg.effective_decode_policy == "random"
    d = parse([])
    # The body limit is the reference engine's (--max-request-bytes): what passes the router
    # passes a worker too.
    assert (d.host, d.port, d.max_body, d.health_interval) == ("127.0.0.1", 8000, 8 << 20, 5.0)
    assert d.max_prompt_tokens is None
    assert parse(["--max-prompt-tokens", "2047"]).max_prompt_tokens == 2047
    assert d.effective_prefill_policy == "kv_aware" and d.effective_decode_policy == "power_of_two"
    assert (d.breaker_failure_threshold, d.breaker_timeout, d.breaker_success_threshold) == \
        (10, 60.0, 3)
    assert d.retry_max_attempts == 5 and d.backoff(0) == 0.05 and d.backoff(2) == 0.05 * 2.25
    assert d.client_read_timeout == 60.0
    assert parse(["--client-read-timeout-secs", "5"]).client_read_timeout == 5.0


def test_an_sglang_router_command_line_works_unchanged() -> None:
    cfg = parse(["--pd-disaggregation", "--prefill", "http://127.0.0.1:30000", "8998",
                 "--decode", "http://127.0.0.1:30010", "--policy", "cache_aware",
                 "--max-payload-size", "1048576", "--retry-max-retries", "3",
                 "--retry-initial-backoff-ms", "100", "--retry-max-backoff-ms", "2000",
                 "--retry-backoff-multiplier", "2", "--retry-jitter-factor", "0.1",
                 "--cb-failure-threshold", "4", "--cb-success-threshold", "2",
                 "--cb-timeout-duration-secs", "30", "--health-failure-threshold", "5",
                 "--health-success-threshold", "1", "--health-check-timeout-secs", "2",
                 "--health-check-interval-secs", "10", "--request-timeout-secs", "600",
                 "--prometheus-port", "29000", "--disable-circuit-breaker",
                 "--disable-health-check", "--shutdown-grace-period-secs", "180",
                 "--max-concurrent-requests", "64", "--queue-size", "10",
                 "--queue-timeout-secs", "30", "--request-id-headers", "x-trace-id",
                 "x-request-id"])
    # cache_aware (sglang-router's per-router text tree) becomes the global-index kv_aware.
    assert cfg.policy == "kv_aware" and cfg.effective_prefill_policy == "kv_aware"
    assert cfg.effective_decode_policy == "power_of_two"
    assert cfg.max_body == 1 << 20 and cfg.retry_max_attempts == 3
    assert (cfg.retry_initial_backoff, cfg.retry_max_backoff, cfg.retry_backoff_multiplier,
            cfg.retry_jitter) == (0.1, 2.0, 2.0, 0.1)
    assert (cfg.breaker_failure_threshold, cfg.breaker_success_threshold,
            cfg.breaker_timeout) == (4, 2, 30.0)
    assert (cfg.health_failure_threshold, cfg.health_success_threshold, cfg.health_timeout,
            cfg.health_interval, cfg.request_timeout) == (5, 1, 2.0, 10.0, 600.0)
    assert parse(["--prefill-policy", "cache_aware"]).effective_prefill_policy == "kv_aware"
    assert parse(["--disable-retries"]).retry_max_attempts == 1
    assert (cfg.prometheus_host, cfg.prometheus_port) == ("127.0.0.1", 29000)
    assert not cfg.breaker_enabled and not cfg.health_check_enabled
    assert cfg.shutdown_grace == 180.0
    assert (cfg.max_concurrent_requests, cfg.queue_size, cfg.queue_timeout) == (64, 10, 30.0)
    assert cfg.request_id_headers == ("x-trace-id", "x-request-id")
    assert parse([]).request_id_headers == ("x-request-id",)
    assert parse([]).breaker_enabled and parse([]).health_check_enabled


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"policy": "magic"}, "policy"),
    ({"prefill": [("localhost:80", None)]}, "http://HOST:PORT"),
    ({"prefill": [("http://h:1", "70000")]}, "bootstrap port"),
    ({"decode": ["http://h:99999"]}, "port"),
    ({"admin_token": "short"}, "admin token"),
    ({"max_body": 0}, "max_body"),
    ({"max_prompt_tokens": 0}, "max_prompt_tokens"),
    ({"retry_jitter": 1.5}, "retry_jitter"),
    ({"client_read_timeout": 0}, "client_read_timeout must be > 0"),
    ({"prometheus_port": 70000}, "prometheus port"),
    ({"queue_size": -1}, "queue_size"),
    ({"request_id_headers": ("",)}, "request_id_headers"),
    ({"etcd_prefix": "nope"}, "prefix"),
])
def test_config_rejects_bad_values(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        RouterConfig(**kwargs)


def test_cli_rejects_three_prefill_values() -> None:
    with pytest.raises(ValueError, match="BOOTSTRAP_PORT"):
        parse(["--prefill", "http://h:1", "2", "3"])
