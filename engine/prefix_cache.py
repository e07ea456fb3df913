"""Prefix cache over the paged pool: full blocks keyed by the DESIGN hash chain, LRU eviction of
blocks no request references, and KV events recorded as data.

A page becomes a cached block once all ``page_size`` positions of it hold K/V; its key is the
chained hash of its tokens (``index.hashing``), so one key names the whole prefix up to it. A new
request reuses the longest run of leading blocks whose keys are cached. When a request ends its
pages are released tail first, so a chain's tail is older in the LRU than its head and eviction
eats prefixes from the end, keeping the shared heads.

Every change is appended to ``events`` (``BlockStored`` per run of newly stored consecutive blocks,
``BlockRemoved`` per eviction batch, ``AllBlocksCleared`` on flush); a publisher drains them. The
engine hash in the events is kvatlas's own chained hash. Replaying the events in order reproduces
``blocks()`` exactly.

**Host tier** (``host_pages`` > 0). An evicted block is not dropped but copied to a host LRU of
``host_pages`` blocks (real tensors, ``KVPool.read_pages``), and published as vLLM's offloading
does: ``BlockStored(medium="CPU")`` for the copy, then ``BlockRemoved(medium="GPU")``, so the
index moves it to the host tier instead of forgetting it. A request whose prefix continues on
the host gets those blocks copied back into fresh pages (``BlockStored(GPU)``, then
``BlockRemoved(CPU)``: the tier is exclusive); a block pushed out of the host LRU is
``BlockRemoved(CPU)``.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from engine.errors import PoolExhausted
from engine.kv_pool import KVPool
from index.events.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from index.hashing import BASE_SEED, block_hashes

DEVICE_MEDIUM = "GPU"
"""The device tier's medium in events once a host tier exists (whatever the device: the index
reads it as the device tier)."""
HOST_MEDIUM = "CPU"


class PrefixCache:
    """Block-keyed cache on top of ``pool``; ``enabled=False`` never stores or matches."""

    def __init__(self, pool: KVPool, seed: int = BASE_SEED, enabled: bool = True,
                 medium: str | None = None, host_pages: int = 0) -> None:
        if host_pages < 0:
            raise ValueError(f"host_pages must be >= 0, got {host_pages}")
        self.pool = pool
        self.seed = seed
        self.enabled = enabled
        self.medium = medium
        self._page_of: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, oldest first
        self.events: list[KVEvent] = []
        self.evictions = 0
        self.host_pages = host_pages
        self._host: OrderedDict[int, tuple[Any, int | None, list[int]]] = OrderedDict()
        """Host tier, oldest first: hash -> (the page's K/V on the CPU, parent hash, tokens)."""
        self._origin: dict[int, tuple[int | None, list[int]]] = {}
        """Per cached block (host tier on): its parent and tokens, to publish its host copy."""
        self.host_stores = 0
        self.host_restores = 0
        self.host_evictions = 0

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    # -- queries ---------------------------------------------------------------------------
    def hashes(self, tokens: Sequence[int], parent: int | None = None) -> list[int]:
        return block_hashes(tokens, self.page_size, self.seed, parent)

    def blocks(self) -> set[int]:
        """Keys of every cached block."""
        return set(self._page_of)

    @property
    def host_blocks(self) -> int:
        """Blocks in the host tier."""
        return len(self._host)

    def host_hashes(self) -> set[int]:
        """Keys of the blocks in the host tier."""
        return set(self._host)

    def available(self) -> int:
        """Pages an allocation could get now (free plus evictable)."""
        return self.pool.num_free + len(self._lru)

    @property
    def pages_in_use(self) -> int:
        """Pages referenced by requests (cached-but-idle pages are not in use)."""
        return self.pool.num_pages - self.available()

    def match(self, hashes: Sequence[int]) -> list[int]:
        """Pages of the longest cached prefix of ``hashes``, each with one new reference; with a
        host tier, the prefix continues with host blocks copied back into fresh pages."""
        pages: list[int] = []
        if not self.enabled:
            return pages
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self._ref(page)
        if self._host and len(pages) < len(hashes):
            pages += self._restore(hashes[len(pages):])
        return pages

    def _restore(self, hashes: Sequence[int]) -> list[int]:
        """Copy the leading ``hashes`` the host holds back to the device (one reference each)."""
        restored: list[int] = []
        back: list[int] = []
        for h in hashes:
            entry = self._host.get(h)
            if entry is None or self._page_of.get(h) is not None:
                break
            try:
                (page,) = self.allocate(1)  # may push other blocks to the host: not these
            except PoolExhausted:
                break
            data, parent, tokens = self._host.pop(h)
            self.pool.write_pages([page], data.to(self.pool.kv.device))
            self._page_of[h] = page
            self._hash_of[page] = h
            self._origin[h] = (parent, tokens)
            self.events.append(BlockStored(block_hashes=[h], parent_block_hash=parent,
                                           token_ids=list(tokens), block_size=self.page_size,
                                           medium=self.medium))
            back.append(h)
            restored.append(page)
        if back:
            self.host_restores += len(back)
            self.events.append(BlockRemoved(block_hashes=back, medium=HOST_MEDIUM))
        return restored

    # -- allocation ------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` pages with one reference each, evicting LRU blocks as needed."""
        if n > self.available():
            raise PoolExhausted(needed=n, free=self.available(), capacity=self.pool.num_pages)
        evicted: list[int] = []
        while self.pool.num_free < n:
            page, _ = self._lru.popitem(last=False)
            h = self._hash_of.pop(page)
            del self._page_of[h]
            if self.host_pages:
                self._to_host(h, page)
            evicted.append(h)
            self.pool.release(page)
        if evicted:
            self.evictions += len(evicted)
            self.events.append(BlockRemoved(block_hashes=evicted,
                                            medium=self.medium or (DEVICE_MEDIUM if
                                                                   self.host_pages else None)))
        return self.pool.alloc(n)

    def _to_host(self, h: int, page: int) -> None:
        """Copy evicted block ``h`` (still in ``page``) to the host LRU and publish the copy."""
        parent, tokens = self._origin.pop(h)
        while len(self._host) >= self.host_pages:
            old, _ = self._host.popitem(last=False)
            self.host_evictions += 1
            self.events.append(BlockRemoved(block_hashes=[old], medium=HOST_MEDIUM))
        self._host[h] = (self.pool.read_pages([page]).to("cpu"), parent, tokens)
        self.host_stores += 1
        self.events.append(BlockStored(block_hashes=[h], parent_block_hash=parent,
                                       token_ids=list(tokens), block_size=self.page_size,
                                       medium=HOST_MEDIUM))

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference from each page, tail first; unreferenced cached pages go to the LRU."""
        for page in reversed(pages):
            if self.pool.decref(page) == 0:
                if page in self._hash_of:
                    self._lru[page] = None
                else:
                    self.pool.release(page)

    def _ref(self, page: int) -> None:
        if self.pool.refcount(page) == 0:
            del self._lru[page]
        self.pool.incref(page)

    # -- storing ---------------------------------------------------------------------------
    def store(self, table: list[int], first: int, hashes: Sequence[int], parent: int | None,
              tokens: Sequence[int]) -> None:
        """Cache blocks ``first .. first + len(hashes) - 1`` of a sequence whose pages are
        ``table`` (updated in place) and whose tokens of those blocks are ``tokens``.

        A block already cached under the same key (another request computed it meanwhile) is
        shared: the sequence switches to the cached page and gives its own copy back, so every
        cached block's parent stays cached while a request references its chain.
        """
        if not self.enabled or not hashes:
            return
        b = self.page_size
        run: list[int] = []
        run_parent = parent
        run_tokens: list[int] = []
        prev = parent
        for i, h in enumerate(hashes):
            idx = first + i
            own = table[idx]
            cached = self._page_of.get(h)
            if cached is None:
                self._page_of[h] = own
                self._hash_of[own] = h
                if self.host_pages:
                    self._origin[h] = (prev, list(tokens[i * b:(i + 1) * b]))
                    if self._host.pop(h, None) is not None:
                        # computed again (its prefix was not restored): the host copy goes
                        self.events.append(BlockRemoved(block_hashes=[h], medium=HOST_MEDIUM))
                if not run:
                    run_parent = prev
                run.append(h)
                run_tokens.extend(tokens[i * b:(i + 1) * b])
            else:
                self._flush_run(run, run_parent, run_tokens)
                run, run_tokens = [], []
                if cached != own:
                    self._ref(cached)
                    table[idx] = cached
                    self.release([own])
            prev = h
        self._flush_run(run, run_parent, run_tokens)

    def _flush_run(self, run: list[int], parent: int | None, tokens: list[int]) -> None:
        if run:
            self.events.append(BlockStored(block_hashes=list(run), parent_block_hash=parent,
                                           token_ids=list(tokens), block_size=self.page_size,
                                           medium=self.medium))

    def clear(self) -> int:
        """Drop every cached block (only unreferenced ones may exist: the caller checks idle).
        Returns the number of blocks dropped."""
        busy = [p for p in self._hash_of if self.pool.refcount(p)]
        if busy:
            raise RuntimeError(f"{len(busy)} cached blocks are still referenced")
        n = len(self._page_of)
        for page in list(self._lru):
            self.pool.release(page)
        self._lru.clear()
        self._page_of.clear()
        self._hash_of.clear()
        self._origin.clear()
        n += len(self._host)
        self._host.clear()
        self.events.append(AllBlocksCleared())
        return n

    def drain_events(self) -> list[KVEvent]:
        out, self.events = self.events, []
        return out
