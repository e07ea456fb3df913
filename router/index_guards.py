"""Index guards: the block index entries of an instance that hashes otherwise are not used.

An instance's index entries are block hashes of the token ids it prefilled, in its block size
and hash namespace. When one of the three differs from the router's for that model, the
router's hash of the same prompt is another number: block size or namespace differ, and no
entry can ever match (kv_aware quietly routes that instance on load); the tokenizer differs,
and entries can match a few leading blocks by accident (BOS and a shared template) and pull
requests towards an instance that holds none of their prompt. Either way the operator would
see "KV-aware routing does not help" and nothing saying why. So an etcd instance whose record
says so is *ignored*: its index entries are filtered out of every lookup (it is still chosen on
load), one WARNING per (instance, field, values) names both values and what to change, and
``kvatlas_router_index_ignored{instance, model, field, router_value, instance_value}`` is 1
while it holds (removed when the instance leaves or fixes it).

The fields (the router's value first):

- ``block_size``: ``--block-size`` vs the record's ``block_size`` (null: unknown, not judged);
- ``hash_namespace``: the router hashes with the base seed only (``index.hashing.BASE_SEED``),
  a record's non-null namespace with a ``lora_name`` or ``cache_salt`` seeds another one;
- ``tokenizer``: the fingerprints of the router's tokenizer of the model and the record's, as
  ``router/tokenizers.py`` compares them (its ``mismatch_listeners`` tell this module).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from index.hashing import BASE_SEED, namespace_seed
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.tokenizers import NO_MODEL
from router.workers import ETCD, Worker

logger = logging.getLogger(__name__)

M = TypeVar("M")
"""What a lookup answers per instance (a block count or a ``TierMatch``)."""

BLOCK_SIZE, HASH_NAMESPACE, TOKENIZER = "block_size", "hash_namespace", "tokenizer"
FIELDS = (BLOCK_SIZE, HASH_NAMESPACE, TOKENIZER)
ROUTER_NAMESPACE = f"base (seed {BASE_SEED})"
"""The router's hash namespace, as the guards write it."""
_MAX_WARNED = 4096

_FIX = {
    BLOCK_SIZE: "start its engine with page size {router} (the index block size), or route "
                "it with a router started with --block-size {instance}",
    HASH_NAMESPACE: "the router hashes base-model prompts only: serve the base model on this "
                    "instance (no LoRA adapter or cache salt in its record), or leave it out of "
                    "this router's pools",
    TOKENIZER: "start the router with --tokenizer MODEL=PATH of the tokenizer the engine "
               "prefills with, or make the engine's record name the router's one",
}


@dataclass(frozen=True)
class Mismatch:
    """One field in which an instance differs from the router."""

    field: str
    router: str
    """The router's value, as text."""
    instance: str
    """The instance's value, as text."""

    def describe(self) -> dict[str, str]:
        return {"field": self.field, "router": self.router, "instance": self.instance}


def describe_namespace(lora_name: str | None, cache_salt: str | None) -> str:
    """A record's namespace as text (``lora_name=x,cache_salt=y (seed N)``)."""
    parts = [f"{k}={v}" for k, v in (("lora_name", lora_name), ("cache_salt", cache_salt))
             if v is not None]
    return f"{','.join(parts) or 'base'} (seed {namespace_seed(lora_name, cache_salt)})"


def record_mismatches(record: Mapping[str, Any], block_size: int) -> dict[str, Mismatch]:
    """The block size and namespace mismatches of a record (``InstanceRecord.to_dict()``
    form) against a router hashing ``block_size``-token blocks with the base seed."""
    found: dict[str, Mismatch] = {}
    size = record.get("block_size")
    if isinstance(size, int) and size != block_size:
        found[BLOCK_SIZE] = Mismatch(BLOCK_SIZE, str(block_size), str(size))
    ns = record.get("hash_namespace")
    if isinstance(ns, Mapping):
        lora, salt = ns.get("lora_name"), ns.get("cache_salt")
        # {lora_name: null, cache_salt: null} is the base namespace written out: no mismatch.
        if namespace_seed(lora, salt) != BASE_SEED:
            found[HASH_NAMESPACE] = Mismatch(HASH_NAMESPACE, ROUTER_NAMESPACE,
                                             describe_namespace(lora, salt))
    return found


class IndexGuards:
    """Which instances' index entries the router ignores, and why. A pools listener
    (``on_worker``) and a tokenizers mismatch listener (``on_tokenizer``)."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self._found: dict[str, dict[str, Mismatch]] = {}
        """Per ignored instance, its mismatches by field (never an empty dict)."""
        self._models: dict[str, str] = {}
        """Per ignored instance, the ``model`` label its gauges carry."""
        self._warned: set[tuple[str, Mismatch]] = set()
        self.ignored: frozenset[str] = frozenset()
        """The ignored instance ids: read on every routed request, replaced whole."""

    # --- the hot path -------------------------------------------------------------------------

    def filter(self, matches: dict[str, M]) -> dict[str, M]:
        """``matches`` (an index lookup) without the ignored instances."""
        ignored = self.ignored
        if not ignored or not matches:
            return matches
        return {iid: n for iid, n in matches.items() if iid not in ignored}

    def is_ignored(self, instance_id: str) -> bool:
        return instance_id in self.ignored

    def mismatches(self, instance_id: str) -> list[Mismatch]:
        """Why ``instance_id``'s entries are ignored (empty: they are used)."""
        return [m for f in FIELDS if (m := self._found.get(instance_id, {}).get(f))]

    # --- listeners ----------------------------------------------------------------------------

    def on_worker(self, event: str, worker: Worker) -> None:
        """Pools listener: judge each etcd record as it comes (a static worker states
        nothing to judge), forget an instance that leaves."""
        iid = worker.instance_id
        if event == "leave":
            self._update(iid, self._models.get(iid, NO_MODEL), {})
            return
        if event not in ("join", "record", "moved") or worker.source != ETCD:
            return
        found = record_mismatches(worker.record, self.config.block_size)
        # The tokenizer is judged by router/tokenizers.py, which tells on_tokenizer.
        tok = self._found.get(iid, {}).get(TOKENIZER)
        if tok is not None:
            found[TOKENIZER] = tok
        self._update(iid, worker.model or NO_MODEL, found)

    def on_tokenizer(self, instance_id: str, labels: tuple[str, str, str, str] | None) -> None:
        """Tokenizers' mismatch listener: ``labels`` is (instance, model, router fingerprint,
        instance fingerprint), None once the fingerprints agree or the instance left."""
        found = dict(self._found.get(instance_id, {}))
        model = self._models.get(instance_id, NO_MODEL)
        if labels is None:
            if found.pop(TOKENIZER, None) is None:
                return
        else:
            model = labels[1]
            found[TOKENIZER] = Mismatch(TOKENIZER, labels[2], labels[3])
        self._update(instance_id, model, found)

    # --- bookkeeping --------------------------------------------------------------------------

    def _update(self, iid: str, model: str, found: dict[str, Mismatch]) -> None:
        old = self._found.get(iid, {})
        old_model = self._models.get(iid, model)
        if found == old and model == old_model:
            return  # the usual case: a record written again, judged the same
        gauge = self.metrics.index_ignored
        for f, m in old.items():
            if found.get(f) != m or model != old_model:
                try:
                    gauge.remove(iid, old_model, f, m.router, m.instance)
                except KeyError:
                    pass
        for f, m in found.items():
            if old.get(f) != m or model != old_model:
                gauge.labels(iid, model, f, m.router, m.instance).set(1)
                self._warn(iid, model, m)
        if found:
            self._found[iid], self._models[iid] = found, model
        else:
            self._found.pop(iid, None)
            self._models.pop(iid, None)
        ignored = frozenset(self._found)
        if iid in self.ignored and iid not in ignored:
            logger.info("instance %s (model %s): its block index entries are used again", iid,
                        model)
        self.ignored = ignored

    def _warn(self, iid: str, model: str, m: Mismatch) -> None:
        key = (iid, m)
        if key in self._warned:
            return
        if len(self._warned) >= _MAX_WARNED:
            self._warned.clear()  # instance ids come and go: bounded
        self._warned.add(key)
        logger.warning("instance %s (model %s): %s is %s, the router's is %s; its block index "
                       "entries are ignored (it is still chosen on load). To fix: %s", iid,
                       model, m.field, m.instance, m.router,
                       _FIX[m.field].format(router=m.router, instance=m.instance))
