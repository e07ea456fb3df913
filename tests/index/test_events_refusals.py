"""Ingestion refusals that must stay local to one event: odd media, LoRA ids without a name,
extra hash keys (multimodal/salted blocks), and index writes that raise. None of them may look
like lost events (which would clear the whole instance)."""
from __future__ import annotations

from collections.abc import Sequence

import msgpack
import pytest
from etcd_block_index import EtcdBlockIndex
from kv_sim import SimEngine, own
from memory_index import MemoryBlockIndex

from index.etcd import EtcdClient
from index.events.codec import decode_payload, encode_payload
from index.events.errors import MalformedEvent
from index.events.ingest import InstanceIngestor
from index.events.types import BlockStored, KVEvent, KVEventBatch
from index.hashing import block_hashes, namespace_seed
from index.keys import KeyLayout
from index.mirror import BlockMirrorConfig
from index.writer import BlockWriterConfig

BS = 4
PROMPT = list(range(100, 100 + 4 * BS))
OTHER = list(range(900, 900 + 2 * BS))


def wire(*events: KVEvent, encoding: str = "map") -> KVEventBatch:
    return decode_payload(encode_payload(KVEventBatch(0.0, list(events)), encoding))  # type: ignore[arg-type]


async def test_bad_medium_refuses_one_event_and_keeps_the_instance(etcd: EtcdClient,
                                                                   layout: KeyLayout) -> None:
    # The real etcd writer refuses such a medium; before the fix the ValueError escaped mid-batch,
    # last_seq stayed behind, the next batch looked like a gap and the instance was cleared.
    eng = SimEngine(BS)
    idx = EtcdBlockIndex(etcd, layout, "m", mirror_config=BlockMirrorConfig(progress_every=0.05),
                         writer_config=BlockWriterConfig(flush_interval=0.002))
    await idx.start()
    try:
        ing = InstanceIngestor(idx, "p0", block_size=BS)
        await ing.on_batch(0, wire(eng.vllm_store(PROMPT[:2 * BS])))
        odd = eng.vllm_store(PROMPT, start_block=2, medium="CPU PINNED")
        await ing.on_batch(1, wire(odd, eng.vllm_store(OTHER)))
        await ing.on_batch(2, wire(eng.vllm_store(OTHER + PROMPT[:BS], start_block=2)))
        await idx.settle(timeout=10)
        assert ing.stats.rejected == {"bad_medium": 1}
        assert ing.stats.last_seq == 2 and ing.stats.gaps == 0 and ing.stats.clears == 0
        assert ing.state == "synced"
        assert idx.lookup(own(PROMPT, BS)) == {"p0": 2}
        assert idx.lookup(own(OTHER + PROMPT[:BS], BS)) == {"p0": 3}
    finally:
        await idx.close()


@pytest.mark.parametrize("medium", ["", "x" * 33, "GPU\n", "CPU/1", "GPU\"", "\u00e9"])
async def test_media_the_index_cannot_store_are_refused(medium: str) -> None:
    idx = MemoryBlockIndex()
    ing = InstanceIngestor(idx, "p0", block_size=BS)
    await ing.on_batch(0, wire(SimEngine(BS).vllm_store(PROMPT, medium=medium)))
    assert ing.stats.rejected == {"bad_medium": 1}
    assert idx.instances() == set() and ing.engine_hashes == 0


class FailingIndex(MemoryBlockIndex):
    """A memory index whose writes of one medium raise, like a backend refusing a write."""

    async def add(self, instance: str, parent: int | None, hashes: Sequence[int],
                  medium: str = "GPU") -> None:
        if medium == "BROKEN":
            raise RuntimeError("backend refused the write")
        await super().add(instance, parent, hashes, medium)


async def test_an_index_write_that_raises_is_counted_and_the_sequence_advances() -> None:
    eng = SimEngine(BS)
    idx = FailingIndex()
    ing = InstanceIngestor(idx, "p0", block_size=BS)
    await ing.on_batch(0, wire(eng.vllm_store(PROMPT[:2 * BS])))
    await ing.on_batch(1, wire(eng.vllm_store(OTHER, medium="BROKEN"),
                               eng.vllm_store(PROMPT, start_block=2)))
    await ing.on_batch(2, wire(eng.vllm_store(OTHER)))
    assert ing.stats.rejected == {"index_error": 1} and ing.stats.index_errors == 1
    assert ing.stats.last_seq == 2 and ing.stats.gaps == 0 and ing.stats.clears == 0
    assert idx.lookup(own(PROMPT, BS)) == {"p0": 4}
    assert idx.lookup(own(OTHER, BS)) == {"p0": 2}


async def test_lora_name_hashes_in_the_adapter_namespace() -> None:
    idx = MemoryBlockIndex()
    ing = InstanceIngestor(idx, "p0", block_size=BS)
    await ing.on_batch(0, wire(BlockStored([7, 8], None, PROMPT[:2 * BS], BS, lora_id=3,
                                           lora_name="adapter-1"), encoding="array"))
    assert ing.stats.rejected == {}
    assert idx.lookup(own(PROMPT[:2 * BS], BS)) == {}  # no hit for the base model
    lora = block_hashes(PROMPT[:2 * BS], BS, namespace_seed("adapter-1", None))
    assert idx.lookup(lora) == {"p0": 2}


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_lora_id_without_name_is_refused(encoding: str) -> None:
    idx = MemoryBlockIndex()
    ing = InstanceIngestor(idx, "p0", block_size=BS)
    await ing.on_batch(0, wire(BlockStored([7], None, PROMPT[:BS], BS, lora_id=3),
                               encoding=encoding))
    assert ing.stats.rejected == {"lora_without_name": 1}
    assert idx.instances() == set() and ing.engine_hashes == 0
    assert ing.stats.last_seq == 0


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_blocks_with_extra_keys_are_refused(encoding: str) -> None:
    idx = MemoryBlockIndex()
    ing = InstanceIngestor(idx, "p0", block_size=BS)
    image = BlockStored([7, 8], None, PROMPT[:2 * BS], BS, extra_keys=[None, [["img-sha", 0]]])
    salted = BlockStored([9], None, OTHER[:BS], BS, extra_keys=[["tenant-a"]])
    plain = BlockStored([10], None, OTHER[BS:], BS, extra_keys=[None])
    await ing.on_batch(0, wire(image, salted, plain, encoding=encoding))
    assert ing.stats.rejected == {"extra_keys": 2} and ing.stats.applied == 1
    assert idx.lookup(own(PROMPT[:2 * BS], BS)) == {}
    assert idx.lookup(own(OTHER[:BS], BS)) == {}
    assert idx.lookup(own(OTHER[BS:], BS)) == {"p0": 1}


def test_codec_decodes_extra_keys_in_both_encodings() -> None:
    arr = ["BlockStored", [1], None, PROMPT[:BS], BS, None, None, None, [["img", 3]], "future"]
    mp = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
          "token_ids": PROMPT[:BS], "block_size": BS, "extra_keys": [["img", 3]]}
    for ev in (arr, mp):
        batch = decode_payload(msgpack.packb([0.0, [ev]]))
        stored = batch.events[0]
        assert isinstance(stored, BlockStored) and stored.has_extra_keys
        assert stored.extra_keys == [["img", 3]]
    bad = dict(mp, extra_keys="img")
    with pytest.raises(MalformedEvent) as exc:
        decode_payload(msgpack.packb([0.0, [bad]]))
    assert exc.value.reason == "bad_field"
