"""Stop the whole instance when one of its local rank processes dies.

Every scheduler step of a TP/DP instance is a collective over all its ranks, so an instance
that lost a rank can serve nothing, yet its leader would keep its lease and stay in the
router's pools. The watch notices the death at once (a process sentinel, no polling), asks the
leader to shut down as on SIGTERM (its lease is revoked, so routers drop it within a second),
and exits the process if that shutdown is itself stuck on the dead rank.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Sequence
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

logger = logging.getLogger(__name__)


CONFIRM_S = 2.0
"""How long a rank's exit may precede the instance's own stop and still count as part of it: a
signal to the whole process group (``cluster down``, Ctrl-C) can end the ranks a moment before
the leader starts stopping."""


class RankWatch:
    def __init__(self, children: Sequence[BaseProcess], grace_s: float = 15.0,
                 confirm_s: float = CONFIRM_S) -> None:
        self.children = list(children)
        self.grace_s = grace_s
        self.confirm_s = confirm_s
        self.dead: BaseProcess | None = None
        """The first rank process that exited while the instance was serving."""
        self._stopping = threading.Event()

    def start(self) -> None:
        if self.children:
            threading.Thread(target=self._run, name="kvatlas-rank-watch", daemon=True).start()

    def stop(self) -> None:
        """The instance is stopping on purpose (call it as the stop begins, before the ranks
        are told to leave): rank exits from now on are expected."""
        self._stopping.set()

    def _run(self) -> None:
        by_sentinel = {p.sentinel: p for p in self.children}
        ready = wait(list(by_sentinel))
        if self._stopping.wait(self.confirm_s):
            return
        self.dead = by_sentinel[ready[0]]  # type: ignore[index]
        logger.error("rank process %s exited (code %s): stopping this instance, which cannot "
                  "serve without it; restart the instance", self.dead.name, self.dead.exitcode)
        os.kill(os.getpid(), signal.SIGTERM)
        if self._stopping.wait(self.grace_s):
            return
        logger.error("the instance did not stop within %.0f s of losing a rank: exiting now",
                  self.grace_s)
        os._exit(1)
