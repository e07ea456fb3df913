"""The local clusters ``bench/routing_quality.py`` and ``bench/mixed_fleet.py`` start: engine
processes of the ``tiny`` model under a fresh etcd key prefix, and a router in front.

Fleets (``fleet``):

- ``pd``: N prefills (finite prefix cache) and one decode;
- ``aggregated``: N monolithic engines with ``--etcd`` (each an ``aggregated`` instance: it serves
  whole requests and indexes its prefix cache under its lease), the same finite cache;
- ``mixed``: both in one cluster. ``hide`` names a shape ("pd" or "aggregated") whose engines
  register under another key prefix, so the router (which discovers from etcd) sees only the
  other shape while the same processes run on the machine: the always-PD and always-aggregated
  baselines of the mixed-fleet bench;
- ``vllm-pd``: the ``pd`` fleet speaking vLLM's PD protocol (``--pd-protocol vllm-pull`` or
  ``vllm-push`` on every engine, from ``args.vllm_mode``): the router reads each pair's protocol
  from the records and drives it with ``kv_transfer_params``; the trace goes in as OpenAI
  ``/v1/completions`` bodies (vLLM's API).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvatlas.etcd_proc import free_port

if str(Path(__file__).resolve().parent) not in sys.path:
    # appended, not first: bench/index.py must not shadow the ``index`` package
    sys.path.append(str(Path(__file__).resolve().parent))
import _routing_trace as rt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
FLEETS = ("pd", "aggregated", "mixed", "vllm-pd")
VLLM_MODES = ("pull", "push")
VARIANTS = {
    "kv_aware:gpu_only": ("--host-hit-weight", "0", "--disk-hit-weight", "0"),
    "kv_aware:no_share": ("--no-share-predictions",),
}
"""kvatlas router flags of a variant: ``gpu_only`` credits no host or disk block, as a router
that forgets a block when its GPU copy goes (the baseline of tier-aware scoring); ``no_share``
keeps each router's predictions to itself (the baseline of shared predictions, with
``--router-counts``)."""


class Proc:
    """One subprocess in its own process group (its rank children die with it)."""

    def __init__(self, name: str, args: list[str], logdir: Path) -> None:
        self.name = name
        self.log_path = logdir / f"{name}.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("KVATLAS_LOG_LEVEL", "WARNING")
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=self.log_path.open("wb"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(8)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers of the group
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except OSError:
        return 0, ""


def wait_until(check, procs: list[Proc], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited while waiting for {what}:\n{p.tail()}")
        if check():
            return
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)$", line)
        if m:
            total += float(m.group(1))
    return total


class Cluster:
    """Fresh engines of one fleet shape under a new etcd key prefix, and routers in front."""

    def __init__(self, args: argparse.Namespace, etcd: str, prefix: str, logdir: Path,
                 fleet: str = "pd", hide: str | None = None) -> None:
        if fleet not in FLEETS:
            raise ValueError(f"fleet must be one of {FLEETS}, got {fleet!r}")
        if hide is not None and fleet != "mixed":
            raise ValueError("hide only applies to the mixed fleet")
        self.args, self.etcd, self.prefix, self.logdir = args, etcd, prefix, logdir
        self.fleet, self.hide = fleet, hide
        self.vllm_mode = getattr(args, "vllm_mode", "pull")
        if fleet == "vllm-pd" and self.vllm_mode not in VLLM_MODES:
            raise ValueError(f"vllm_mode must be one of {VLLM_MODES}, got {self.vllm_mode!r}")
        self.prefills: list[dict[str, Any]] = []
        self.decode: dict[str, Any] = {}
        self.aggregated: list[dict[str, Any]] = []
        self.procs: list[Proc] = []
        self.router_url = ""
        self.router_urls: list[str] = []
        """Every router of the run (``--router-counts``): requests are sprayed across them."""
        self.router_proc: Proc | None = None

    def _engine(self, mode: str, name: str, pages: int, prefix: str) -> dict[str, Any]:
        port = free_port()
        args = [sys.executable, "-m", "kvatlas", "engine", "serve", "--mode", mode,
                "--model", MODEL, "--host", "127.0.0.1", "--port", str(port),
                "--num-pages", str(pages), "--instance-id", name,
                "--etcd", self.etcd, "--etcd-prefix", prefix]
        info: dict[str, Any] = {"name": name, "url": f"http://127.0.0.1:{port}"}
        if mode == "prefill":
            info["bport"] = free_port()
            args += ["--bootstrap-port", str(info["bport"]),
                     "--host-pages", str(getattr(self.args, "host_pages", 0))]
        if self.fleet == "vllm-pd":
            args += ["--pd-protocol", f"vllm-{self.vllm_mode}"]
        info["proc"] = Proc(f"{self.prefix.strip('/')}-{name}", args, self.logdir)
        self.procs.append(info["proc"])
        return info

    def _prefix_of(self, shape: str) -> str:
        return self.prefix + "hidden" if shape == self.hide else self.prefix

    def cache_workers(self) -> list[dict[str, Any]]:
        """The engines whose prefix caches count: prefills and aggregated engines (a decode
        receives the KV it needs, so its cache plays no part)."""
        return [*self.prefills, *self.aggregated]

    def visible_workers(self) -> list[dict[str, Any]]:
        """The cache workers the router should discover (all but the hidden shape's)."""
        return [*(self.prefills if self.hide != "pd" else []),
                *(self.aggregated if self.hide != "aggregated" else [])]

    def start_workers(self) -> None:
        a = self.args
        if self.fleet in ("pd", "mixed", "vllm-pd"):
            pre = self._prefix_of("pd")
            self.prefills = [self._engine("prefill", f"prefill-{i}", a.prefill_pages, pre)
                             for i in range(a.prefills)]
            self.decode = self._engine("decode", "decode-0", a.decode_pages, pre)
        if self.fleet in ("aggregated", "mixed"):
            n = a.prefills if self.fleet == "aggregated" else getattr(a, "aggregated", a.prefills)
            self.aggregated = [self._engine("monolithic", f"agg-{i}", a.prefill_pages,
                                            self._prefix_of("aggregated")) for i in range(n)]
        engines = [*self.prefills, *([self.decode] if self.decode else []), *self.aggregated]

        def ready() -> bool:
            for w in engines:
                if http_get(w["url"] + "/health")[0] != 200:
                    return False
                if "bport" in w and http_get(f"http://127.0.0.1:{w['bport']}/ready")[0] != 200:
                    return False
            return True

        wait_until(ready, self.procs, "engine instances", 180)

    def start_routers(self, router: str, count: int, extra: tuple[str, ...] = ()) -> None:
        for k in range(count):
            self.start_router(router, k, extra)
            self.router_urls.append(self.router_url)
        self.router_url = self.router_urls[0]

    def _sglang_args(self, policy: str) -> list[str]:
        if self.fleet == "aggregated":
            # REGULAR mode: one worker serves the whole request; cache_aware keeps its
            # approximate text tree per worker
            return ["--worker-urls", *(w["url"] for w in self.aggregated), "--policy", policy]
        if self.fleet != "pd":
            raise ValueError("sglang-router runs in front of the pd or aggregated fleet only")
        pf = [x for w in self.prefills for x in ("--prefill", w["url"], str(w["bport"]))]
        return ["--pd-disaggregation", *pf, "--decode", self.decode["url"], "--policy", policy]

    def start_router(self, router: str, k: int = 0, extra: tuple[str, ...] = ()) -> None:
        port = free_port()
        self.router_url = f"http://127.0.0.1:{port}"
        if router.startswith("sglang:"):
            args = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                    "--port", str(port), *self._sglang_args(router.split(":")[1]),
                    "--log-level", "debug",
                    "--prometheus-port", str(free_port()),
                    *getattr(self.args, "sglang_arg", [])]
        else:
            args = [sys.executable, "-m", "kvatlas", "router", "serve", "--host", "127.0.0.1",
                    "--port", str(port), "--etcd", self.etcd, "--etcd-prefix", self.prefix,
                    "--model", MODEL, "--policy", router.split(":")[0],
                    "--decode-policy", "power_of_two", "--health-check-interval-secs", "1",
                    *VARIANTS.get(router, ()), *extra,
                    *getattr(self.args, "kvatlas_arg", [])]
        proc = Proc(f"{self.prefix.strip('/')}-router{k}", args, self.logdir)
        self.router_proc = proc
        self.procs.append(proc)
        names = [w["name"] for w in self.visible_workers()]

        def ready() -> bool:
            if http_get(self.router_url + "/readiness")[0] != 200:
                return False
            if router.startswith("sglang:"):
                return True
            code, body = http_get(self.router_url + "/workers")
            if code != 200:
                return False
            text = json.dumps(json.loads(body))
            return all(n in text for n in names)

        wait_until(ready, [proc], f"router {router}", 60)

    def engine_metrics(self) -> dict[str, Any]:
        """Prefix-cache counters summed over :meth:`cache_workers`, and per instance."""
        out = {"cached_tokens": 0.0, "prefill_computed_tokens": 0.0, "prompt_tokens": 0.0,
               "requests": 0.0, "kv_evictions": 0.0}
        per = []
        for w in self.cache_workers():
            code, text = http_get(w["url"] + "/metrics", timeout=5)
            if code != 200:
                raise RuntimeError(f"{w['name']} /metrics answered {code}")
            row = {k: metric(text, f"kvatlas_engine_{k}_total")
                   or metric(text, f"kvatlas_engine_{k}") for k in out}
            per.append({"instance": w["name"], **row})
            for k in out:
                out[k] += row[k]
        return {**out, "per_instance": per}

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()


# --- per-router run ----------------------------------------------------------------------------

def router_diag(url: str) -> dict[str, float]:
    """kvatlas router's own view: predicted prefix-hit tokens, index size, shared predictions."""
    code, text = http_get(url + "/metrics", timeout=5)
    if code != 200:
        return {}
    out = {key: metric(text, f"kvatlas_router_{name}")
           for key, name in (("prefix_hit_tokens", "prefix_hit_tokens_total"),
                             ("index_blocks", "index_blocks"),
                             ("predicted_blocks", "predicted_blocks"),
                             ("index_ready", "index_ready"),
                             ("prediction_puts", "shared_prediction_puts_total"),
                             ("prediction_bytes", "shared_prediction_bytes_total"))}
    for line in text.splitlines():
        # the per-request choice between PD and aggregated (mixed fleets only)
        m = re.match(r'^kvatlas_router_disagg_decisions_total\{path="(\w+)",reason="(\w+)"\}'
                     r'\s+(\S+)$', line)
        if m:
            out[f"disagg:{m.group(1)}:{m.group(2)}"] = float(m.group(3))
    for direction in ("sent", "received", "stale"):
        out[f"shared_{direction}"] = metric(
            text, f'kvatlas_router_shared_predictions_total{{direction="{direction}"}}')
    return out


def etcd_puts(endpoint: str) -> float:
    """Puts etcd has applied since it started (its own /metrics)."""
    code, text = http_get(f"http://{endpoint}/metrics", timeout=5)
    return metric(text, "etcd_mvcc_put_total") if code == 200 else float("nan")


def sglang_diag(log: Path) -> dict[str, int]:
    """sglang-router's debug log: how many prefill selections its cache_aware policy made from
    its radix tree, and how many fell back to a random worker ("No tree found for model")."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return {}
    return {"pd_selections": text.count("Selecting PD pair"),
            "random_fallbacks": text.count("No tree found for model")}


def run_router(args: argparse.Namespace, etcd: str, router: str, i: int, logdir: Path,
               reqs: list[rt.Req], count: int = 1, fleet: str = "pd", hide: str | None = None,
               extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One fresh cluster of ``fleet`` with ``count`` routers of kind ``router`` (``extra``:
    more kvatlas router flags), ``reqs`` replayed through them, the engines' counters after."""
    t0 = time.monotonic()
    for attempt in range(3):
        # free_port() can race with other processes on the box: retry on a lost port
        cluster = Cluster(args, etcd, f"/rq{os.getpid()}x{i}a{attempt}", logdir, fleet, hide)
        try:
            cluster.start_workers()
            cluster.start_routers(router, count, extra)
            break
        except BaseException as exc:  # Ctrl-C included: never leave a process behind
            cluster.stop()
            if "address already in use" not in str(exc) or attempt == 2:
                raise
            print(f"  {router}: a port was taken meanwhile; starting again", flush=True)
    try:
        startup = time.monotonic() - t0
        puts0 = etcd_puts(etcd.split(",")[0])
        res = asyncio.run(rt.replay(cluster.router_urls, reqs, args.concurrency,
                                    args.request_timeout,
                                    "completions" if fleet == "vllm-pd" else "generate"))
        time.sleep(0.3)
        res["etcd_puts"] = etcd_puts(etcd.split(",")[0]) - puts0
        res.update(cluster.engine_metrics())
        served = [row["requests"] for row in res["per_instance"]]
        # How evenly the requests went: max over mean of each cache worker's (1.0: even).
        res["spread"] = (max(served) / (sum(served) / len(served))) if sum(served) else None
        if router.startswith("sglang:") and cluster.router_proc is not None:
            res["router_view"] = sglang_diag(cluster.router_proc.log_path)
        else:
            views = [router_diag(u) for u in cluster.router_urls]
            res["router_view"] = {k: sum(v.get(k, 0.0) for v in views)
                                  for k in {k for v in views for k in v}}
        res["routers"] = count
        res["startup_s"] = round(startup, 1)
        res["fleet"] = fleet
        if fleet == "vllm-pd":
            res["vllm_mode"] = cluster.vllm_mode
        return res
    finally:
        cluster.stop()
