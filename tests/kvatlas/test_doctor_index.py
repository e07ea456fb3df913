"""doctor's index links from given documents (the real-cluster tests are tests/sidecar/)."""
from __future__ import annotations

from kvatlas.launcher.doctor_index import index_links


def _links(health: dict | None, stats: dict | None) -> dict[str, tuple[bool, str]]:
    return {name.split(": ", 1)[1]: (ok, detail)
            for name, ok, detail, _ in index_links("p0", health, stats)}


def test_a_kvatlas_prefill_without_counters_that_holds_blocks_passes() -> None:
    links = _links({"requests_with_blocks": 3, "index_blocks": 9, "ignored": [],
                    "canary": {"hits": 2, "misses": 1}}, None)
    assert all(ok for ok, _ in links.values()), links


def test_silence_is_named_once_not_also_as_mismatched_hashes() -> None:
    links = _links({"requests_with_blocks": 4, "index_blocks": 0, "ignored": [],
                    "canary": {"hits": 0, "misses": 4}}, {"received": 0, "rejected": {}})
    assert links["KV events arrive"][0] is False
    assert links["its blocks match the router's hashes"] == (True, "not judged: no events arrive")


def test_misses_with_events_arriving_are_mismatched_hashes() -> None:
    links = _links({"requests_with_blocks": 4, "index_blocks": 7, "ignored": [],
                    "canary": {"hits": 0, "misses": 3}}, {"received": 5, "rejected": {}})
    assert links["KV events arrive"][0] is True
    ok, detail = links["its blocks match the router's hashes"]
    assert not ok and "0 found, 3 missing" in detail


def test_one_miss_is_not_yet_a_mismatch_and_rejections_are_named_by_reason() -> None:
    links = _links({"requests_with_blocks": 1, "index_blocks": 1, "ignored": [
        {"field": "block_size", "router": "16", "instance": "32"}],
        "canary": {"hits": 0, "misses": 1}},
        {"received": 2, "rejected": {"block_size_mismatch": 5, "empty": 0}})
    assert links["its blocks match the router's hashes"][0] is True
    assert links["index settings match the router"] == (
        False, "block_size: router 16, instance 32")
    assert links["no KV events rejected"] == (False, "rejected: block_size_mismatch 5")
