"""Closed-loop overload through the router (``bench/load.py --overload``).

N clients each send a request, wait for its answer, and send the next at once (after the
``Retry-After`` of a 429: a well-behaved client), for ``--duration`` seconds or until
``--requests`` were sent. Prompts are ~T tokens (T - 1 random ASCII characters: the tiny model's
byte tokenizer adds a BOS), distinct per request so that no prefix cache makes them cheap; each
asks for ``--max-new-tokens`` (32 here by default).

Per run (one per client count): requests answered by status (200, 429, other), max and p99
latency, throughput (requests/s and generated tokens/s), and the engines' KV pages after the run
(``kvatlas_engine_kv_pages_used`` of every engine's ``/metrics``, waited on until it is back to
0: pages a run leaves held are a leak or a stuck request). The targets (issue: a burst waits at
the router, not inside both pools): every request answered 200 or 429, none waits over 60 s,
pages back to idle, and throughput at 300 clients at least 0.8x that at 32 when both ran.
"""
from __future__ import annotations

import asyncio
import random
import string
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import aiohttp

MAX_WAIT_S = 60.0
"""Target: no request waits longer (429s included)."""
SCALE_RATIO = 0.8
"""Target: throughput at 300 clients over that at 32."""
PAGES_IDLE_TIMEOUT = 60.0
"""Seconds the engines get, after a run, to free every page."""
_ALPHABET = string.ascii_letters + string.digits + " "


@dataclass
class Outcome:
    latency: float
    status: str
    """``200``, ``429``, another status, or the client error's name (``timeout``)."""
    tokens: int
    """Tokens generated (a 200's ``meta_info.completion_tokens``)."""


def make_prompt(rng: random.Random, tokens: int, tag: str) -> str:
    body = "".join(rng.choices(_ALPHABET, k=max(tokens - 1 - len(tag), 1)))
    return f"{tag}{body}"


async def one(session: aiohttp.ClientSession, url: str, prompt: str, max_new: int,
              timeout: float) -> tuple[Outcome, float]:
    """One request; (its outcome, the seconds a 429 asked to wait)."""
    body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0,
                                                "ignore_eos": True}}
    t0 = time.perf_counter()
    try:
        async with session.post(f"{url}/generate", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            raw = await resp.read()
            latency = time.perf_counter() - t0
            if resp.status == 200:
                try:
                    meta = (await resp.json(content_type=None)).get("meta_info") or {}
                    tokens = int(meta.get("completion_tokens", max_new))
                except (ValueError, TypeError, AttributeError):
                    tokens = max_new
                return Outcome(latency, "200", tokens), 0.0
            wait = 0.0
            if resp.status == 429:
                try:
                    wait = float(resp.headers.get("Retry-After", "1"))
                except ValueError:
                    wait = 1.0
            del raw
            return Outcome(latency, str(resp.status), 0), wait
    except TimeoutError:
        return Outcome(time.perf_counter() - t0, "timeout", 0), 0.0
    except aiohttp.ClientError as exc:
        return Outcome(time.perf_counter() - t0, type(exc).__name__, 0), 0.0


async def drive(url: str, clients: int, prompt_tokens: int, max_new: int, duration: float,
                requests: int | None, timeout: float, seed: int) -> tuple[list[Outcome], float]:
    """Run ``clients`` closed loops; (outcomes, seconds until the last answer)."""
    results: list[Outcome] = []
    sent = 0
    start = time.perf_counter()
    deadline = start + duration

    async def client(i: int) -> None:
        nonlocal sent
        rng = random.Random(seed * 100_003 + i)
        n = 0
        while time.perf_counter() < deadline and (requests is None or sent < requests):
            sent += 1
            n += 1
            outcome, wait = await one(session, url, make_prompt(rng, prompt_tokens, f"{i}.{n} "),
                                      max_new, timeout)
            results.append(outcome)
            if wait:
                await asyncio.sleep(min(wait, max(deadline - time.perf_counter(), 0.0)))

    # One connection per client: aiohttp's default pool (100) would queue clients in the bench.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(i) for i in range(clients)))
    return results, time.perf_counter() - start


def _metric(text: str, name: str) -> float | None:
    total = None
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            try:
                total = (total or 0.0) + float(line.rsplit(None, 1)[-1])
            except ValueError:
                continue
    return total


def engine_pages(engines: dict[str, str]) -> dict[str, dict[str, float | None]]:
    """Per engine (name -> base URL): KV pages used by requests, cached, and total."""
    out: dict[str, dict[str, float | None]] = {}
    for name, url in engines.items():
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
                text = r.read().decode("utf-8", "replace")
        except OSError as exc:
            out[name] = {"used": None, "cached": None, "total": None, "error": str(exc)}
            continue
        out[name] = {k: _metric(text, f"kvatlas_engine_kv_pages_{k}")
                     for k in ("used", "cached", "total")}
    return out


def pages_after(engines: dict[str, str],
                timeout: float = PAGES_IDLE_TIMEOUT) -> tuple[dict[str, Any], float | None]:
    """The engines' pages once none is used by a request (or at ``timeout``); the seconds that
    took (None: they were not all back to idle)."""
    t0 = time.monotonic()
    while True:
        pages = engine_pages(engines)
        if all(p.get("used") == 0 for p in pages.values()):
            return pages, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return pages, None
        time.sleep(0.25)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(clients: int, results: list[Outcome], elapsed: float, pages: dict[str, Any],
              idle_s: float | None) -> dict[str, Any]:
    by_status: dict[str, int] = {}
    for r in results:
        by_status[r.status] = by_status.get(r.status, 0) + 1
    ok = [r for r in results if r.status == "200"]
    lat = [r.latency for r in results]
    ok_lat = [r.latency for r in ok]
    p99 = pct(lat, 0.99)
    return {
        "clients": clients, "requests": len(results), "elapsed_s": round(elapsed, 2),
        "status": by_status, "ok": len(ok), "rejected_429": by_status.get("429", 0),
        "other": len(results) - len(ok) - by_status.get("429", 0),
        "latency_max_s": round(max(lat), 3) if lat else None,
        "latency_p99_s": round(p99, 3) if p99 is not None else None,
        "ok_latency_p50_s": round(pct(ok_lat, 0.5) or 0.0, 3) if ok_lat else None,
        "throughput_rps": round(len(ok) / elapsed, 3) if elapsed else 0.0,
        "throughput_tokens_s": round(sum(r.tokens for r in ok) / elapsed, 1) if elapsed else 0.0,
        "pages_after": pages, "pages_idle_after_s": None if idle_s is None else round(idle_s, 2),
    }


def targets(runs: list[dict[str, Any]]) -> list[str]:
    """The targets a set of runs missed, each said in a line (empty: all met)."""
    missed = []
    for r in runs:
        c = r["clients"]
        if r["other"]:
            missed.append(f"{c} clients: {r['other']} requests answered neither 200 nor 429 "
                          f"({r['status']})")
        if r["latency_max_s"] is not None and r["latency_max_s"] > MAX_WAIT_S:
            missed.append(f"{c} clients: a request waited {r['latency_max_s']} s "
                          f"(> {MAX_WAIT_S:g} s)")
        if r["pages_idle_after_s"] is None:
            missed.append(f"{c} clients: engine pages not back to idle within "
                          f"{PAGES_IDLE_TIMEOUT:g} s: {r['pages_after']}")
    by = {r["clients"]: r for r in runs}
    if 32 in by and 300 in by and by[32]["throughput_rps"]:
        ratio = by[300]["throughput_rps"] / by[32]["throughput_rps"]
        if ratio < SCALE_RATIO:
            missed.append(f"throughput at 300 clients is {ratio:.2f}x that at 32 "
                          f"(< {SCALE_RATIO:g}x)")
    return missed


def print_table(runs: list[dict[str, Any]]) -> None:
    head = (f"{'clients':>8}{'requests':>10}{'200':>8}{'429':>8}{'other':>7}{'max s':>9}"
            f"{'p99 s':>9}{'req/s':>9}{'tok/s':>9}{'pages used after':>18}{'idle after s':>14}")
    print(head)
    for r in runs:
        used = sum(p.get("used") or 0 for p in r["pages_after"].values())
        idle = r["pages_idle_after_s"]
        print(f"{r['clients']:>8}{r['requests']:>10}{r['ok']:>8}{r['rejected_429']:>8}"
              f"{r['other']:>7}{r['latency_max_s'] or 0:>9.2f}{r['latency_p99_s'] or 0:>9.2f}"
              f"{r['throughput_rps']:>9.2f}{r['throughput_tokens_s']:>9.1f}{used:>18g}"
              f"{'never' if idle is None else f'{idle:.2f}':>14}")
