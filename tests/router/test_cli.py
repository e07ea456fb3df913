"""`kvatlas router serve`, `kvatlas route` and `kvatlas generate` as real processes."""
from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvatlas.etcd_proc import free_port


async def run_cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvatlas", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_serve_route_generate(stubs: Any, tmp_path: Path) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvatlas", "router", "serve", "--port", str(port),
        "--pd-disaggregation", "--prefill", p.url, "8998", "--decode", d.url,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(300):
                try:
                    async with session.get(f"{url}/readiness") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("router never became ready")
        rc, out, err = await run_cli("route", "--prompt", "hello " * 20, "--router", url)
        assert rc == 0, err
        assert "static-127.0.0.1" in out and "chosen" in out and "matched blocks" in out
        assert not p.bodies and not d.bodies

        rc, out, err = await run_cli("generate", "--prompt", "hi", "--stream", "--router", url)
        assert rc == 0, err
        assert out.strip() == "tok0tok1tok2"
        assert d.bodies[-1]["bootstrap_port"] == 8998 and d.bodies[-1]["stream"] is True

        (tmp_path / "cluster.json").write_text(json.dumps({"router": {"url": url}}))
        rc, out, err = await run_cli("generate", "--prompt", "hi", "--run-dir", str(tmp_path))
        assert rc == 0 and "from decode0" in out, err
        rc, _, err = await run_cli("route", "--prompt", "x", "--run-dir", str(tmp_path / "no"))
        assert rc == 2 and "no cluster state" in err
    finally:
        router.send_signal(signal.SIGINT)
        await asyncio.wait_for(router.wait(), 10)


@pytest.mark.parametrize("flag", ["missing", "not-a-tokenizer", "MODEL=twice"])
async def test_a_bad_tokenizer_flag_stops_the_router_with_one_line(flag: str,
                                                                   tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    args = {"missing": ["--tokenizer", str(tmp_path / "nope")],
            "not-a-tokenizer": ["--tokenizer", str(notes)],
            "MODEL=twice": ["--tokenizer", "m=qwen3", "--tokenizer", "m=byte"]}[flag]
    rc, out, err = await run_cli("router", "serve", "--port", "1", "--decode",
                             "http://127.0.0.1:1", *args)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert {"missing": "nope", "not-a-tokenizer": "notes.txt",
            "MODEL=twice": "given twice"}[flag] in lines[0], lines[0]
