"""Transfer state machine, the one error type of the data plane, and its timeout configuration.

The states follow SGLang's ``KVPoll`` (Bootstrapping -> WaitingForInput -> Transferring -> Success)
so that a worker can poll a transfer the way SGLang's scheduler does. Moves are forward only, and
Failed is sticky: once a transfer failed, nothing can revive it, because its pages may already have
been released to the pool and reused by another request.
"""
from __future__ import annotations

import argparse
import enum
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from transfer.auth import check_key

#: Where the KV transfer key comes from: the environment only, never a flag, since every user of a
#: host can read command lines (``ps``).
TRANSFER_KEY_ENV = "KVATLAS_TRANSFER_KEY"


class TransferState(enum.IntEnum):
    """Where one transfer (one room on one rank) stands. Values grow along the happy path."""

    BOOTSTRAPPING = 1
    """Prefill: waiting for the decode rank(s) to ask for this room. Decode: connecting/registering."""
    WAITING_FOR_INPUT = 2
    """Prefill: every decode rank asked; waiting for the KV to be computed. Decode: request sent."""
    TRANSFERRING = 3
    """Pages are on the wire."""
    SUCCESS = 4
    """Prefill: the decode confirmed. Decode: every page validated and written."""
    FAILED = 5
    """Terminal and sticky; ``TransferStatus.error`` says why."""

    @property
    def terminal(self) -> bool:
        return self in (TransferState.SUCCESS, TransferState.FAILED)


class TransferLayerError(Exception):
    """Root of the transfer layer's errors: ``TransferError`` (a transfer failed),
    ``transfer.wire.WireError`` (a message that cannot be decoded), ``InvalidTransition`` (a
    bug) and ``transfer.backends.cuda_ipc.BackendUnavailable`` (a backend this machine lacks)."""


class InvalidTransition(TransferLayerError, RuntimeError):
    """A programming error: a transfer was moved backwards, sideways, or out of a terminal state."""


class TransferError(TransferLayerError):
    """A transfer of ``room`` failed; ``reason`` says what went wrong and what to check.

    ``peer`` names the other side (an endpoint), ``stage`` the state reached when it failed,
    ``expected``/``actual`` the values that disagreed (rooms, checksums, layouts), and
    ``released_pages`` the destination pages that were given back as free (decode side).
    """

    def __init__(self, room: int | None, reason: str, *, peer: str | None = None,
                 stage: TransferState | None = None, expected: Any = None, actual: Any = None,
                 released_pages: Sequence[int] = ()) -> None:
        self.room = room
        self.reason = reason
        self.peer = peer
        self.stage = stage
        self.expected = expected
        self.actual = actual
        self.released_pages: tuple[int, ...] = tuple(released_pages)
        where = f" (peer {peer})" if peer else ""
        at = f" [stage {stage.name}]" if stage is not None else ""
        what = f"transfer of room {room}" if room is not None else "KV transfer connection"
        super().__init__(f"{what}{where}{at}: {reason}")

    def with_context(self, *, room: int | None = None, stage: TransferState | None = None,
                     released_pages: Sequence[int] | None = None) -> TransferError:
        """A copy carrying the room (when it was unknown), the stage reached and the pages
        released (filled in by the backend)."""
        return TransferError(self.room if self.room is not None else room, self.reason,
                             peer=self.peer, stage=self.stage if stage is None else stage,
                             expected=self.expected, actual=self.actual,
                             released_pages=self.released_pages if released_pages is None
                             else released_pages)

    @classmethod
    def room_mismatch(cls, expected: int, actual: int, peer: str | None = None,
                      detail: str = "") -> TransferError:
        return cls(expected, f"bootstrap_room mismatch: expected {expected}, got {actual}{detail}; "
                   "the sender bound another request's KV to this transfer (check the prefill's "
                   "room -> request binding and the router's bootstrap_room injection); that KV "
                   "was not written, and the room's reserved pages are released uncommitted",
                   peer=peer, expected=expected, actual=actual)

    @classmethod
    def checksum_mismatch(cls, room: int, expected: int, actual: int, peer: str | None,
                          detail: str = "") -> TransferError:
        return cls(room, f"checksum mismatch{detail}: header says {expected:#018x}, received bytes "
                   f"hash to {actual:#018x}; the pages were corrupted in flight or changed while "
                   "being sent (check that the prefill keeps source pages pinned until the transfer "
                   "succeeds); the chunk was not written, and the room's reserved pages are "
                   "released uncommitted", peer=peer, expected=expected, actual=actual)


_FORWARD = (TransferState.BOOTSTRAPPING, TransferState.WAITING_FOR_INPUT,
            TransferState.TRANSFERRING, TransferState.SUCCESS)


class TransferStatus:
    """The state of one transfer, with the time each state was entered.

    ``advance(to)`` moves strictly forward along Bootstrapping -> ... -> Success (skipping states is
    allowed, e.g. a fake backend that never waits); ``fail(error)`` moves to Failed from any
    non-terminal state. Any other move raises :class:`InvalidTransition`. Failing an already failed
    transfer keeps the first error and returns False, because a timeout and a peer abort can race.
    """

    def __init__(self, room: int, state: TransferState = TransferState.BOOTSTRAPPING) -> None:
        if state not in _FORWARD[:-1]:
            raise InvalidTransition(f"a transfer must start in a non-terminal state, not {state.name}")
        self.room = room
        self.state = state
        self.error: TransferError | None = None
        self.history: list[tuple[TransferState, float]] = [(state, time.monotonic())]

    def advance(self, to: TransferState) -> None:
        if to is TransferState.FAILED:
            raise InvalidTransition("use fail(error) to fail a transfer")
        if self.state.terminal or to <= self.state:
            raise InvalidTransition(f"room {self.room}: illegal transition {self.state.name} -> "
                                    f"{to.name} (transfers move forward only; Failed and Success "
                                    "are final)")
        self._enter(to)

    def fail(self, error: TransferError) -> bool:
        """Move to Failed; False (and the first error kept) when it had failed already."""
        if self.state is TransferState.FAILED:
            return False
        if self.state is TransferState.SUCCESS:
            raise InvalidTransition(f"room {self.room}: a transfer that succeeded cannot fail "
                                    f"afterwards ({error.reason})")
        self.error = error if error.stage is not None else error.with_context(stage=self.state)
        self._enter(TransferState.FAILED)
        return True

    def _enter(self, to: TransferState) -> None:
        self.state = to
        self.history.append((to, time.monotonic()))

    def seconds_in(self, state: TransferState) -> float | None:
        """How long the transfer stayed in ``state`` (up to now if it is still there)."""
        for i, (s, t) in enumerate(self.history):
            if s is state:
                end = self.history[i + 1][1] if i + 1 < len(self.history) else time.monotonic()
                return end - t
        return None

    def __repr__(self) -> str:
        return f"TransferStatus(room={self.room}, state={self.state.name})"


@dataclass
class TransferConfig:
    """Timeouts and sizes of the KV data plane (one per sender or receiver)."""

    bootstrap_timeout_s: float = 300.0
    """Prefill: how long a room waits for every decode rank to ask for it (SGLang: 300 s)."""
    waiting_timeout_s: float = 300.0
    """Decode: how long a room waits for all of its KV after asking (SGLang: 300 s). The prefill
    uses it too, for the decode's confirmation after the last page went out."""
    heartbeat_interval_s: float = 5.0
    """Seconds between health probes of one prefill peer (SGLang: 5 s)."""
    heartbeat_max_misses: int = 2
    """Consecutive missed probes after which a peer is declared dead: its in-flight transfers fail
    and its cached connection is dropped (SGLang: 2)."""
    connect_timeout_s: float = 5.0
    """Decode: how long layout registration with a prefill rank may take (SGLang's HTTP calls: 5 s)."""
    chunk_bytes: int = 2 << 20
    """Target payload of one pages message. Smaller chunks let the decode validate and write while
    later chunks are in flight, and keep each received chunk in the CPU cache between the socket
    read, the checksum and the copy into the pool; larger ones cost fewer headers and per-message
    handling. 2 MiB (about one core's L2) measured best on loopback: 16 MiB chunks are checksummed
    and copied from DRAM and were ~25% slower."""
    early_request_ttl_s: float = 300.0
    """Prefill: how long a decode's request for a room the prefill has not seen yet is kept."""
    max_early_requests: int = 4096
    """Prefill: at most this many requests and aborts for rooms it has not seen yet are kept
    (each holds no page ids, only their count, so a few hundred bytes); beyond it a request is
    answered with an abort instead of being stored."""
    key: str | None = field(default=None, repr=False, metadata={"cli": False})
    """The MAC key shared by every prefill and decode rank (see ``transfer.auth``); None: messages
    are not authenticated (a warning at start-up). ``from_cli_args`` reads it from
    ``$KVATLAS_TRANSFER_KEY``; there is no flag."""

    def __post_init__(self) -> None:
        for name in ("bootstrap_timeout_s", "waiting_timeout_s", "heartbeat_interval_s",
                     "connect_timeout_s", "early_request_ttl_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"TransferConfig.{name} must be a positive number of seconds, "
                                 f"got {value!r}")
        if not isinstance(self.heartbeat_max_misses, int) or self.heartbeat_max_misses < 1:
            raise ValueError("TransferConfig.heartbeat_max_misses must be an integer >= 1, got "
                             f"{self.heartbeat_max_misses!r}")
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 4096:
            raise ValueError(f"TransferConfig.chunk_bytes must be an integer >= 4096, got "
                             f"{self.chunk_bytes!r}")
        if not isinstance(self.max_early_requests, int) or self.max_early_requests < 1:
            raise ValueError("TransferConfig.max_early_requests must be an integer >= 1, got "
                             f"{self.max_early_requests!r}")
        if self.key is not None:
            try:
                check_key(self.key)
            except ValueError as e:
                raise ValueError(f"TransferConfig.key (${TRANSFER_KEY_ENV}): {e}") from None

    @property
    def heartbeat_deadline_s(self) -> float:
        """Time from the last answered probe until a peer counts as dead."""
        return self.heartbeat_interval_s * self.heartbeat_max_misses

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("KV transfer")
        for f in _cli_fields(cls):
            flag = "--transfer-" + f.name.removesuffix("_s").replace("_", "-")
            group.add_argument(flag, dest=f"transfer_{f.name}", type=type(f.default),
                               default=f.default, help=f"(default {f.default})")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> TransferConfig:
        return cls(**{f.name: getattr(args, f"transfer_{f.name}") for f in _cli_fields(cls)},
                   key=os.environ.get(TRANSFER_KEY_ENV) or None)


def _cli_fields(cls: type) -> list[Any]:
    return [f for f in fields(cls) if f.metadata.get("cli", True)]


__all__ = ["TransferState", "TransferStatus", "TransferError", "InvalidTransition",
           "TransferConfig", "TRANSFER_KEY_ENV", "host_identity"]


def host_identity() -> str:
    """Identifies this machine (hostname + boot id), so that two ranks can tell whether CUDA IPC
    between them is possible: handles are only valid on the same host and the same boot."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
