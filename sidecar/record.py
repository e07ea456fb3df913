"""The instance record a sidecar writes for its engine (``index.record.InstanceRecord``)."""
from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit

from bootstrap.mapping import DECODE_SIDE_KEYS, PrefillServerInfo
from index.record import InstanceRecord
from sidecar.config import SidecarConfig

logger = logging.getLogger(__name__)

SOURCE = "sidecar"
"""The record's ``source``: who wrote it (the id claim only compares records of one kind)."""


def _int(doc: dict[str, Any], name: str) -> int | None:
    v = doc.get(name)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def info_tokenizer(info: dict[str, Any]) -> str | dict[str, Any] | None:
    """The tokenizer an engine's server info names: kvatlas's ``{source, fingerprint, kind}``,
    else SGLang's ``tokenizer_path`` (a source without a fingerprint), else None."""
    tok = info.get("tokenizer")
    if isinstance(tok, dict) and isinstance(tok.get("source"), str):
        return tok
    path = info.get("tokenizer_path")
    return path if isinstance(path, str) and path else None


def page_size_of(info: dict[str, Any], topo: PrefillServerInfo | None) -> int | None:
    """The engine's KV page size: what its ranks registered, else its server arguments."""
    if topo is not None and topo.page_size is not None:
        return topo.page_size
    return _int(info, "page_size")


def build_record(cfg: SidecarConfig, *, info: dict[str, Any], topo: PrefillServerInfo | None,
                 registered: int, ready: bool, healthy: bool, started_at: float,
                 tokenizer: str | dict[str, Any] | None) -> InstanceRecord:
    boot = urlsplit(cfg.bootstrap_url) if cfg.bootstrap_url else None
    topology = None
    if topo is not None:
        topology = {k: v for k, v in topo.to_json().items() if k not in DECODE_SIDE_KEYS}
    engine = info.get("engine")
    proto = cfg.pd_protocol
    return InstanceRecord(
        instance_id=cfg.instance_id, role=cfg.role, model=cfg.model, url=cfg.engine_url,
        bootstrap_host=boot.hostname if boot else None, bootstrap_port=boot.port if boot else None,
        tp_size=(topo.attn_tp_size if topo
                 else _int(info, "tp_size") or (proto.tp_size if proto else None)),
        dp_size=topo.dp_size if topo else (_int(info, "dp_size") or cfg.dp_size),
        pp_size=topo.pp_size if topo else (_int(info, "pp_size") or 1),
        cp_size=topo.attn_cp_size if topo else 1,
        page_size=page_size_of(info, topo), block_size=cfg.block_size,
        started_at=started_at, ready=ready, healthy=healthy, source=SOURCE,
        tokenizer=tokenizer if tokenizer is not None else info_tokenizer(info),
        # The server info's own name (kvatlas's engine says it), else the --engine kind.
        engine=engine if isinstance(engine, str) and engine else cfg.engine,
        kv_cache_dtype=(topo.kv_cache_dtype if topo else None),
        kv_events=cfg.events.endpoint if cfg.events else None,
        expected_ranks=topo.num_ranks if topo else None,
        registered_ranks=registered if cfg.bootstrap_url else None, topology=topology,
        max_prompt_tokens=_int(info, "max_prompt_tokens"),
        max_body_bytes=_int(info, "max_body_bytes"),
        context_length=_int(info, "context_length"),
        max_running_requests=_int(info, "max_running_requests"),
        max_total_num_tokens=_int(info, "max_total_num_tokens"),
        # None: SGLang's bootstrap (the record's default), or an aggregated instance.
        **({"pd_protocol": proto} if proto is not None else {}))
