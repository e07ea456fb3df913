"""A burst of one-block KV events, cheap to make (not collected).

An engine whose cache turns over: two chains of ``per_message`` blocks, each stored one block per
``BlockStored`` event (as a decode step stores them), every message removing the other chain and
storing its own. Only two payloads are encoded; the burst sends them alternately under
consecutive sequence numbers, so a million events cost a thousand sends. The blocks the burst
leaves stored are the chain of its last message: an index that missed the tail shows the other.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from index.events.codec import encode_payload
from index.events.publisher import KVEventPublisher
from index.events.types import BlockRemoved, BlockStored, KVEvent, KVEventBatch
from index.hashing import block_hashes

BURST_EVENTS = 1_000_000
"""One-block BlockStored events in the burst (the removals come on top: one per message)."""


@dataclass(frozen=True)
class Burst:
    block_size: int
    messages: int
    payloads: tuple[bytes, bytes]
    tokens: tuple[list[int], list[int]]
    """The token ids of each chain, block after block."""

    @property
    def stored_events(self) -> int:
        return self.messages * (len(self.tokens[0]) // self.block_size)

    @property
    def events(self) -> int:
        """Every event sent: the one-block stores and one removal per message."""
        return self.stored_events + self.messages

    def final_blocks(self) -> set[int]:
        """kvatlas's hashes of the blocks stored once the whole burst is applied."""
        return set(block_hashes(self.tokens[(self.messages - 1) % 2], self.block_size))

    def send(self, pub: KVEventPublisher) -> int:
        """Publish the burst (never blocks); the sequence number of its last message."""
        seq = -1
        for m in range(self.messages):
            seq = pub.publish_payload(self.payloads[m % 2])
        return seq

    def send_last_again(self, pub: KVEventPublisher) -> int:
        """Publish the last message's payload once more, as an engine goes on publishing after
        a burst (the blocks left stored stay ``final_blocks``); its sequence number."""
        return pub.publish_payload(self.payloads[(self.messages - 1) % 2])


def make_burst(block_size: int, events: int = BURST_EVENTS, per_message: int = 1000) -> Burst:
    if events % per_message:
        raise ValueError(f"{events} events do not split into messages of {per_message}")
    tokens: list[list[int]] = []
    engine: list[list[int]] = []
    for chain in (0, 1):
        # Distinct first blocks make distinct chains; the rest may repeat (hashes are chained).
        toks = [chain + 1] * block_size + [7] * (block_size * (per_message - 1))
        tokens.append(toks)
        engine.append([((chain + 1) << 32) | i for i in range(per_message)])
    payloads = []
    for chain in (0, 1):
        evs: list[KVEvent] = [BlockRemoved(engine[1 - chain])]
        for i, h in enumerate(engine[chain]):
            evs.append(BlockStored([h], engine[chain][i - 1] if i else None,
                                   tokens[chain][i * block_size:(i + 1) * block_size],
                                   block_size))
        payloads.append(encode_payload(KVEventBatch(time.time(), evs), "array"))
    return Burst(block_size, events // per_message, (payloads[0], payloads[1]),
                 (tokens[0], tokens[1]))
