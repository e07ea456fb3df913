"""``kvatlas index agent|query|stats`` as real subprocesses against the fixture etcd."""
from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator

import pytest
from agent_helpers import REPO, eventually, publish_all, run_cli, tcp
from kv_sim import SimEngine, own

from engine.protocol import encode_text
from index.agent_stats import stats_key
from index.etcd import EtcdClient
from index.events.publisher import KVEventPublisher, PublisherConfig
from index.hashing import block_hashes
from index.keys import KeyLayout, loads
from index.lease import LeaseSession
from index.segments import held_blocks
from index.writer import BlockWriter
from kvatlas.cli import main as cli_main
from kvatlas.etcd_proc import free_port

pytestmark = pytest.mark.timeout(60)

MODEL = "cli-model"
TEXT = "The quick brown fox jumps over the lazy dog, twice: the quick brown fox. Héllo wörld!"


def one_line_error(rc: int, err: str) -> str:
    """The CLI's failure contract: exit 2, exactly one line on stderr, no traceback."""
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
async def engine_blocks(etcd: EtcdClient, layout: KeyLayout) -> AsyncIterator[list[int]]:
    """Blocks an engine's prefix cache holds after serving TEXT, written by a real BlockWriter:
    the engine tokenizes text prompts with ``encode_text`` and hashes the whole prompt."""
    hashes = block_hashes(encode_text(TEXT, "prompt"), 16)
    session = LeaseSession(etcd, ttl=5)
    writer = BlockWriter(session, layout, MODEL, "eng-0")
    tasks = [asyncio.create_task(session.run()), writer.start()]
    writer.add(None, hashes)
    assert await writer.wait_synced(10)
    yield hashes
    await writer.close()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await session.revoke()


async def test_query_prompt_finds_what_the_engine_hashed(
        engine_blocks: list[int], etcd_endpoint: str, key_prefix: str, tmp_path) -> None:
    n = len(engine_blocks)
    assert n == (len(TEXT.encode()) + 1) // 16 and n >= 5  # BOS + UTF-8 bytes, full blocks
    etcd = ("--etcd", etcd_endpoint, "--etcd-prefix", key_prefix)
    (rc, out, err), (rc2, out2, err2), (rc3, out3, err3) = await asyncio.gather(
        run_cli("index", "query", "--model", MODEL, "--prompt", TEXT, "--json", *etcd),
        run_cli("index", "query", "--model", MODEL, "--prompt", TEXT, "--no-bos", "--json", *etcd),
        run_cli("index", "query", "--model", MODEL, "--prompt", TEXT, *etcd))
    assert rc == 0, err
    total = len(TEXT.encode()) + 1
    assert json.loads(out) == {"prompt_blocks": n, "instances": [
        {"instance_id": "eng-0", "matched_blocks": n, "matched_tokens": 16 * n,
         "fraction": round(16 * n / total, 6)}]}
    # Without the BOS the engine prepends, nothing lines up: the BOS is part of the contract.
    assert rc2 == 0, err2
    assert json.loads(out2)["instances"][0]["matched_blocks"] == 0
    assert rc3 == 0, err3
    assert "eng-0" in out3 and f"{n}" in out3 and "BOS" in out3

    # Without --etcd the local cluster's etcd is read from <run-dir>/cluster.json.
    (tmp_path / "cluster.json").write_text(json.dumps({"etcd": etcd_endpoint}))
    rc, out, err = await run_cli("index", "query", "--model", MODEL, "--prompt", TEXT, "--json",
                                 "--run-dir", str(tmp_path), "--etcd-prefix", key_prefix)
    assert rc == 0, err
    assert json.loads(out)["instances"][0]["matched_blocks"] == n


async def test_query_unknown_model_is_zero_matches(etcd_endpoint: str, key_prefix: str) -> None:
    etcd = ("--etcd", etcd_endpoint, "--etcd-prefix", key_prefix)
    tokens = ",".join(str(i) for i in range(40))
    (rc, out, err), (rc2, out2, err2) = await asyncio.gather(
        run_cli("index", "query", "--model", "nobody/knows", "--tokens", tokens, *etcd),
        run_cli("index", "query", "--model", "nobody/knows", "--tokens", tokens, "--json", *etcd))
    assert rc == 0, err
    assert "no blocks indexed for model nobody/knows" in out
    assert rc2 == 0, err2
    assert json.loads(out2) == {"prompt_blocks": 2, "instances": []}


@pytest.mark.parametrize("args, want", [
    (("--tokens", "1,x,3"), "token #1 'x' is not an integer"),
    (("--tokens", "1,4294967296"), "outside the uint32 range"),
    (("--tokens=-1,2",), "outside the uint32 range"),
    (("--tokens", "1.5"), "is not an integer"),
    (("--tokens", " , "), "no token ids"),
    (("--tokens", "[1, true]"), "is not an integer"),
    (("--tokens", "1_000,2"), "token #0 '1_000' is not an integer"),
    (("--tokens", "1,\uff12"), "token #1 '\uff12' is not an integer"),
    (("--tokens", "1,\u0663"), "token #1 '\u0663' is not an integer"),
    (("--tokens", '["1_0", 2]'), "token #0 '1_0' is not an integer"),
    (("--tokens", "+5"), "token #0 '+5' is not an integer"),
    (("--tokens-file", "/nonexistent/prompt.txt"), "cannot read"),
    (("--tokens", "1", "--block-size", "0"), "--block-size"),
])
def test_query_bad_inputs_fail_with_one_line(args: tuple[str, ...], want: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # In-process through the same entry point as the console script (main() owns the
    # error-to-exit-status contract); bad input fails before etcd is contacted.
    rc = cli_main(["index", "query", "--model", "m", "--etcd", "127.0.0.1:9", *args])
    err = capsys.readouterr().err
    assert want in one_line_error(rc, err)


async def test_query_bad_input_and_missing_prompt_in_a_real_process() -> None:
    (rc, _o, err), (rc2, _o2, err2) = await asyncio.gather(
        run_cli("index", "query", "--model", "m", "--tokens", "7,99999999999"),
        run_cli("index", "query", "--model", "m"))
    assert "outside the uint32 range" in one_line_error(rc, err)
    # Missing prompt options are argparse's job: usage plus the error, exit 2.
    assert rc2 == 2 and ("one of the arguments --prompt --tokens --tokens-file --chat --message "
                         "is required") in err2


async def test_etcd_unreachable_is_one_line_and_fast() -> None:
    dead = f"127.0.0.1:{free_port()}"
    # A deadline on the wait, not a timing: an unreachable etcd must end the command, not hang it.
    (rc, _o, err), (rc2, _o2, err2) = await asyncio.wait_for(asyncio.gather(
        run_cli("index", "query", "--model", "m", "--tokens", "1,2,3", "--etcd", dead),
        run_cli("index", "stats", "--etcd", dead)), 15)
    assert dead in one_line_error(rc, err) and "unreachable" in err
    assert dead in one_line_error(rc2, err2)


async def test_agent_command_indexes_and_stats_reports_then_sigterm_revokes(
        etcd: EtcdClient, etcd_endpoint: str, key_prefix: str, layout: KeyLayout) -> None:
    ep, rep = tcp(), tcp()
    pub = KVEventPublisher(PublisherConfig(endpoint=ep, replay_endpoint=rep))
    await pub.start()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvatlas", "index", "agent", "--instance-id", "cli-0",
        "--model", MODEL, "--kv-events", ep, "--replay", rep, "--stats-interval", "0.1",
        "--etcd", etcd_endpoint, "--etcd-prefix", key_prefix, cwd=str(REPO),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 15)
        assert b"kvatlas index agent: instance cli-0" in line, line

        async def published_seq() -> int | None:
            kv = await etcd.get(stats_key(layout, "cli-0"))
            return None if kv is None else loads(kv.value)["last_seq"]

        eng = SimEngine(16, "bytes")
        tokens = list(range(5000, 5000 + 6 * 16))
        await publish_all(pub, [[eng.vllm_store(tokens[:32])], [eng.vllm_store(tokens, 2)],
                                [eng.remove(tokens, [5])]], published_seq)

        async def five_blocks() -> bool:
            _, kvs = await etcd.get_prefix(layout.blocks_prefix(MODEL, "cli-0"))
            return len(held_blocks(kv.value for kv in kvs)) == 5
        await eventually(five_blocks, 10, "cli-0's 5 blocks in etcd")

        # ``index dump`` shows them as stored: one segment (a chain stored in two steps), in
        # chain order, the fifth block evicted.
        rc, out, err = await run_cli("index", "dump", "--instance", "cli-0", "--json", "--etcd",
                                     etcd_endpoint, "--etcd-prefix", key_prefix)
        assert rc == 0, err
        seg, = json.loads(out)
        mine = [f"{h:016x}" for h in own(tokens, 16)]
        assert seg["model"] == MODEL and seg["parent"] is None
        assert seg["blocks"] == [[h, "GPU"] for i, h in enumerate(mine) if i != 5]
        rc, out, err = await run_cli("index", "dump", "--instance", "cli-0", "--etcd",
                                     etcd_endpoint, "--etcd-prefix", key_prefix)
        assert rc == 0 and "5 blocks in 1 segments" in out and mine[0] in out, (out, err)
        rc, out, err = await run_cli("index", "dump", "--instance", "bad id", "--etcd",
                                     etcd_endpoint, "--etcd-prefix", key_prefix)
        assert rc != 0 and "instance id 'bad id' is invalid" in err, (out, err)

        rc, out, err = await run_cli("index", "stats", "--json", "--sample", "0.2", "--etcd",
                                     etcd_endpoint, "--etcd-prefix", key_prefix)
        assert rc == 0, err
        doc = json.loads(out)
        row, = doc["instances"]
        assert (row["instance_id"], row["model"], row["blocks"]) == ("cli-0", MODEL, 5)
        assert row["last_seq"] == pub.next_seq - 1 and row["applied"] == 3
        assert row["rejected_total"] == 0 and row["state"] == "synced"
        assert doc["etcd"]["db_size"] > 0 and doc["etcd"]["revision"] > 0
        rc, out, err = await run_cli("index", "stats", "--sample", "0", "--etcd", etcd_endpoint,
                                     "--etcd-prefix", key_prefix)
        assert rc == 0 and "cli-0" in out and "db size" in out, err

        # While the engine keeps storing blocks, stats samples the write-to-watch lag.
        async def churn() -> None:
            for i in range(1000):
                pub.drain([eng.vllm_store(list(range(9000 + 16 * i, 9000 + 16 * (i + 1))))])
                await asyncio.sleep(0.03)
        churner = asyncio.create_task(churn())
        try:
            rc, out, err = await run_cli("index", "stats", "--json", "--sample", "1.5", "--etcd",
                                         etcd_endpoint, "--etcd-prefix", key_prefix)
        finally:
            churner.cancel()
        assert rc == 0, err
        lag = json.loads(out)["instances"][0]["mirror_lag_s"]
        assert lag is not None and lag["samples"] > 0 and 0 <= lag["p50"] <= lag["p99"] < 10

        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        # The lease was revoked: every key of the instance is gone at once.
        for prefix in (layout.blocks_prefix(MODEL, "cli-0"), layout.instance("cli-0"),
                       stats_key(layout, "cli-0")):
            _, kvs = await etcd.get_prefix(prefix)
            assert kvs == []
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await pub.close()


async def test_query_chat_with_a_real_tokenizer(etcd: EtcdClient, layout: KeyLayout,
                                                etcd_endpoint: str, key_prefix: str,
                                                tmp_path) -> None:
    """The ids an engine serving Qwen3 prefills for a chat (its template, then encoded without
    special tokens), hashed and written as the engine's writer does, are what ``index query
    --tokenizer qwen3 --message ...`` and ``--chat FILE`` look up."""
    from tokenization import load_tokenizer

    msgs = [{"role": "system", "content": "You are a careful assistant. " * 12},
            {"role": "user", "content": "Grüße aus 東京: what is etcd?"}]
    hashes = block_hashes(load_tokenizer("qwen3").encode_chat(msgs), 16)
    session = LeaseSession(etcd, ttl=5)
    writer = BlockWriter(session, layout, "qwen-model", "eng-q")
    tasks = [asyncio.create_task(session.run()), writer.start()]
    writer.add(None, hashes)
    assert await writer.wait_synced(10)
    try:
        etcd_args = ("--etcd", etcd_endpoint, "--etcd-prefix", key_prefix)
        chat = tmp_path / "chat.json"
        chat.write_text(json.dumps(msgs))
        by_flags = ("--message", f"system={msgs[0]['content']}",
                    "--message", f"user={msgs[1]['content']}")
        for prompt in (by_flags, ("--chat", str(chat))):
            rc, out, err = await run_cli("index", "query", "--model", "qwen-model",
                                         "--tokenizer", "qwen3", *prompt, "--json", *etcd_args)
            assert rc == 0, err
            got = json.loads(out)
            assert got["prompt_blocks"] == len(hashes) >= 4
            assert got["instances"][0]["matched_blocks"] == len(hashes)
        # without --tokenizer: the one the model's instance records name (as engines write it)
        from index.record import InstanceRecord
        qwen = load_tokenizer("qwen3")
        record = InstanceRecord(instance_id="eng-q", role="prefill", model="qwen-model",
                                url="http://127.0.0.1:1",
                                tokenizer={"source": "qwen3", "fingerprint": qwen.fingerprint})
        await etcd.put(layout.instance("eng-q"), record.to_json(), lease=session.lease_id)
        rc, out, err = await run_cli("index", "query", "--model", "qwen-model", *by_flags,
                                     "--json", *etcd_args)
        assert rc == 0, err
        assert json.loads(out)["instances"][0]["matched_blocks"] == len(hashes)
        # the byte tokenizer's ids of the same chat match nothing
        rc, out, err = await run_cli("index", "query", "--model", "qwen-model", "--tokenizer",
                                     "byte", *by_flags, "--json", *etcd_args)
        assert rc == 0 and json.loads(out)["instances"][0]["matched_blocks"] == 0
    finally:
        await writer.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await session.revoke()


@pytest.mark.parametrize("bad", ["missing", "not-a-tokenizer", "bad-chat", "bad-message"])
async def test_bad_tokenizer_or_chat_is_one_line(bad: str, etcd_endpoint: str, key_prefix: str,
                                                 tmp_path) -> None:
    etcd_args = ("--etcd", etcd_endpoint, "--etcd-prefix", key_prefix)
    prompt: tuple[str, ...] = ("--prompt", "hi")
    tok = "qwen3"
    if bad == "missing":
        tok = str(tmp_path / "no-such-tokenizer")
    elif bad == "not-a-tokenizer":
        tok = str(tmp_path / "notes.txt")
        (tmp_path / "notes.txt").write_text("hello")
    elif bad == "bad-chat":
        (tmp_path / "chat.json").write_text('{"role": "user"}')
        prompt = ("--chat", str(tmp_path / "chat.json"))
    else:
        prompt = ("--message", "robot=hello")
    for cmd in (("index", "query", "--model", "m", *etcd_args), ("route",)):
        rc, _, err = await run_cli(*cmd, "--tokenizer", tok, *prompt)
        line = one_line_error(rc, err)
        if bad in ("missing", "not-a-tokenizer"):
            assert tok in line, line
        elif bad == "bad-chat":
            assert "chat.json" in line and "list" in line, line
        else:
            assert "robot" in line, line
