"""The pure-Python ``BlockTable`` and what both table backends share (``index.table``).

``TableBase`` keeps what stays in Python whichever backend runs: instance ids interned to small
integer *slots* (slot ``s`` is bit ``1 << s``), the media of blocks held on something other than
the GPU (``hash -> {slot: medium}``; GPU is the common case and costs nothing extra), the table
version, and the reads built on ``lookup`` (``lookup_detailed``, ``lookup_tiers``). A backend
supplies the block store: which slots hold which block, and ``lookup``.

``PyBlockTable`` stores it in dicts and sets:

- ``masks``: block hash -> int bitmask of the slots holding it (one dict entry per distinct
  block, whatever the number of instances holding it);
- ``held``: per slot, the set of hashes it holds (for ``blocks``, ``clear`` and resync).

Its ``lookup`` walks the prompt's hashes with ``active &= mask`` and records, for each bit that
drops, the number of blocks matched so far; it stops as soon as no instance matches any more.
Cost: one dict probe and one big-int AND per prompt block (the AND is O(instances / 64) words),
independent of the number of blocks indexed. It is the fallback where the compiled core
(``index.table_core``) did not build, and the reference the same contract tests check both with.

Not thread-safe: every caller runs it on one asyncio loop.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import reduce
from itertools import count, repeat
from operator import and_

from index.tiers import DEVICE, DISK, HOST, TierMatch, tier_of

GPU = "GPU"

# Table versions come from one process-wide sequence: a version names one table's content, so
# that readers may cache a lookup result for as long as the version they saw is current.
_versions = count(1)
# Prompt blocks ``lookup`` checks at once before walking them one by one.
_CHUNK = 16
_zeros = repeat(0)


class TableBase:
    """Slots, media and version of a block table; subclasses store which slot holds what."""

    __slots__ = ("_slots", "_names", "_free", "_media", "version")

    def __init__(self) -> None:
        self.version = 0
        """Changes at every write (0: never written, hence empty); unique across tables."""
        self._slots: dict[str, int] = {}
        self._names: list[str | None] = []
        self._free: list[int] = []
        self._media: dict[int, dict[int, str]] = {}

    # -- what a backend supplies -------------------------------------------------------------

    def _new_slot(self, slot: int) -> None:
        """Slot ``slot`` (== its count so far) is used for the first time."""

    def _held_count(self, slot: int) -> int:
        raise NotImplementedError

    def _holds(self, slot: int, h: int) -> bool:
        raise NotImplementedError

    def _held_blocks(self, slot: int) -> set[int]:
        raise NotImplementedError

    def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        """For each instance holding ``hashes[0]``, how many leading blocks of ``hashes`` it holds."""
        raise NotImplementedError

    def __len__(self) -> int:
        """Distinct blocks indexed (a block held by several instances counts once)."""
        raise NotImplementedError

    # -- slots -------------------------------------------------------------------------------

    def _slot(self, instance: str) -> int:
        slot = self._slots.get(instance)
        if slot is not None:
            return slot
        if self._free:
            # Reuse the lowest free slot so masks stay as narrow as the live instance count.
            self._free.sort(reverse=True)
            slot = self._free.pop()
            self._names[slot] = instance
        else:
            slot = len(self._names)
            self._names.append(instance)
            self._new_slot(slot)
        self._slots[instance] = slot
        return slot

    def _release_if_empty(self, slot: int) -> None:
        if not self._held_count(slot):
            name = self._names[slot]
            if name is not None:
                del self._slots[name]
            self._names[slot] = None
            self._free.append(slot)

    # -- media -------------------------------------------------------------------------------

    def _set_media(self, slot: int, hashes: list[int], medium: str | None) -> None:
        media = self._media
        if medium is not None and medium != GPU:
            for h in hashes:
                media.setdefault(h, {})[slot] = medium
        elif media:
            for h in hashes:
                self._drop_medium(h, slot)

    def _drop_medium(self, h: int, slot: int) -> None:
        per = self._media.get(h)
        if per is not None and per.pop(slot, None) is not None and not per:
            del self._media[h]

    # -- writes shared by both backends ------------------------------------------------------

    def _bump(self) -> None:
        self.version = next(_versions)

    def replace_instance(self, instance: str, blocks: dict[int, str | None]) -> None:
        """Make ``instance`` hold exactly ``blocks`` (hash -> medium), e.g. after a reload."""
        self.clear_instance(instance)  # type: ignore[attr-defined]
        by_medium: dict[str | None, list[int]] = {}
        for h, medium in blocks.items():
            by_medium.setdefault(medium if medium != GPU else None, []).append(h)
        for medium, hashes in by_medium.items():
            self.apply_add(instance, hashes, medium)  # type: ignore[attr-defined]

    def clear(self) -> None:
        """Forget everything."""
        self.__init__()  # type: ignore[misc]
        self._bump()

    # -- reads -------------------------------------------------------------------------------

    def lookup_detailed(self, hashes: Sequence[int]) -> dict[str, tuple[int, int]]:
        """``{instance: (matched, gpu_matched)}``: ``gpu_matched`` counts the leading blocks of the
        match that are on the GPU (the part a prefill can reuse without a host-to-device copy)."""
        matched = self.lookup(hashes)
        if not matched:
            return {}
        media = self._media
        out: dict[str, tuple[int, int]] = {}
        for name, m in matched.items():
            slot = self._slots[name]
            gpu = m
            if media:
                for i in range(m):
                    per = media.get(hashes[i])
                    if per is not None and slot in per:
                        gpu = i
                        break
            out[name] = (m, gpu)
        return out

    def lookup_tiers(self, hashes: Sequence[int]) -> dict[str, TierMatch]:
        """``lookup``, with each instance's matched prefix split by tier (``index.tiers``).
        Free beyond ``lookup`` while every block is on the device (no media kept); else one
        probe per matched block of the instances holding something elsewhere."""
        matched = self.lookup(hashes)
        if not matched:
            return {}
        media = self._media
        if not media:
            return {name: TierMatch(device=m) for name, m in matched.items()}
        out: dict[str, TierMatch] = {}
        for name, m in matched.items():
            slot = self._slots[name]
            counts = {DEVICE: 0, HOST: 0, DISK: 0}
            for i in range(m):
                per = media.get(hashes[i])
                counts[tier_of(per.get(slot) if per is not None else None)] += 1
            out[name] = TierMatch(counts[DEVICE], counts[HOST], counts[DISK])
        return out

    def medium(self, instance: str, h: int) -> str | None:
        """The medium ``instance`` holds block ``h`` on, or None when it does not hold it."""
        slot = self._slots.get(instance)
        if slot is None or not self._holds(slot, h):
            return None
        per = self._media.get(h)
        return per.get(slot, GPU) if per else GPU

    def blocks(self, instance: str) -> set[int]:
        """A copy of the hashes ``instance`` holds."""
        slot = self._slots.get(instance)
        return self._held_blocks(slot) if slot is not None else set()

    def count(self, instance: str) -> int:
        slot = self._slots.get(instance)
        return self._held_count(slot) if slot is not None else 0

    def holds(self, instance: str, h: int) -> bool:
        slot = self._slots.get(instance)
        return slot is not None and self._holds(slot, h)

    def instances(self) -> set[str]:
        """Instances holding at least one block."""
        return set(self._slots)

    def entries(self) -> int:
        """(instance, block) pairs indexed."""
        return sum(self._held_count(s) for s in self._slots.values())


class PyBlockTable(TableBase):
    """Blocks held per instance in dicts and sets, with a fast longest-prefix lookup."""

    __slots__ = ("_bits", "_held", "_masks")

    def __init__(self) -> None:
        super().__init__()
        # One shared int object per slot: a block held by a single instance stores this object
        # itself as its mask, so single-holder blocks cost no extra int allocation.
        self._bits: list[int] = []
        self._held: list[set[int]] = []
        self._masks: dict[int, int] = {}

    def _new_slot(self, slot: int) -> None:
        self._bits.append(1 << slot)
        self._held.append(set())

    def _held_count(self, slot: int) -> int:
        return len(self._held[slot])

    def _holds(self, slot: int, h: int) -> bool:
        return h in self._held[slot]

    def _held_blocks(self, slot: int) -> set[int]:
        return set(self._held[slot])

    # -- writes ----------------------------------------------------------------------------

    def apply_add(self, instance: str, hashes: Iterable[int], medium: str | None = GPU) -> None:
        """Record that ``instance`` holds ``hashes`` on ``medium`` (None means GPU)."""
        hashes = list(hashes)
        if not hashes:
            return
        self._bump()
        slot = self._slot(instance)
        bit = self._bits[slot]
        masks = self._masks
        get = masks.get
        for h in hashes:
            m = get(h)
            masks[h] = bit if m is None else (m | bit)
        self._held[slot].update(hashes)
        self._set_media(slot, hashes, medium)

    def apply_remove(self, instance: str, hashes: Iterable[int]) -> None:
        """Forget ``hashes`` on ``instance``; hashes it does not hold are ignored."""
        slot = self._slots.get(instance)
        if slot is None:
            return
        self._bump()
        held = self._held[slot]
        bit = self._bits[slot]
        masks = self._masks
        media = self._media
        for h in hashes:
            if h not in held:
                continue
            held.discard(h)
            self._unset(masks, h, bit)
            if media:
                self._drop_medium(h, slot)
        self._release_if_empty(slot)

    @staticmethod
    def _unset(masks: dict[int, int], h: int, bit: int) -> None:
        m = masks[h] & ~bit
        if m:
            masks[h] = m
        else:
            del masks[h]

    def clear_instance(self, instance: str) -> int:
        """Forget every block of ``instance``; returns how many it held."""
        slot = self._slots.get(instance)
        if slot is None:
            return 0
        self._bump()
        held = self._held[slot]
        n = len(held)
        bit = self._bits[slot]
        masks = self._masks
        media = self._media
        for h in held:
            self._unset(masks, h, bit)
            if media:
                self._drop_medium(h, slot)
        self._held[slot] = set()
        self._release_if_empty(slot)
        return n

    # -- reads -----------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        """For each instance holding ``hashes[0]``, how many leading blocks of ``hashes`` it holds."""
        if not hashes:
            return {}
        get = self._masks.get
        active = get(hashes[0], 0)
        if not active:
            return {}
        names = self._names
        out: dict[str, int] = {}
        n = len(hashes)
        i = 1
        step = _CHUNK
        while i < n:
            end = min(i + step, n)
            # A chunk no instance drops out of (the usual case on a long cached prefix) is
            # checked at C speed; only a chunk where one does is walked block by block. Chunks
            # double while they pass, so the walk repeats at most as many blocks as matched.
            if reduce(and_, map(get, hashes[i:end], _zeros), active) == active:
                i = end
                step += step
                continue
            for i in range(i, end):  # noqa: B020 (i resumes where the galloping step stopped)
                nxt = active & get(hashes[i], 0)
                if nxt != active:
                    dropped = active ^ nxt
                    while dropped:
                        low = dropped & -dropped
                        out[names[low.bit_length() - 1]] = i  # type: ignore[index]
                        dropped ^= low
                    active = nxt
                    if not active:
                        return out
            i = end
        while active:
            low = active & -active
            out[names[low.bit_length() - 1]] = n  # type: ignore[index]
            active ^= low
        return out

    def __len__(self) -> int:
        return len(self._masks)

    def entries(self) -> int:
        return sum(len(s) for s in self._held)
