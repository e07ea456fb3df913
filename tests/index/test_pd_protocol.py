"""The PD protocol record field: its JSON round-trips, and a bad field is refused with the
field's name (``ProtocolFieldError.field``), so that callers can name their own flag for it."""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from index.pd_protocol import (
    PULL,
    PUSH,
    SGLANG_BOOTSTRAP,
    VLLM,
    PDProtocol,
    ProtocolFieldError,
)

vllm_protocols = st.builds(
    PDProtocol, st.just(VLLM), st.sampled_from([PULL, PUSH]),
    st.none() | st.text(min_size=1, max_size=20), st.none() | st.text(min_size=1, max_size=20),
    st.none() | st.integers(1, 65535), st.none() | st.integers(1, 1 << 16))


@given(vllm_protocols)
def test_a_records_value_round_trips(proto: PDProtocol) -> None:
    assert PDProtocol.from_dict(proto.to_dict()) == proto


def test_sglang_is_null_and_vllm_defaults_to_pull() -> None:
    assert SGLANG_BOOTSTRAP.to_dict() is None
    assert PDProtocol.from_dict(None) == SGLANG_BOOTSTRAP
    assert PDProtocol.parse("vllm") == PDProtocol(VLLM, PULL)
    assert PDProtocol.parse("vllm-push").label == "vllm-push"


@pytest.mark.parametrize(("field", "value"), [
    ("engine_id", ""), ("engine_id", 7), ("host", ""), ("host", ["a"]),
    ("port", 0), ("port", 65536), ("port", True), ("port", "5600"),
    ("tp_size", 0), ("tp_size", 1.5),
])
def test_a_bad_field_is_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(ProtocolFieldError) as err:
        PDProtocol.from_dict({"name": VLLM, "mode": PUSH, field: value})
    assert err.value.field == field and str(err.value).startswith(field)


@pytest.mark.parametrize(("doc", "words"), [
    ("vllm", "must be an object or null"),
    ({"name": "nixl"}, "name must be one of"),
    ({"name": VLLM, "mode": "pipe"}, "mode must be one of"),
    ({"name": "sglang", "port": 1}, "they are vLLM's"),
])
def test_a_bad_value_says_what_is_wrong(doc: Any, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        PDProtocol.from_dict(doc)


def test_a_bad_command_line_value_names_the_choices() -> None:
    with pytest.raises(ValueError, match="sglang, vllm, vllm-pull or vllm-push"):
        PDProtocol.parse("vllm-pipe")
