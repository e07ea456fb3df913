"""``PrefixFollower`` on its own (real etcd): a snapshot then every later event, in order, with no
gap; a broken stream resumed (not reloaded); a hook that fails answered with a reload; plain and
async hooks; nothing left running after ``close``. The faults per user are in
``test_follow_users.py``."""
from __future__ import annotations

import asyncio

import pytest
from agent_helpers import eventually
from etcd_fakes import CutWatchClient

from index.etcd import EtcdClient, EtcdSettings, KeyValue, WatchEvent
from index.follow import PrefixFollower
from index.keys import KeyLayout

pytestmark = pytest.mark.timeout(60)


class Recorder(PrefixFollower):
    """Keeps ``state`` equal to the prefix; records every hook call."""

    def __init__(self, client: EtcdClient, prefix: bytes, fail_next_apply: bool = False) -> None:
        super().__init__(client, prefix, "recorder", stale_after=2.0, progress_every=0.1)
        self.state: dict[bytes, bytes] = {}
        self.loads: list[int] = []
        self.events: list[WatchEvent] = []
        self.fail_next_apply = fail_next_apply

    async def load(self, revision: int, kvs: list[KeyValue]) -> None:  # an async hook
        await asyncio.sleep(0)
        self.loads.append(revision)
        self.state = {kv.key: kv.value for kv in kvs}

    def apply(self, events: list[WatchEvent]) -> None:  # a plain one
        if self.fail_next_apply:
            self.fail_next_apply = False
            raise RuntimeError("a bug in apply (test)")
        self.events.extend(events)
        for ev in events:
            if ev.put:
                self.state[ev.key] = ev.value
            else:
                self.state.pop(ev.key, None)


def _follow_tasks() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("follow-")]


async def _etcd_state(etcd: EtcdClient, prefix: bytes) -> dict[bytes, bytes]:
    _, kvs = await etcd.get_prefix(prefix)
    return {kv.key: kv.value for kv in kvs}


def test_progress_must_come_before_silence(etcd_settings: EtcdSettings) -> None:
    with pytest.raises(ValueError, match="progress_every"):
        PrefixFollower(EtcdClient(etcd_settings), b"/x/", "x", stale_after=1.0,
                       progress_every=1.0)


async def test_snapshot_then_every_event_in_order(etcd: EtcdClient, layout: KeyLayout) -> None:
    prefix = layout.instances_prefix()
    await etcd.put(prefix + b"a", b"1")
    follower = Recorder(etcd, prefix)
    assert not follower.ready and not follower.connected
    follower.start()
    try:
        assert await follower.wait_ready(10)
        assert follower.state == {prefix + b"a": b"1"} and len(follower.loads) == 1
        first = await etcd.put(prefix + b"b", b"2")
        await etcd.put(prefix + b"a", b"3")
        await etcd.delete(prefix + b"b")
        last = await etcd.put(prefix + b"c", b"4")
        assert await follower.wait_revision(last, 10)
        assert [(ev.key, ev.put) for ev in follower.events] == [
            (prefix + b"b", True), (prefix + b"a", True), (prefix + b"b", False),
            (prefix + b"c", True)]
        assert [ev.mod_revision for ev in follower.events] == list(range(first, last + 1))
        assert follower.revision == last
        assert follower.state == await _etcd_state(etcd, prefix)
        assert follower.reloads == 1 and follower.errors == 0
        await eventually(lambda: follower.connected, 10, "connected")
    finally:
        await follower.close()
    assert not _follow_tasks(), "close leaves neither the loop nor its probe running"


async def test_a_broken_stream_resumes_without_a_snapshot(
        etcd: EtcdClient, etcd_settings: EtcdSettings, layout: KeyLayout) -> None:
    prefix = layout.instances_prefix()
    async with CutWatchClient(etcd_settings) as client:
        follower = Recorder(client, prefix)
        follower.start()
        try:
            assert await follower.wait_ready(10)
            client.cut = True
            await eventually(lambda: follower.disconnects >= 1, 10, "the cut noticed")
            await etcd.put(prefix + b"a", b"1")
            rev = await etcd.put(prefix + b"b", b"2")
            client.cut = False
            assert await follower.wait_revision(rev, 20), follower.follow_stats()
            # Both arrived as events from the resume point, not by a second snapshot.
            assert [ev.key for ev in follower.events] == [prefix + b"a", prefix + b"b"]
            assert follower.reloads == 1 and follower.resumes >= 1
        finally:
            await follower.close()


async def test_a_hook_that_fails_is_answered_with_a_reload(etcd: EtcdClient,
                                                           layout: KeyLayout) -> None:
    prefix = layout.instances_prefix()
    follower = Recorder(etcd, prefix, fail_next_apply=True)
    follower.start()
    try:
        assert await follower.wait_ready(10)
        rev = await etcd.put(prefix + b"a", b"1")
        await eventually(lambda: follower.errors == 1 and follower.reloads == 2, 20,
                         "a reload after the failed apply")
        assert await follower.wait_revision(rev, 10)
        assert follower.state == {prefix + b"a": b"1"}  # from the snapshot
        assert follower.last_error is not None and "a bug in apply" in follower.last_error
        assert follower.ready
    finally:
        await follower.close()
