"""The per-request shortcuts decide exactly what the plain code decides: kv_aware's memo of
unconfirmed predictions, power_of_two's two-worker draw, the folded prometheus counts."""
from __future__ import annotations

import json
import random

from prometheus_client import generate_latest
from router_stubs import encode_text

from index.hashing import block_hashes
from index.table import BlockTable
from router.config import RouterConfig
from router.errors import BadRequest
from router.json_body import NOT_UTF8, load_json
from router.kv_aware import KvAware
from router.metrics import RouterMetrics
from router.policy import PowerOfTwo, RouteContext, _sample_two
from router.requests import inject, parse_generate
from tests.router.test_kv_aware import Clock, conversation, workers


def test_index_version_memo_changes_no_decision() -> None:
    """Two policies on one index, one told the index's version: same picks, candidates and
    predictions through confirmations, evictions, lag and expiry."""
    table = BlockTable()
    calls = [0, 0]

    def counting(k: int):  # type: ignore[no-untyped-def]
        def lookup(hashes: list[int], model: str | None) -> dict[str, int]:
            calls[k] += 1
            return table.lookup(hashes)
        return lookup

    cfg = RouterConfig(prediction_catch_up=3.0, prediction_ttl=20.0)
    clocks = [Clock(), Clock()]
    plain = KvAware(cfg, counting(0), random.Random(5), clocks[0])
    memo = KvAware(cfg, counting(1), random.Random(5), clocks[1],
                   index_version=lambda: table.version)
    ws = [workers(3), workers(3)]
    rng = random.Random(11)
    lagging: list[tuple[str, list[int]]] = []
    for step in range(400):
        text = conversation(rng.randrange(12), turns=1 + rng.randrange(3))
        picks = []
        for kv, pool in zip((plain, memo), ws):
            choice = kv.select(pool, RouteContext(encode_text(text)))
            kv.on_routed(choice)
            picks.append((choice.worker.instance_id, choice.matched_blocks,
                          choice.indexed_blocks, choice.candidates, len(kv.prediction)))
        assert picks[0] == picks[1], step
        lagging.append((picks[0][0], block_hashes(encode_text(text), cfg.block_size, 1337)))
        # The index catches up a few requests late, sometimes evicts.
        if len(lagging) > rng.randrange(1, 6):
            who, blocks = lagging.pop(0)
            table.apply_add(who, blocks)
        if rng.random() < 0.05:
            table.clear_instance(f"p{rng.randrange(3)}")
        dt = rng.choice((0.01, 0.2, 1.5))
        for c in clocks:
            c.t += dt
    assert len(plain.prediction) == len(memo.prediction)
    # The memo did skip questions, and the index did confirm predictions along the way.
    assert calls[1] < calls[0] and plain._indexed == memo._indexed != set()


def test_sample_two_draws_what_sample_draws() -> None:
    for n in (2, 3, 7, 21, 22, 50):
        pool = list(range(n))
        for seed in range(200):
            a, b = random.Random(seed), random.Random(seed)
            for _ in range(4):
                assert tuple(a.sample(pool, 2)) == _sample_two(b, pool)
            assert a.random() == b.random()
    ws = workers(4)
    ws[2].load = -1
    picks = [PowerOfTwo(random.Random(s)).select(ws, RouteContext()).worker.instance_id
             for s in range(300)]
    assert set(picks) == {"p0", "p1", "p2", "p3"} and picks.count("p2") > 100


def test_folded_metrics_expose_what_prometheus_counted() -> None:
    m = RouterMetrics()
    for _ in range(3):
        m.child(m.decisions, "prefill", "p1").inc()
    m.child(m.requests, "/generate", "200").inc()
    m.prefix_hit.inc(32)
    m.prompt.inc(48)
    for v in (0.00003, 0.0003, 0.0003, 7.0):
        m.decision.observe(v)
    m.latency["decode"].observe(0.002)
    text = generate_latest(m.registry).decode()  # any collection folds first
    assert 'kvatlas_router_routing_decisions_total{instance="p1",role="prefill"} 3.0' in text
    assert 'kvatlas_router_requests_total{route="/generate",status="200"} 1.0' in text
    assert "kvatlas_router_prefix_hit_tokens_total 32.0" in text
    assert "kvatlas_router_prompt_tokens_total 48.0" in text
    assert 'kvatlas_router_decision_seconds_bucket{le="5e-05"} 1.0' in text
    assert 'kvatlas_router_decision_seconds_bucket{le="0.0005"} 3.0' in text
    assert 'kvatlas_router_decision_seconds_bucket{le="0.05"} 3.0' in text
    assert 'kvatlas_router_decision_seconds_bucket{le="+Inf"} 4.0' in text
    assert "kvatlas_router_decision_seconds_count 4.0" in text
    assert 'kvatlas_router_upstream_latency_seconds_bucket{le="0.0025",role="decode"} 1.0' in text
    assert "kvatlas_router_routing_decisions_created{" in text
    # Folded counts are not counted twice; later ones add up.
    m.child(m.decisions, "prefill", "p1").inc()
    again = m.render().decode()
    assert 'kvatlas_router_routing_decisions_total{instance="p1",role="prefill"} 4.0' in again
    assert "kvatlas_router_decision_seconds_count 4.0" in again
    m.forget("prefill", "p1")
    assert 'instance="p1"' not in m.render().decode()


def _stdlib(raw: bytes) -> object:
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")
    try:
        text = raw.decode("utf-8")  # json.loads(bytes) would also take UTF-16/32: workers don't
    except UnicodeDecodeError:
        return NOT_UTF8
    try:
        body = json.loads(text, parse_constant=refuse)
    except ValueError as exc:
        return f"not valid JSON ({exc})"
    return body if isinstance(body, dict) else f"must be a JSON object, got {type(body).__name__}"


def test_load_json_reads_what_the_standard_parser_reads() -> None:
    """orjson on the hot path, yet the same values (ints beyond 64 bits stay exact ints), the
    same refusals and the same messages as ``json.loads``."""
    cases = [b'{"a":1,"a":2}', b'{"a":NaN}', b'{"a":-Infinity}', b'{"a":1e400}',
             b'{"input_ids":[123456789012345678901234567890]}', b'{"a":-9999999999999999999}',
             b'{"a":18446744073709551615}', b'{"a":-9223372036854775808}', b'{"a":"\\ud800"}',
             '{"a":"\u00e9"}'.encode("utf-16"), b'{"a":"\xff"}', b"[1]", b"null", b'{"a":1} x',
             b' {"a":-0.0} ', b'{"a":1.5e-320}', b'{"a":']
    rng = random.Random(4)
    for _ in range(500):
        f = rng.random() * 10 ** rng.randint(-300, 300)
        cases.append(json.dumps({"x": f, "y": [-f, rng.getrandbits(63)]}).encode())
    for raw in cases:
        try:
            got: object = load_json(raw)
        except BadRequest as exc:
            got = exc.reason
        want = _stdlib(raw)
        assert repr(got) == repr(want), raw


def test_inject_writes_what_json_dumps_writes() -> None:
    raw = b'{"text": "hi", "sampling_params": {"max_new_tokens": 1}}  \n'
    body = json.loads(raw)
    for host, port in (("127.0.0.1", 8998), ("h\u00e9\"x", None), (None, 1), ("a", 2**16 - 1)):
        parsed = parse_generate(body, 100)
        parsed.raw = raw
        out, rooms = inject(parsed, host, port)
        want_room = rooms[0]
        assert 1 <= want_room <= 2**63 - 1
        fields = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": want_room}
        want = raw.rstrip()[:-1] + b"," + json.dumps(fields, separators=(",", ":")).encode()[1:]
        assert rooms == [want_room] and out == want
        assert json.loads(out) == {**body, **fields}
