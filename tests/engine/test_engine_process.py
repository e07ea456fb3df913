"""Two real ``kvatlas engine serve`` processes with the same seed give the same tokens (greedy and
seeded sampling); the CLI refuses PD settings that cannot work, naming the flag."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from waiting import wait_until

from kvatlas.etcd_proc import free_port

pytestmark = pytest.mark.timeout(90)
ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _spawn(port: int, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvatlas", "engine", "serve", "--mode", "monolithic",
         "--model", "tiny", "--host", "127.0.0.1", "--port", str(port), *extra],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


async def _wait_healthy(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen[bytes]
                        ) -> None:
    async def healthy() -> bool:
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"engine exited with {proc.returncode}: {out}")
        try:
            async with session.get(url + "/health") as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False
    await wait_until(healthy, what=f"{url} answers /health 200", timeout=60.0, interval=0.1)


REQUESTS = [
    {"text": "determinism across processes", "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}},
    {"text": "seeded sampling across processes", "sampling_params": {
        "max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 7, "ignore_eos": True}},
    {"input_ids": [256, *range(40, 90)], "sampling_params": {
        "max_new_tokens": 12, "temperature": 0.7, "top_k": 20, "seed": 123, "ignore_eos": True}},
]


async def test_two_processes_same_seed_same_tokens() -> None:
    ports = [free_port(), free_port()]
    procs = [_spawn(p) for p in ports]
    try:
        async with aiohttp.ClientSession() as s:
            urls = [f"http://127.0.0.1:{p}" for p in ports]
            await asyncio.gather(*(_wait_healthy(s, u, pr) for u, pr in zip(urls, procs)))
            results = []
            for url in urls:
                outs = []
                for body in REQUESTS:
                    async with s.post(url + "/generate", json=body) as r:
                        assert r.status == 200, await r.text()
                        outs.append((await r.json())["output_ids"])
                results.append(outs)
        assert results[0] == results[1]
        assert all(len(o) >= 12 for o in results[0])
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
            if p.stdout:
                p.stdout.close()


def test_cli_refuses_bad_pd_settings() -> None:
    r = subprocess.run([sys.executable, "-m", "kvatlas", "engine", "serve", "--mode", "decode",
                        "--dp", "2", "--port", str(free_port())], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--dp applies to prefill instances" in r.stderr
