"""The transfer state machine, TransferError messages and TransferConfig validation."""
from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from transfer.base import InvalidTransition, TransferConfig, TransferError, TransferState, TransferStatus

FORWARD = [TransferState.BOOTSTRAPPING, TransferState.WAITING_FOR_INPUT,
           TransferState.TRANSFERRING, TransferState.SUCCESS]
ops = st.lists(st.one_of(st.sampled_from(list(TransferState)), st.just("fail")), max_size=12)


@given(ops)
def test_forward_only_and_failed_is_sticky(seq: list) -> None:
    s = TransferStatus(room=5)
    model = TransferState.BOOTSTRAPPING
    first_error = None
    for op in seq:
        before = s.state
        if op == "fail":
            err = TransferError(5, f"reason after {before.name}")
            if model is TransferState.SUCCESS:
                with pytest.raises(InvalidTransition):
                    s.fail(err)
            else:
                assert s.fail(err) is (model is not TransferState.FAILED)
                if model is not TransferState.FAILED:
                    first_error = err.reason
                model = TransferState.FAILED
        else:
            legal = (op is not TransferState.FAILED and not model.terminal and op > model)
            if legal:
                s.advance(op)
                model = op
            else:
                with pytest.raises(InvalidTransition):
                    s.advance(op)
        assert s.state is model
        assert s.state >= before or s.state is TransferState.FAILED
        if before is TransferState.FAILED:
            assert s.state is TransferState.FAILED
    if model is TransferState.FAILED:
        assert s.error is not None and s.error.reason == first_error
        assert s.error.stage is not None and s.error.stage is not TransferState.FAILED
    assert [h[0] for h in s.history][0] is TransferState.BOOTSTRAPPING
    assert all(a[1] <= b[1] for a, b in zip(s.history, s.history[1:]))


def test_cannot_start_terminal() -> None:
    with pytest.raises(InvalidTransition):
        TransferStatus(1, TransferState.SUCCESS)


def test_fail_records_stage_and_time() -> None:
    s = TransferStatus(9)
    s.advance(TransferState.TRANSFERRING)
    s.fail(TransferError(9, "peer gone"))
    assert s.error.stage is TransferState.TRANSFERRING
    assert "stage TRANSFERRING" in str(s.error)
    assert s.seconds_in(TransferState.TRANSFERRING) is not None
    assert s.seconds_in(TransferState.WAITING_FOR_INPUT) is None


def test_room_mismatch_message_names_both_rooms() -> None:
    e = TransferError.room_mismatch(expected=11, actual=22, peer="tcp://127.0.0.1:1")
    text = str(e)
    assert "bootstrap_room mismatch: expected 11, got 22" in text
    assert "tcp://127.0.0.1:1" in text and e.expected == 11 and e.actual == 22 and e.room == 11


def test_checksum_message_and_released_pages() -> None:
    e = TransferError.checksum_mismatch(3, 0xAB, 0xCD, None).with_context(released_pages=[1, 2])
    assert "checksum mismatch" in str(e) and "0x00000000000000ab" in str(e)
    assert e.released_pages == (1, 2)


def test_config_defaults_match_sglang() -> None:
    c = TransferConfig()
    assert (c.bootstrap_timeout_s, c.waiting_timeout_s, c.heartbeat_interval_s,
            c.heartbeat_max_misses) == (300.0, 300.0, 5.0, 2)
    assert c.heartbeat_deadline_s == 10.0


@pytest.mark.parametrize("kwargs, word", [
    ({"bootstrap_timeout_s": 0}, "bootstrap_timeout_s"),
    ({"waiting_timeout_s": -1}, "waiting_timeout_s"),
    ({"heartbeat_interval_s": "5"}, "heartbeat_interval_s"),
    ({"heartbeat_max_misses": 0}, "heartbeat_max_misses"),
    ({"chunk_bytes": 10}, "chunk_bytes"),
])
def test_config_validation(kwargs: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        TransferConfig(**kwargs)


def test_config_cli_round_trip() -> None:
    p = argparse.ArgumentParser()
    TransferConfig.add_cli_args(p)
    args = p.parse_args(["--transfer-bootstrap-timeout", "12.5", "--transfer-heartbeat-max-misses", "3"])
    c = TransferConfig.from_cli_args(args)
    assert c.bootstrap_timeout_s == 12.5 and c.heartbeat_max_misses == 3 and c.waiting_timeout_s == 300
