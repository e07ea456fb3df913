"""Benchmark of the reference engine (issue #4): prefill and decode tokens/s, with and without
prefix-cache hits, against the raw model forward measured in the same run.

  .venv/bin/python bench/engine.py                 # tiny model, about 30 s
  .venv/bin/python bench/engine.py --model bench   # the 128 KiB/token geometry (slower)

Parts:
1. Prefill, cold: ``--requests`` prompts of ``--prompt-len`` tokens, no cached prefix, one output
   token each (so the time is prefill). Tokens/s counts prompt tokens.
2. Prefill, warm: the same prompts again; all full blocks but the last come from the prefix cache,
   so only the tail is computed. Prompt tokens/s rises by about prompt_len / computed_len, which
   shows the cached path skips its work (computed-token counts are printed next to it).
3. Decode: ``--requests`` sequences decoding ``--decode-len`` tokens each (greedy), batched by the
   scheduler; tokens/s over the decode-only steps.
4. Stop strings: the text stream's hold-back against the most stop strings a request may give,
   each ``a^128 b^127 x`` (after ``a`` * 128 the text ends with a 128-character prefix of every
   one, the worst case of a suffix rescan), as tokens/s against the same stream with no stop
   string; the ratio shows what stop matching costs per token (issue #11 moved this figure here
   from a test that timed it).
The limit: the model's forward called directly (no scheduler, no sampling, no cache bookkeeping)
on the same shapes: a prefill chunk of ``--max-batch-tokens`` tokens, and ``--requests``
single-token decodes at the decode phase's mean context (64 + decode_len / 2). For prefill with
prefix hits the ratio exceeds 1 by design: prompt tokens served per second vs tokens computed. The ratio
engine / raw shows what the engine's bookkeeping costs.

Writes bench/results/engine.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.config import get_model_config  # noqa: E402
from engine.model import SeqChunk  # noqa: E402
from engine.runner import build_scheduler, run_to_completion  # noqa: E402
from engine.sampling import MAX_STOP_STRINGS, SamplingParams, TextStream  # noqa: E402
from engine.scheduler import Request, Scheduler  # noqa: E402
from tokenization.byte import BOS_ID  # noqa: E402


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[BOS_ID] + [rng.randrange(256) for _ in range(length - 1)] for _ in range(n)]


def timed_run(sched: Scheduler, reqs: list[Request]) -> float:
    t0 = time.perf_counter()
    run_to_completion(sched, reqs)
    return time.perf_counter() - t0


def prefill(sched: Scheduler, ps: list[list[int]], tag: str) -> dict[str, Any]:
    before = dict(sched.totals)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    secs = timed_run(sched, [Request(f"{tag}{i}", p, params) for i, p in enumerate(ps)])
    prompt = sched.totals["prompt_tokens"] - before["prompt_tokens"]
    computed = sched.totals["prefill_computed_tokens"] - before["prefill_computed_tokens"]
    cached = sched.totals["cached_tokens"] - before["cached_tokens"]
    return {"seconds": secs, "prompt_tokens": prompt, "computed_tokens": computed,
            "cached_tokens": cached, "prompt_tokens_per_s": prompt / secs,
            "computed_tokens_per_s": computed / secs}


def decode(sched: Scheduler, ps: list[list[int]], n_new: int, tag: str) -> dict[str, Any]:
    params = SamplingParams(max_new_tokens=n_new, temperature=0.0, ignore_eos=True)
    reqs = [Request(f"{tag}{i}", p, params) for i, p in enumerate(ps)]
    for r in reqs:
        sched.add(r)
    decode_s = 0.0
    decode_tokens = 0
    t0 = time.perf_counter()
    while sched.has_work:
        t = time.perf_counter()
        sched.step()
        st = sched.last_step
        if st.prefill_tokens == 0 and st.decode_tokens:
            decode_s += time.perf_counter() - t
            decode_tokens += st.decode_tokens
    total = time.perf_counter() - t0
    return {"seconds": total, "decode_seconds": decode_s, "decode_tokens": decode_tokens,
            "cached_tokens": sum(r.cached_tokens for r in reqs),
            "decode_tokens_per_s": decode_tokens / decode_s}


def stop_strings(n_tokens: int) -> dict[str, Any]:
    """Tokens/s through a TextStream with the worst-case stop strings, and with none."""
    stops = ["a" * 128 + "b" * 127 + chr(0x100 + i) for i in range(MAX_STOP_STRINGS)]

    def push_all(params: SamplingParams) -> float:
        ts = TextStream(params)
        t0 = time.perf_counter()
        for _ in range(n_tokens):
            _, stopped = ts.push(ord("a"))
            assert not stopped
        return time.perf_counter() - t0

    with_stops = min(push_all(SamplingParams(stop=stops, ignore_eos=True)) for _ in range(3))
    plain = min(push_all(SamplingParams(ignore_eos=True)) for _ in range(3))
    return {"tokens": n_tokens, "stop_strings": len(stops), "stop_chars": len(stops[0]),
            "seconds": with_stops, "tokens_per_s": n_tokens / with_stops,
            "no_stop_tokens_per_s": n_tokens / plain, "ratio": plain / with_stops}


def raw_limits(sched: Scheduler, chunk: int, batch: int, ctx: int, reps: int) -> dict[str, float]:
    model, pool = sched.model, sched.pool
    b = pool.page_size
    pages_per_seq = -(-max(chunk, ctx + 1) // b)
    table = list(range(pages_per_seq))
    toks = [BOS_ID] + [7] * (chunk - 1)
    model.forward([SeqChunk(toks, 0, table)], pool)  # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        model.forward([SeqChunk(toks, 0, table)], pool)
    prefill_tps = reps * chunk / (time.perf_counter() - t0)
    n = min(batch, pool.num_pages // pages_per_seq)
    tables = [list(range(i * pages_per_seq, (i + 1) * pages_per_seq)) for i in range(n)]
    chunks = [SeqChunk([5], ctx, t) for t in tables]
    model.forward(chunks, pool)
    t0 = time.perf_counter()
    for _ in range(reps * 4):
        model.forward(chunks, pool)
    decode_tps = reps * 4 * n / (time.perf_counter() - t0)
    return {"prefill_tokens_per_s": prefill_tps, "decode_tokens_per_s": decode_tps,
            "decode_batch": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=["tiny", "bench"])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-len", type=int, default=128)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine.json"))
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1, as the engine server; 0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = get_model_config(args.model)
    per_seq = -(-(args.prompt_len + args.decode_len) // 16)
    sched = build_scheduler(cfg, num_pages=per_seq * args.requests * 2 + 64,
                            max_batch_tokens=args.max_batch_tokens)
    ps = prompts(args.requests, args.prompt_len, seed=1)

    # warm-up: torch picks kernels and the pool's memory is touched on first use
    for _ in range(2):
        raw_limits(sched, args.max_batch_tokens, args.requests, 64 + args.decode_len // 2, reps=2)
        decode(sched, prompts(args.requests, 64, seed=3), 16, "wu")
        sched.flush_cache()
    # best of three for every phase, as for the limit (the machine is shared and noisy)
    colds, warms, dcs, dws = [], [], [], []
    for t in range(3):
        sched.flush_cache()
        colds.append(prefill(sched, ps, f"cold{t}-"))
        warms.append(prefill(sched, ps, f"warm{t}-"))
        dcs.append(decode(sched, prompts(args.requests, 64, seed=2 + t), args.decode_len, "dc"))
        dws.append(decode(sched, prompts(args.requests, 64, seed=2 + t), args.decode_len, "dw"))
    cold = max(colds, key=lambda r: r["prompt_tokens_per_s"])
    warm = max(warms, key=lambda r: r["prompt_tokens_per_s"])
    dec_cold = max(dcs, key=lambda r: r["decode_tokens_per_s"])
    dec_warm = max(dws, key=lambda r: r["decode_tokens_per_s"])
    # the limit, best of three
    trials = [raw_limits(sched, args.max_batch_tokens, args.requests, 64 + args.decode_len // 2, reps=5)
              for _ in range(3)]
    raw = {k: max(t[k] for t in trials) for k in trials[0]}

    rows = [
        ("prefill, no prefix hits", cold["prompt_tokens_per_s"], cold["computed_tokens"],
         cold["cached_tokens"], raw["prefill_tokens_per_s"]),
        ("prefill, prefix hits", warm["prompt_tokens_per_s"], warm["computed_tokens"],
         warm["cached_tokens"], raw["prefill_tokens_per_s"]),
        ("decode, no prefix hits", dec_cold["decode_tokens_per_s"], dec_cold["decode_tokens"],
         dec_cold["cached_tokens"], raw["decode_tokens_per_s"]),
        ("decode, prefix hits", dec_warm["decode_tokens_per_s"], dec_warm["decode_tokens"],
         dec_warm["cached_tokens"], raw["decode_tokens_per_s"]),
    ]
    print(f"engine benchmark: model {cfg.name} ({cfg.dtype}, {cfg.num_layers} layers, "
          f"KV {cfg.kv_bytes_per_token} B/token), {args.requests} requests, prompt "
          f"{args.prompt_len}, decode {args.decode_len}, torch threads {torch.get_num_threads()}")
    print(f"{'phase':<26}{'tokens/s':>12}{'computed':>10}{'cached':>9}{'raw fwd/s':>12}{'ratio':>8}")
    for name, tps, computed, cached, limit in rows:
        print(f"{name:<26}{tps:>12.0f}{computed:>10}{cached:>9}{limit:>12.0f}{tps / limit:>8.2f}")
    speedup = warm["prompt_tokens_per_s"] / cold["prompt_tokens_per_s"]
    stops = stop_strings(6000)
    print(f"{'stop strings, worst case':<26}{stops['tokens_per_s']:>12.0f}{stops['tokens']:>10}"
          f"{'':>9}{stops['no_stop_tokens_per_s']:>12.0f}{stops['ratio']:>8.2f}"
          f"   ({stops['stop_strings']} stops of {stops['stop_chars']} chars; the limit column "
          f"is the stream without stops)")
    print(f"prefix hits: {warm['cached_tokens']} of {warm['prompt_tokens']} prompt tokens served "
          f"from cache, computed {warm['computed_tokens']} instead of {cold['computed_tokens']}; "
          f"prompt throughput x{speedup:.1f}")
    result = {"model": cfg.name, "dtype": cfg.dtype, "kv_bytes_per_token": cfg.kv_bytes_per_token,
              "requests": args.requests, "prompt_len": args.prompt_len,
              "decode_len": args.decode_len, "max_batch_tokens": args.max_batch_tokens,
              "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
              "prefill_cold": cold, "prefill_warm": warm, "decode_cold": dec_cold,
              "decode_warm": dec_warm, "raw_forward": raw, "warm_prefill_speedup": speedup,
              "ratios": {name: tps / limit for name, tps, _, _, limit in rows},
              "stop_strings": stops}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
