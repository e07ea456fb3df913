"""Fault tests for every user of ``index.follow.PrefixFollower``, one table for all of them.

Each user (the block mirror, the router's worker discovery, the decode's prefill-restart watch)
runs against a real etcd with a key prefix of its own, through a small adapter that writes what
the user must pick up and reads back what the user saw. Three faults, each for each user:

- etcd restarted (the process stopped and started on the same data dir and ports): the user
  reconnects and sees a change made after the restart;
- compaction past the watcher's revision (its watch cut off while keys change, etcd compacted to
  the head, then the link back): it reloads a snapshot and ends with exactly etcd's state,
  including a delete it never saw;
- a watch that goes silent (the stream held open without delivering): the liveness timeout
  notices, and a snapshot brings the user up to date while the stream is still silent.

Every wait polls a state with a generous deadline: only a change never picked up reaches it.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
from agent_helpers import eventually
from etcd_fakes import CutWatchClient, HeldWatchClient
from waiting import wait_until

from engine.pd.restarts import PrefillRestarts
from index.errors import EtcdError
from index.etcd import EtcdClient, EtcdSettings
from index.follow import PrefixFollower
from index.keys import KeyLayout, dumps
from index.mirror import BlockMirror, BlockMirrorConfig
from index.segments import encode
from kvatlas.etcd_proc import EtcdCluster
from router.config import RouterConfig
from router.discovery import InstanceDiscovery
from router.workers import PREFILL, WorkerPools

pytestmark = pytest.mark.timeout(120)

PROGRESS = 0.1
STALE = 1.0
"""Short enough that a silent watch is answered within seconds; a spurious reload on a loaded box
changes no outcome here (every check is on the state reached)."""
DEADLINE = 30.0
MODEL = "org/follow-users"


class User:
    """One follower user: how to build it, what a key ``n`` of generation ``gen`` is, and what
    it saw (``{n: gen}``)."""

    name = ""
    follower: PrefixFollower

    def __init__(self, client: EtcdClient, layout: KeyLayout) -> None:
        self.layout = layout

    def key(self, n: int) -> bytes:
        raise NotImplementedError

    def value(self, n: int, gen: int) -> bytes:
        raise NotImplementedError

    def view(self) -> dict[int, int]:
        raise NotImplementedError

    def noticed_rewrite(self, n: int) -> bool:
        """Whatever besides its state the user does on a changed value (only the restart watch
        reports one)."""
        return True


class MirrorUser(User):
    name = "block mirror"

    def __init__(self, client: EtcdClient, layout: KeyLayout) -> None:
        super().__init__(client, layout)
        self.follower = self.mirror = BlockMirror(
            client, layout, MODEL, BlockMirrorConfig(progress_every=PROGRESS, stale_after=STALE))

    def key(self, n: int) -> bytes:
        return self.layout.segment(MODEL, "inst-a", n)

    def value(self, n: int, gen: int) -> bytes:
        return encode(0.0, None, [n], [f"G{gen}"])  # the medium carries the generation

    def view(self) -> dict[int, int]:
        table = self.mirror.table()
        return {h: int((table.medium("inst-a", h) or "G0")[1:])
                for h in self.mirror.blocks("inst-a")}


class DiscoveryUser(User):
    name = "worker discovery"

    def __init__(self, client: EtcdClient, layout: KeyLayout) -> None:
        super().__init__(client, layout)
        self.pools = WorkerPools(RouterConfig())
        self.follower = InstanceDiscovery(client, layout, self.pools, "tiny",
                                          progress_every=PROGRESS, stale_after=STALE)

    def key(self, n: int) -> bytes:
        return self.layout.instance(f"w{n}")

    def value(self, n: int, gen: int) -> bytes:
        return dumps({"role": "prefill", "url": f"http://127.0.0.1:{9000 + n}",
                      "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "model": "tiny",
                      "gen": gen})

    def view(self) -> dict[int, int]:
        return {int(w.instance_id[1:]): w.record["gen"] for w in self.pools.pool(PREFILL)
                if w.source == "etcd"}


class RestartsUser(User):
    name = "prefill restart watch"

    def __init__(self, client: EtcdClient, layout: KeyLayout) -> None:
        super().__init__(client, layout)
        self.reported: list[str] = []

        async def on_change(addr: str, reason: str) -> None:
            self.reported.append(addr)

        self.follower = self.watch = PrefillRestarts(client, layout, on_change,
                                                     progress_every=PROGRESS, stale_after=STALE)

    def key(self, n: int) -> bytes:
        return self.layout.instance(f"p{n}")

    def value(self, n: int, gen: int) -> bytes:
        return dumps({"instance_id": f"p{n}", "role": "prefill", "url": "http://127.0.0.1:1",
                      "bootstrap_host": "127.0.0.1", "bootstrap_port": 9000 + n,
                      "started_at": gen, "ready": True})

    def view(self) -> dict[int, int]:
        # ``known`` keeps an identity after a delete until the next snapshot (see its module).
        return {int(key.rsplit(b"/", 1)[1][1:]): ident[1]  # type: ignore[misc]
                for key, ident in self.watch.known.items()}

    def noticed_rewrite(self, n: int) -> bool:
        return f"127.0.0.1:{9000 + n}" in self.reported


USERS = [MirrorUser, DiscoveryUser, RestartsUser]
UserFactory = Callable[[EtcdClient, KeyLayout], User]


@pytest.fixture(params=USERS, ids=lambda u: u.name.replace(" ", "-"))
def user_type(request: pytest.FixtureRequest) -> UserFactory:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def own_etcd() -> Iterator[EtcdCluster]:
    """An etcd of this test alone, because the test stops and restarts it."""
    cluster = EtcdCluster(1).start()
    yield cluster
    cluster.stop()


@contextlib.asynccontextmanager
async def _running(user: User) -> AsyncIterator[User]:
    user.follower.start()
    try:
        assert await user.follower.wait_ready(DEADLINE)
        yield user
    finally:
        await user.follower.close()


async def _saw(user: User, want: dict[int, int], what: str) -> None:
    await eventually(lambda: user.view() == want, DEADLINE,
                     f"{user.name} to see {want} {what} (sees {user.view()}; "
                     f"{user.follower.follow_stats()})")


async def _put_retrying(client: EtcdClient, key: bytes, value: bytes) -> None:
    """A put from a client whose channel may still be reconnecting to a restarted etcd."""
    failures: list[EtcdError] = []

    async def put() -> bool:
        try:
            await client.put(key, value)
        except EtcdError as exc:
            failures.append(exc)
            return False
        return True

    await wait_until(put, what=f"the restarted etcd takes a put of {key!r}", timeout=DEADLINE,
                     interval=0.1, detail=lambda: failures[-1:])


async def test_etcd_restarted(user_type: UserFactory, own_etcd: EtcdCluster) -> None:
    settings = EtcdSettings.from_text(own_etcd.endpoints, timeout=1.0)
    layout = KeyLayout(prefix="/follow-restart")
    async with EtcdClient(settings) as writer, EtcdClient(settings) as client:
        user = user_type(client, layout)
        await writer.put(user.key(1), user.value(1, 1))
        async with _running(user):
            await _saw(user, {1: 1}, "before the restart")
            member = own_etcd.members[0]
            await asyncio.to_thread(member.stop)
            await eventually(lambda: user.follower.disconnects >= 1, DEADLINE,
                             f"{user.name} to notice etcd gone")
            assert user.view() == {1: 1}, "the last known state is kept while etcd is away"
            await asyncio.to_thread(member.start)
            await asyncio.to_thread(member.wait_ready)
            await _put_retrying(writer, user.key(1), user.value(1, 2))
            await _put_retrying(writer, user.key(2), user.value(2, 1))
            await _saw(user, {1: 2, 2: 1}, "after the restart")
            assert user.noticed_rewrite(1)
            await eventually(lambda: user.follower.connected, DEADLINE,
                             f"{user.name} connected again")


async def test_compaction_past_the_watchers_revision(
        user_type: UserFactory, etcd: EtcdClient, etcd_settings: EtcdSettings,
        layout: KeyLayout) -> None:
    async with CutWatchClient(etcd_settings) as client:
        user = user_type(client, layout)
        for n in (1, 2):
            await etcd.put(user.key(n), user.value(n, 1))
        async with _running(user):
            await _saw(user, {1: 1, 2: 1}, "before the cut")
            compactions = user.follower.compactions
            client.cut = True
            await eventually(lambda: user.follower.disconnects >= 1, DEADLINE,
                             f"{user.name} to notice the cut")
            await etcd.delete(user.key(1))
            await etcd.put(user.key(2), user.value(2, 2))
            await etcd.put(user.key(3), user.value(3, 1))
            await etcd.compact((await etcd.status()).revision)
            client.cut = False
            await _saw(user, {2: 2, 3: 1}, "after the compaction")
            assert user.follower.compactions > compactions, user.follower.follow_stats()
            assert user.noticed_rewrite(2)
            # It follows the watch again from the snapshot's revision.
            await etcd.put(user.key(4), user.value(4, 1))
            await _saw(user, {2: 2, 3: 1, 4: 1}, "after the reload")


async def test_a_watch_that_goes_silent(user_type: UserFactory, etcd: EtcdClient,
                                        etcd_settings: EtcdSettings, layout: KeyLayout) -> None:
    async with HeldWatchClient(etcd_settings) as client:
        user = user_type(client, layout)
        for n in (1, 2):
            await etcd.put(user.key(n), user.value(n, 1))
        async with _running(user):
            await _saw(user, {1: 1, 2: 1}, "before the stream goes silent")
            reloads = user.follower.reloads
            client.held = True  # from here the stream delivers nothing, and raises nothing
            await etcd.delete(user.key(1))
            await etcd.put(user.key(2), user.value(2, 2))
            await etcd.put(user.key(3), user.value(3, 1))
            # Still held: only a snapshot can bring these.
            await _saw(user, {2: 2, 3: 1}, "behind a silent watch")
            assert user.follower.reloads > reloads and user.follower.disconnects >= 1, (
                user.follower.follow_stats())
            assert user.noticed_rewrite(2)
            client.held = False
            await etcd.put(user.key(4), user.value(4, 1))
            await _saw(user, {2: 2, 3: 1, 4: 1}, "once the stream delivers again")
            await eventually(lambda: user.follower.connected, DEADLINE,
                             f"{user.name} connected again")
