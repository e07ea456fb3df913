"""A prefill instance SIGKILLed under steady traffic: nothing hangs, nothing is lost silently."""
from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from fault_helpers import (
    HEALTH_INTERVAL,
    LEASE_TTL,
    SYSTEM,
    Traffic,
    assert_reference_tokens,
    etcd_keys,
    route,
    wait_for,
)

from kvatlas.launcher.supervisor import LocalCluster

pytestmark = pytest.mark.timeout(90)
SLACK = 3.0
"""Scheduling slack on a loaded 2-core machine, on top of lease TTL + health interval."""


async def test_prefill_sigkill_under_traffic(pd_cluster: Callable[..., LocalCluster]) -> None:
    cluster = pd_cluster()
    state = cluster.state
    router = state.router["url"]
    traffic = Traffic(router, rate=8.0).start()
    await traffic.until_answered(24, "before the kill")
    # The shared prefix sticks to one instance: that is the one to kill.
    victim = (await route(router, SYSTEM + "Question 1?"))["prefill"]["instance_id"]
    before = await etcd_keys(state, victim)
    assert before["instance"] == 1 and before["ranks"] == 1 and before["blocks"] > 0, before

    cluster.kill(victim)
    killed_at = time.monotonic()

    async def stopped_choosing() -> bool:
        return (await route(router, SYSTEM + "Question 2?"))["prefill"]["instance_id"] != victim

    took = await wait_for(stopped_choosing, LEASE_TTL + HEALTH_INTERVAL + SLACK,
                          what=f"the router stops choosing the killed {victim}")
    await traffic.until_answered(24, "after the kill", since=killed_at - 1.0)
    outcomes = await traffic.stop()

    async def keys_gone() -> bool:
        return await etcd_keys(state, victim) == {"instance": 0, "ranks": 0, "blocks": 0}

    await wait_for(keys_gone, LEASE_TTL + SLACK, what=f"{victim}'s keys are gone from etcd")
    after_kill = [o for o in outcomes if o.started >= killed_at - 1.0]
    assert len(after_kill) >= 20, "traffic kept flowing through the fault"
    hung = [o for o in outcomes if o.status == 0]
    assert not hung, f"requests without an answer: {hung[:3]}"
    unclean = [o for o in outcomes if not o.clean]
    assert not unclean, f"errors without a JSON reason: {unclean[:3]}"
    failed = [o for o in outcomes if o.status != 200]
    # Retries go to the surviving instance: at most the requests in flight at the kill fail.
    assert len(failed) <= 3, [(o.status, o.error) for o in failed]
    # A retried request is answered in full by the survivor, not stitched from two.
    assert_reference_tokens(outcomes)
    print(f"router stopped choosing {victim} {took:.2f}s after SIGKILL; {len(outcomes)} "
          f"requests, {len(failed)} failed cleanly")
