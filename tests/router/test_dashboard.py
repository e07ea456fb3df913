"""The Grafana dashboard in the repo (deploy/grafana/kvatlas-router.json) names only metrics a
real router exposes: each name in its queries is one of the samples of a TYPE line in a running
router's /metrics (a histogram ``x``: ``x_bucket``/``x_sum``/``x_count``)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvatlas-router.json"
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count")}
"""Sample names of a TYPE line beyond its own name (prometheus_client's TYPE line of a counter
already names its ``_total`` sample)."""


def exposed(text: str) -> set[str]:
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            names.update(name + s for s in SUFFIXES.get(kind, ()))
    return names


async def test_every_metric_the_dashboard_names_exists(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d], policy="kv_aware")
    assert (await client.post("/generate", json={"text": "a dashboard probe"})).status == 200
    have = exposed(await (await client.get("/metrics")).text())
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in doc["panels"] for t in panel["targets"]]
    named = {m for e in exprs for m in re.findall(r"\bkvatlas_[a-z0-9_]+", e)}
    assert len(exprs) >= 20 and len(named) >= 20
    missing = sorted(named - have)
    assert not missing, f"the dashboard names metrics no router exposes: {missing}"
    ids = [panel["id"] for panel in doc["panels"]]
    assert len(ids) == len(set(ids))  # Grafana keys panels by id
