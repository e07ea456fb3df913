"""The instance record's contract (index/record.py): every field round-trips, unknown fields
survive a read-modify-write, malformed and newer-version records are refused by reason, counted
and logged once per key, the reader never raises, and what the three writers build parses back."""
from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bootstrap.config import BootstrapConfig
from bootstrap.mirror import RankMirror
from bootstrap.table import RankTable
from engine.pd.config import PDConfig
from engine.pd.registration_decode import decode_record
from engine.ranks.dist import RankInfo
from engine.serve_config import EngineServerConfig
from index.agent import SOURCE, AgentConfig, agent_record
from index.errors import IndexLayerError, RecordError
from index.etcd import EtcdSettings
from index.events.subscriber import SubscriberConfig
from index.hashing import BASE_SEED, namespace_seed
from index.record import (
    ENGINE_UNKNOWN,
    MALFORMED,
    NEWER_VERSION,
    RECORD_VERSION,
    HashNamespace,
    InstanceRecord,
    RecordReader,
)

FULL = InstanceRecord(
    instance_id="p-0", role="prefill", model="org/m", url="http://10.0.0.1:30000",
    bootstrap_host="10.0.0.1", bootstrap_port=8998, tp_size=2, dp_size=2, pp_size=2, cp_size=2,
    page_size=16, block_size=16, hash_namespace=HashNamespace("lora-a", "salt"),
    started_at=1700000000.5, ready=False, source="kv-events", tokenizer={"name": "byte"},
    engine="sglang", kv_cache_dtype="bfloat16", kv_events="tcp://127.0.0.1:5557",
    expected_ranks=8, registered_ranks=3, topology={"attn_tp_size": 2, "dp_size": 2},
    max_prompt_tokens=4096, max_body_bytes=1 << 20, context_length=8192,
    extra={"added_by_a_newer_writer": [1, 2]})


def test_every_field_round_trips() -> None:
    raw = FULL.to_json()
    doc = json.loads(raw)
    assert doc["v"] == RECORD_VERSION == 1
    assert doc["hash_namespace"] == {"lora_name": "lora-a", "cache_salt": "salt"}
    assert doc["added_by_a_newer_writer"] == [1, 2]
    back = InstanceRecord.from_json(raw, key=b"/k/v1/instances/p-0")
    assert back == FULL
    assert back.hash_seed == namespace_seed("lora-a", "salt")
    assert InstanceRecord("x", "decode").hash_seed == BASE_SEED
    # Every known field is written, null where unknown: readers never guess.
    minimal = json.loads(InstanceRecord("x", "decode").to_json())
    assert minimal["url"] is None and minimal["expected_ranks"] is None
    assert (minimal["pp_size"], minimal["cp_size"], minimal["engine"], minimal["ready"]) == (
        1, 1, "kvatlas", True)


def test_unknown_fields_survive_read_modify_write() -> None:
    raw = json.dumps({"instance_id": "p", "role": "prefill", "v": 1, "future": {"x": 1},
                      "also": None}).encode()
    rec = InstanceRecord.from_json(raw)
    assert rec.extra == {"future": {"x": 1}, "also": None}
    again = json.loads(rec.replace(ready=False).to_json())
    assert again["future"] == {"x": 1} and "also" in again and again["ready"] is False


def test_older_records_read_as_v1() -> None:
    # Written by an older kvatlas: no "v", no instance_id (taken from the key), no new fields.
    rec = InstanceRecord.from_json(b'{"role": "decode", "url": "http://h:1", "model": "m"}',
                                   instance_id="d0")
    assert (rec.instance_id, rec.role, rec.engine, rec.pp_size, rec.ready) == (
        "d0", "decode", "kvatlas", 1, True)


MALFORMED_VALUES: list[tuple[Any, str]] = [
    (b"not json", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"[" * 5000 + b"]" * 5000, "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b'"text"', "not a JSON object"),
    (b'{"instance_id": "p"}', "missing role"),
    (b'{"role": "prefill"}', "missing instance_id"),
    (b'{"instance_id": "bad id!", "role": "prefill"}', "instance id"),
    (b'{"instance_id": 7, "role": "prefill"}', "instance id"),
    (b'{"instance_id": "p", "role": "router"}', "field role"),
    (b'{"instance_id": "p", "role": "prefill", "bootstrap_port": "8998"}', "bootstrap_port"),
    (b'{"instance_id": "p", "role": "prefill", "bootstrap_port": 70000}', "bootstrap_port"),
    (b'{"instance_id": "p", "role": "prefill", "ready": "yes"}', "field ready"),
    (b'{"instance_id": "p", "role": "prefill", "tp_size": true}', "field tp_size"),
    (b'{"instance_id": "p", "role": "prefill", "url": 5}', "field url"),
    (b'{"instance_id": "p", "role": "prefill", "hash_namespace": {"lora_name": 1}}',
     "hash_namespace"),
    (b'{"instance_id": "p", "role": "prefill", "topology": []}', "field topology"),
    (b'{"instance_id": "p", "role": "prefill", "v": "1"}', "version"),
    (b'{"instance_id": "p", "role": "prefill", "v": 0}', "version"),
]


@pytest.mark.parametrize(("raw", "why"), MALFORMED_VALUES)
def test_malformed_records_are_refused_naming_the_key(raw: bytes, why: str) -> None:
    with pytest.raises(RecordError) as info:
        InstanceRecord.from_json(raw, key=b"/kv/v1/instances/p")
    assert isinstance(info.value, IndexLayerError)
    assert info.value.reason == MALFORMED and info.value.key == "/kv/v1/instances/p"
    assert why in str(info.value) and "/kv/v1/instances/p" in str(info.value)


def test_a_newer_version_is_refused_naming_both_versions() -> None:
    with pytest.raises(RecordError) as info:
        InstanceRecord.from_json(b'{"v": 2, "instance_id": "p", "role": "anything"}', key="k")
    assert info.value.reason == NEWER_VERSION
    assert "version 2" in str(info.value) and "version 1" in str(info.value)


def test_the_reader_counts_and_logs_once_per_key_and_reason(
        caplog: pytest.LogCaptureFixture) -> None:
    reader = RecordReader()
    good = b'{"instance_id": "a", "role": "prefill"}'
    with caplog.at_level(logging.WARNING, logger="index.record"):
        for _ in range(3):
            assert reader.read(b"/k/a", b"garbage") is None
            assert reader.read(b"/k/b", b'{"v": 9, "instance_id": "b", "role": "prefill"}') is None
        assert reader.refused == {MALFORMED: 3, NEWER_VERSION: 3}
        assert len(caplog.records) == 2
        assert "/k/a" in caplog.records[0].getMessage()
        assert "newer_version" in caplog.records[1].getMessage()
        # Valid once, then bad again: logged again. Deleted, then bad again: logged again.
        assert reader.read(b"/k/a", good) is not None
        reader.read(b"/k/a", b"garbage")
        reader.forget(b"/k/b")
        reader.read(b"/k/b", b"[]")
        assert len(caplog.records) == 4
    assert reader.stats() == {MALFORMED: 5, NEWER_VERSION: 3}


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
FIELDS = st.sampled_from(["instance_id", "role", "v", "url", "bootstrap_port", "ready",
                          "tp_size", "hash_namespace", "topology", "tokenizer", "engine"])


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=64), JSON.map(lambda v: json.dumps(v).encode()),
                 st.dictionaries(FIELDS, JSON, max_size=6).map(
                     lambda d: json.dumps({"instance_id": "p", "role": "prefill", **d}).encode())))
def test_the_reader_never_raises(raw: bytes) -> None:
    reader = RecordReader()
    rec = reader.read(b"/k/p", raw, instance_id="p")
    if rec is None:
        assert sum(reader.refused.values()) == 1
    else:  # whatever parses also writes and parses back
        assert InstanceRecord.from_json(rec.to_json()) == rec


# --- the three writers ------------------------------------------------------------------------

def test_the_bootstrap_mirror_record_parses_back() -> None:
    cfg = BootstrapConfig(instance_id="pre-1", model="org/m", port=18998,
                          etcd=EtcdSettings(endpoints=["127.0.0.1:1"]),
                          instance_fields={"url": "http://10.0.0.1:30000", "tp_size": 2,
                                           "dp_size": 1, "role": "ignored", "custom": "kept"})
    mirror = RankMirror(cfg, RankTable())
    rec = InstanceRecord.from_json(mirror.instance_value().to_json())
    assert (rec.instance_id, rec.role, rec.model, rec.url) == (
        "pre-1", "prefill", "org/m", "http://10.0.0.1:30000")
    assert (rec.bootstrap_host, rec.bootstrap_port, rec.tp_size, rec.dp_size) == (
        "127.0.0.1", 18998, 2, 1)
    assert rec.ready is False and rec.expected_ranks is None and rec.registered_ranks == 0
    assert rec.started_at == mirror.started_at and rec.extra == {"custom": "kept"}
    with pytest.raises(ValueError, match="tp_size"):
        BootstrapConfig(instance_id="pre-1", model="m", instance_fields={"tp_size": "two"})


def test_the_decode_record_parses_back() -> None:
    eng = EngineServerConfig(mode="decode", model="tiny", page_size=16, num_pages=64, port=30001)
    cfg = PDConfig(engine=eng, instance_id="dec-1")
    rec = InstanceRecord.from_json(decode_record(cfg, RankInfo(0, 2, 2, 1)).to_json())
    assert (rec.instance_id, rec.role, rec.model, rec.tp_size, rec.page_size) == (
        "dec-1", "decode", "tiny", 2, 16)
    assert rec.url is not None and rec.url.endswith(":30001") and rec.ready
    assert rec.kv_cache_dtype == cfg.kv_dtype and rec.started_at is not None


def test_the_index_agent_record_parses_back() -> None:
    cfg = AgentConfig(instance_id="vllm-0", model="m", role="decode", block_size=32,
                      events=SubscriberConfig(endpoint="tcp://127.0.0.1:5557"))
    rec = InstanceRecord.from_json(agent_record(cfg, 12.5).to_json())
    assert (rec.instance_id, rec.role, rec.model, rec.source, rec.block_size) == (
        "vllm-0", "decode", "m", SOURCE, 32)
    assert (rec.kv_events, rec.started_at, rec.engine) == (
        "tcp://127.0.0.1:5557", 12.5, ENGINE_UNKNOWN)
