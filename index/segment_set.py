"""An instance's held blocks grouped in chain segments, and which segments changed: the block
writer's data, kept apart from its etcd I/O (``index.writer``).

Rules (``index.segments`` says why):

- a stored chain goes into one segment of at most ``MAX_SEGMENT_BLOCKS``; a block whose parent
  ends a segment joins it (a decode storing one block at a time extends its prompt's segment);
- a held block never changes segment, even when its medium does;
- a removed block keeps its segment until the removal is in etcd (``settle``): one that returns
  before that goes back to the same segment, so no reader ever sees a block enter a segment
  before it left another.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from index.segments import MAX_SEGMENT_BLOCKS, encode

Entry = tuple[str, "int | None"]  # (medium, parent hash or None)


class SegmentSet:
    """Blocks (hash -> medium, parent) in segments; ``dirty`` lists the segments to write."""

    def __init__(self) -> None:
        self.blocks: dict[int, Entry] = {}
        self.segs: dict[int, dict[int, None]] = {}
        """Segment id -> its held hashes in chain order (empty until its delete is written)."""
        self.parents: dict[int, int | None] = {}
        self.seg_of: dict[int, int] = {}
        """Segment of every held block, and of every removed one not settled yet."""
        self.leaving: dict[int, set[int]] = {}
        """Per segment, blocks removed from it and not settled yet."""
        self.dirty: dict[int, None] = {}
        """Segments changed since they were last taken (insertion-ordered)."""
        self.written: dict[int, int] = {}
        """Per segment, a fingerprint of the content last handed out to be written: a segment
        changed and changed back is not written again."""
        self.track = True
        """False while the writer will rewrite everything anyway: nothing is marked dirty."""
        self._next = 0

    def __len__(self) -> int:
        return len(self.blocks)

    # --- changes ------------------------------------------------------------------------------

    def add(self, parent: int | None, hashes: Sequence[int], medium: str) -> int:
        """``hashes`` (consecutive after ``parent``) held on ``medium``; returns blocks changed."""
        blocks, seg_of, segs = self.blocks, self.seg_of, self.segs
        prev = parent
        changed = 0
        for h in hashes:
            before, prev = prev, h
            old = blocks.get(h)
            if old is not None:
                if old[0] != medium:
                    blocks[h] = (medium, before)
                    self._mark(seg_of[h])
                    changed += 1
                elif old[1] != before:
                    blocks[h] = (medium, before)  # the parent alone: etcd keeps segment parents
                continue
            changed += 1
            s = seg_of.get(h)
            if s is not None:
                # Its removal is not settled (maybe in a write in flight): back where it was.
                gone = self.leaving.get(s)
                if gone:
                    gone.discard(h)
                self.parents.setdefault(s, before)  # the segment may have been written empty
            else:
                s = self._tail(before)
                if s is None:
                    s = self._next
                    self._next += 1
                    self.parents[s] = before
                seg_of[h] = s
            blocks[h] = (medium, before)
            seg = segs.get(s)
            if seg is None:
                seg = segs[s] = {}
            seg[h] = None
            self._mark(s)
        return changed

    def _tail(self, parent: int | None) -> int | None:
        """The segment ``parent`` ends, if a block after it may join it."""
        if parent is None or parent not in self.blocks:
            return None
        s = self.seg_of[parent]
        seg = self.segs.get(s)
        if not seg or len(seg) >= MAX_SEGMENT_BLOCKS or next(reversed(seg)) != parent:
            return None
        return s

    def remove(self, hashes: Sequence[int]) -> int:
        """``hashes`` no longer held (unknown ones ignored); returns blocks removed."""
        blocks, seg_of, segs, leaving = self.blocks, self.seg_of, self.segs, self.leaving
        changed = 0
        for h in hashes:
            if blocks.pop(h, None) is None:
                continue
            s = seg_of[h]
            del segs[s][h]
            gone = leaving.get(s)
            if gone is None:
                gone = leaving[s] = set()
            gone.add(h)
            self._mark(s)
            changed += 1
        return changed

    def clear(self) -> int:
        """Forget everything (the writer range-deletes the prefix); returns blocks dropped."""
        n = len(self.blocks)
        self.blocks.clear()
        self.segs.clear()
        self.parents.clear()
        self.seg_of.clear()
        self.leaving.clear()
        self.dirty.clear()
        self.written.clear()
        return n

    def _mark(self, s: int) -> None:
        if self.track:
            self.dirty[s] = None

    # --- what to write ------------------------------------------------------------------------

    def _fingerprint(self, s: int) -> int | None:
        """Of the segment's blocks and media, in any order: a block that left and came back
        (appended at the end now) changes nothing a reader uses."""
        seg = self.segs.get(s)
        if not seg:
            return None
        blocks = self.blocks
        return _fingerprint(self.parents.get(s), seg, (blocks[h][0] for h in seg))

    def changed(self, s: int) -> bool:
        """Whether ``s`` differs from what was last handed out to be written."""
        return self._fingerprint(s) != self.written.get(s)

    def value(self, s: int, t: float) -> bytes | None:
        """Segment ``s``'s value written at ``t``, recorded as written; None when it is empty
        (delete its key, and it is forgotten)."""
        seg = self.segs.get(s)
        if not seg:
            self.segs.pop(s, None)
            self.parents.pop(s, None)
            self.written.pop(s, None)
            return None
        blocks = self.blocks
        media = [blocks[h][0] for h in seg]
        self.written[s] = _fingerprint(self.parents.get(s), seg, media)
        return encode(t, self.parents[s], list(seg), media)

    def take_removals(self, s: int) -> set[int]:
        """The unsettled removals of ``s`` (a write of it now carries them)."""
        return self.leaving.pop(s, None) or set()

    def settle(self, removals: dict[int, set[int]]) -> None:
        """These removals are in etcd: the blocks may join any segment when they return."""
        seg_of, blocks = self.seg_of, self.blocks
        for s, hashes in removals.items():
            for h in hashes:
                if h not in blocks and seg_of.get(h) == s:
                    del seg_of[h]

    def unsettle(self, removals: dict[int, set[int]]) -> None:
        """A write that may or may not have landed: its removals stay unsettled."""
        for s, hashes in removals.items():
            left = {h for h in hashes if h not in self.blocks and self.seg_of.get(h) == s}
            if left:
                self.leaving.setdefault(s, set()).update(left)

    def take_all_removals(self) -> dict[int, set[int]]:
        leaving, self.leaving = self.leaving, {}
        return leaving

    def live(self) -> Iterator[int]:
        """Ids of the segments holding blocks (empty ones are dropped on the way)."""
        for s in list(self.segs):
            if self.segs[s]:
                yield s
            else:
                del self.segs[s]
                self.parents.pop(s, None)

    def size(self, s: int) -> int:
        return len(self.segs.get(s) or ())

    @property
    def segments(self) -> int:
        return sum(1 for seg in self.segs.values() if seg)


def _fingerprint(parent: int | None, hashes: Iterable[int], media: Iterable[str]) -> int:
    return hash((parent, frozenset(zip(hashes, media))))
