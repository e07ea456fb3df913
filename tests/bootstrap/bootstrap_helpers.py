"""Helpers shared by the bootstrap tests: registration bodies, server processes, the CLI."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY_QUERY = {"prefill_dp_rank": "-1", "prefill_cp_rank": "-1", "target_tp_rank": "-1",
                  "target_pp_rank": "-1"}


def rank_body(*, tp: int = 0, dp: int = 0, cp: int = 0, pp: int = 0, tp_size: int = 1,
              dp_size: int = 1, cp_size: int = 1, pp_size: int = 1, ip: str = "10.0.0.1",
              port: int | None = None, **extra: Any) -> dict[str, Any]:
    """A PUT /route body as SGLang 0.5.23 sends it (attention DP, system_dp_size 1)."""
    body: dict[str, Any] = {
        "attn_tp_size": tp_size, "attn_tp_rank": tp, "attn_cp_size": cp_size, "attn_cp_rank": cp,
        "attn_dp_size": dp_size, "attn_dp_rank": dp, "pp_size": pp_size, "pp_rank": pp,
        "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": ip,
        "rank_port": (port if port is not None
                      else 20000 + ((dp * cp_size + cp) * tp_size + tp) * pp_size + pp),
        "page_size": 16, "kv_cache_dtype": "auto", "kv_layout": None, "dsv41_spec_layout": None,
        "load_balance_method": "follow_bootstrap_room", "enable_dsa_cache_layer_split": False,
        "enable_kv_cache_sharding": False, "prefill_http_port": 30000,
        "decode_allocation_policy": "early",
    }
    body.update(extra)
    return body


def route_query(dp: int, cp: int, tp: int, pp: int) -> dict[str, str]:
    return {"prefill_dp_rank": str(dp), "prefill_cp_rank": str(cp), "target_tp_rank": str(tp),
            "target_pp_rank": str(pp)}


class ServerProcess:
    """A ``kvatlas bootstrap serve`` subprocess on a free loopback port."""

    def __init__(self, args: list[str], port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvatlas", "--log-level", "INFO", "bootstrap", "serve",
             "--port", str(port), *args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read().decode() if self.proc.stdout else ""
                raise RuntimeError(f"bootstrap server exited with {self.proc.returncode}:\n{out}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"bootstrap server on {self.url} not healthy after {timeout}s")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def output(self) -> str:
        return self.proc.stdout.read().decode() if self.proc.stdout else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        if self.proc.stdout:
            self.proc.stdout.close()


def run_cli(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run the ``kvatlas`` command line in a fresh process."""
    return subprocess.run([sys.executable, "-m", "kvatlas", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
