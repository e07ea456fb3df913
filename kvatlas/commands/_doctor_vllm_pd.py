"""``kvatlas doctor``'s vLLM PD links: would a router's vLLM prefill/decode pairs move KV?

vLLM's PD (its NixlConnector, ``kv_transfer_params``) fails in ways no record shows on its own,
so per model whose records speak vLLM's protocol (``pd_protocol.name == "vllm"``) this walks:

- **pair**: at least one prefill and one decode of the model speak it;
- **modes agree**: push (``NixlPushConnector``) and pull (``NixlConnector``) refuse each
  other, so every prefill and decode of one model must be in one mode;
- **push identity**: a push prefill's record names its engine id, side-channel host and port
  and TP size (a router puts them in the decode's request before the prefill answers);
- **canary**: one request sent directly to each prefill with one decode of its mode, as a
  router would (the same ``X-Request-Id`` to both; the prefill gets ``do_remote_decode``, the
  decode the prefill's answer in pull mode or the record's identity in push mode): both must
  answer 200, the prefill with ``kv_transfer_params`` naming its blocks and the identity its
  record gives.
"""
from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import aiohttp

from index.pd_protocol import CONNECTORS, KV_PARAMS, PREFILL_PARAMS, PUSH, VLLM
from index.record import DECODE, PREFILL, InstanceRecord
from kvatlas.commands._doctor_vllm import CheckedLink
from kvatlas.launcher.doctor import _request

CANARY_PROMPT = ("kvatlas doctor: a canary request for a vLLM prefill/decode pair, long enough "
                 "to fill more than one KV block of sixteen tokens on any tokenizer there is.")
def pair_links(model: str, prefills: list[InstanceRecord],
               decodes: list[InstanceRecord]) -> list[CheckedLink]:
    """The record-only links of one model's vLLM PD instances (pure)."""
    links: list[CheckedLink] = []
    links.append((f"{model}: vLLM PD pair registered", bool(prefills and decodes),
                  f"{len(prefills)} prefill, {len(decodes)} decode speak vLLM's protocol",
                  "start the missing half's sidecar with --engine vllm --role prefill|decode "
                  "--pd-protocol vllm-pull|vllm-push (the engine's kv_role kv_producer or "
                  "kv_consumer)"))
    modes = {r.instance_id: str(r.pd_protocol.mode) for r in (*prefills, *decodes)}
    if len(set(modes.values())) > 1:
        shown = ", ".join(f"{iid} {m}" for iid, m in sorted(modes.items()))
        links.append((f"{model}: vLLM PD modes agree", False, f"modes differ: {shown}",
                      "push and pull refuse each other: give every prefill and decode of "
                      f"{model} the same kv_connector (NixlConnector = pull, NixlPushConnector "
                      "= push) and their sidecars the same --pd-protocol"))
    else:
        links.append((f"{model}: vLLM PD modes agree", True,
                      f"all {next(iter(modes.values()), 'none')}", ""))
    for rec in prefills:
        missing = rec.pd_protocol.missing_identity()
        if rec.pd_protocol.mode != PUSH:
            continue
        flags = {"engine_id": "--nixl-engine-id", "host": "--nixl-host", "port": "--nixl-port",
                 "tp_size": "--tp-size"}
        links.append((f"{rec.instance_id}: vLLM push identity", not missing,
                      (f"record lacks {', '.join(missing)}" if missing else
                       f"engine {rec.pd_protocol.engine_id} at {rec.pd_protocol.host}:"
                       f"{rec.pd_protocol.port}, TP {rec.pd_protocol.tp_size}"),
                      "restart its sidecar with " + " ".join(flags[m] for m in missing)
                      + " (a router names them in the decode's request before the prefill "
                        "answers)"))
    return links


def check_prefill_answer(rec: InstanceRecord, params: Any) -> str | None:
    """Why a prefill's ``kv_transfer_params`` would not let a decode read its KV; None: fine."""
    if not isinstance(params, dict):
        return ("its answer carries no kv_transfer_params: is it started with --kv-transfer-"
                "config '{\"kv_connector\": \"" + CONNECTORS[str(rec.pd_protocol.mode)]
                + "\", \"kv_role\": \"kv_producer\"}'?")
    proto = rec.pd_protocol
    mode = params.get("transfer_mode")
    if mode is not None and mode != proto.mode:
        return (f"it runs {mode} mode, its record says {proto.mode}: give its sidecar "
                f"--pd-protocol vllm-{mode} (and every decode of the model the same connector)")
    blocks = params.get("remote_block_ids")
    if not blocks or not any(blocks):
        return ("it names no blocks (remote_block_ids empty): the decode would compute the "
                "prompt itself; is the request finishing normally (max_tokens 1)?")
    for field, want, flag in (("remote_engine_id", proto.engine_id, "--nixl-engine-id"),
                              ("remote_host", proto.host, "--nixl-host"),
                              ("remote_port", proto.port, "--nixl-port"),
                              ("tp_size", proto.tp_size, "--tp-size")):
        got = params.get(field)
        if want is not None and got != want:
            return (f"it answers {field} {got!r}, its record says {want!r}: restart its "
                    f"sidecar with {flag} {got} (decodes are told the record's)")
    return None


async def canary(http: aiohttp.ClientSession, model: str, prefill: InstanceRecord,
                 decode: InstanceRecord) -> CheckedLink:
    """One request through the pair, as a router sends it."""
    name = f"{prefill.instance_id} -> {decode.instance_id}: vLLM PD canary"
    rid = f"kvatlas-doctor-{uuid.uuid4().hex}"
    base = {"model": model, "prompt": CANARY_PROMPT, "max_tokens": 2, "temperature": 0.0}
    first = {**base, KV_PARAMS: dict(PREFILL_PARAMS), "stream": False,
             "max_tokens": 1}
    headers = {"X-Request-Id": rid}
    purl, durl = f"{prefill.url}/v1/completions", f"{decode.url}/v1/completions"
    if prefill.pd_protocol.mode == PUSH:
        # The router's own push params: the canary tests what it sends.
        second = {**base, KV_PARAMS: prefill.pd_protocol.push_params(f"cmpl-{rid}")}
        (ps, pdoc), (ds, ddoc) = await asyncio.gather(
            _request(http, "POST", purl, json=first, headers=headers),
            _request(http, "POST", durl, json=second, headers=headers))
    else:
        ps, pdoc = await _request(http, "POST", purl, json=first, headers=headers)
        ds, ddoc = None, None
    detail = f"X-Request-Id {rid}: prefill {ps}"
    if ps != 200 or not isinstance(pdoc, dict):
        return (name, False, f"{detail} {str(pdoc)[:200]}",
                f"the prefill {prefill.url} refused the canary: read its log")
    why = check_prefill_answer(prefill, pdoc.get(KV_PARAMS))
    if why is not None:
        return (name, False, detail, f"prefill {prefill.instance_id}: {why}")
    if ds is None:
        second = {**base, KV_PARAMS: pdoc[KV_PARAMS]}
        ds, ddoc = await _request(http, "POST", durl, json=second, headers=headers)
    detail += f", decode {ds}"
    if ds != 200:
        return (name, False, f"{detail} {str(ddoc)[:200]}",
                f"the decode {decode.url} refused what a router sends it: is it started with "
                f"--kv-transfer-config '{{\"kv_connector\": \""
                f"{CONNECTORS[str(decode.pd_protocol.mode)]}\", \"kv_role\": \"kv_consumer\"}}'"
                " and can it reach the prefill's side channel? read its log")
    return (name, True, detail + " (whether the decode read the blocks or recomputed them "
            "shows only in its log: 'Got invalid KVTransferParams')", "")


async def vllm_pd_links(instances: Iterable[InstanceRecord],
                        timeout: float) -> list[CheckedLink]:
    """The links of every model with vLLM PD instances among ``instances`` (the doctor's read
    of the records); [] when there is none."""
    by_model: dict[str, dict[str, list[InstanceRecord]]] = defaultdict(
        lambda: {PREFILL: [], DECODE: []})
    for rec in instances:
        if (rec.pd_protocol.name != VLLM or rec.role not in (PREFILL, DECODE)
                or rec.model is None or not rec.url):
            continue
        by_model[rec.model][rec.role].append(rec)
    links: list[CheckedLink] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        for model, roles in sorted(by_model.items()):
            prefills = sorted(roles[PREFILL], key=lambda r: r.instance_id)
            decodes = sorted(roles[DECODE], key=lambda r: r.instance_id)
            checked = pair_links(model, prefills, decodes)
            links += checked
            if not all(ok for _, ok, _, _ in checked):
                continue  # a canary through a pair that cannot work says nothing more
            for prefill in prefills:
                links.append(await canary(http, model, prefill, decodes[0]))
    return links

