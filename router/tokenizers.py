"""Which tokenizer the router turns each model's text and chat prompts into token ids with.

Why it matters: the block index holds hashes of the ids the engines prefill. Ids made by any
other tokenizer hash to blocks no engine ever stored, every index lookup misses, and kv_aware
would quietly route on its own predictions alone. So a model's tokenizer comes from, first
found wins:

1. ``--tokenizer MODEL=PATH`` / ``--tokenizer PATH`` (every model without its own), loaded at
   start-up: a source that cannot be loaded stops the router (``TokenizerError`` naming it);
2. the tokenizer an instance record of the model names (``tokenizer``: ``{"source",
   "fingerprint"}`` or ``"byte"``), when its source is ``"byte"``, an alias or a path this host
   can read; loaded in a thread when the record is first seen (a GGUF one takes seconds);
3. none: the model is *untokenizable*. A warning once per model, the gauge
   ``kvatlas_router_untokenizable_models{model}`` and the counter
   ``kvatlas_router_load_only_requests{model}`` say so; its text and chat prompts are routed on
   load alone (kv_aware sees no prefix), its token-id prompts still on their prefix. A record
   without a tokenizer (null, or written before the field existed) names none.

Each record's fingerprint is compared with the router's tokenizer of its model: a difference
is a warning and ``kvatlas_router_tokenizer_mismatch{instance, model, router_fingerprint,
instance_fingerprint}`` (the two would make different ids for some prompt).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

from index.record import named_tokenizer
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.requests import OFF_LOOP_BYTES, OFF_LOOP_BYTES_HF
from tokenization import BYTE, Tokenizer, TokenizerError, can_load, canonical_model, load_tokenizer

logger = logging.getLogger(__name__)

NO_MODEL = "-"
"""The ``model`` label of requests and workers that name no model."""
_MAX_NAMES = 1024


class Tokenizers:
    """Per model, the tokenizer of the router's flags or its instances' records."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics,
                 default_model: Callable[[], str | None] = lambda: None) -> None:
        self.config = config
        self.metrics = metrics
        self.default_model = default_model
        """The model a request naming none means (``RouterState.default_model``)."""
        self._flags = dict(config.tokenizers)
        self._default: Tokenizer | None = None
        """``--tokenizer PATH``: every model without its own."""
        self._per_model: dict[str | None, Tokenizer] = {}
        self._by_source: dict[str, Tokenizer] = {}
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._failed: dict[str, str] = {}
        """Record sources that failed to load here, and why (not tried again)."""
        self._records: dict[str, tuple[str | None, str | None, str | None]] = {}
        """Per instance: (model, source, fingerprint) its record names."""
        self._mismatch: dict[str, tuple[str, str, str, str]] = {}
        """Per instance: (instance, model, router fingerprint, instance fingerprint)."""
        self.mismatch_listeners: list[Callable[[str, tuple[str, str, str, str] | None],
                                               None]] = []
        """Told ``(instance, labels)`` when an instance's mismatch appears or changes, and
        ``(instance, None)`` when it ends (router/index_guards.py ignores its index entries)."""
        self._warned: set[str | None] = set()
        self._names: dict[str, str] = {}
        self._started = False
        self.off_loop_bytes = OFF_LOOP_BYTES
        """Bodies over this are parsed in a thread: lower once a real tokenizer is in use."""

    # --- the hot path -------------------------------------------------------------------------

    def canonical(self, name: str) -> str:
        got = self._names.get(name)
        if got is None:
            if len(self._names) >= _MAX_NAMES:
                self._names.clear()  # names come from clients: bounded
            got = self._names[name] = canonical_model(name)
        return got

    def get(self, model: str | None) -> Tokenizer | None:
        """The tokenizer of (canonical) ``model``, or None: none is known."""
        tok = self._per_model.get(model)
        return tok if tok is not None else self._default

    def for_request(self, named: str | None) -> tuple[str | None, Tokenizer | None]:
        """(the model a request naming ``named`` is routed as, its tokenizer or None).

        The one place a request's model is settled: the canonical name it gives (an alias
        names its model), else ``default_model`` (--model, the one model the pools serve, the
        one the index holds). Its hash namespace, index, tokenizer and prompt limit follow."""
        model = self.canonical(named) if named else self.default_model()
        return model, self.get(model)

    def note_load_only(self, model: str | None) -> None:
        """A text request routed as ``model`` (``for_request``) was routed on load alone:
        counted, warned once."""
        m = self.metrics
        m.child(m.load_only_requests, model or NO_MODEL).inc()
        self._untokenizable(model)

    # --- start-up -------------------------------------------------------------------------

    async def start(self, workers: Iterable[Any] = ()) -> None:
        """Load the flags' tokenizers (in a thread; TokenizerError stops the router), then look
        at ``workers`` (those registered so far) and warn of ``--model`` left without one."""
        for model, source in self._flags.items():
            tok = await asyncio.to_thread(self._load, source)
            self._use(model, tok, "--tokenizer")
        self._started = True
        for worker in workers:
            self.on_worker("join", worker)
        if self.config.model is not None and self.get(self.config.model) is None \
                and self.config.model not in self._pending_models():
            self._untokenizable(self.config.model)

    async def close(self) -> None:
        for task in list(self._loading.values()):
            task.cancel()
        for task in list(self._loading.values()):
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing anyway
                pass

    def _load(self, source: str) -> Tokenizer:
        tok = self._by_source.get(source)
        if tok is None:
            tok = load_tokenizer(source)
            _ = tok.fingerprint  # computed here, in the thread, not on the event loop
            self._by_source[source] = tok
        return tok

    def _use(self, model: str | None, tok: Tokenizer, origin: str) -> None:
        if model is None and origin == "--tokenizer":
            self._default = tok
        else:
            self._per_model[model] = tok
        if tok.kind != "byte":
            self.off_loop_bytes = OFF_LOOP_BYTES_HF
        m = self.metrics
        label = model or NO_MODEL
        m.tokenizer_info.labels(label, tok.name, tok.fingerprint).set(1)
        if model in self._warned or (model is None and self._warned):
            for w in [w for w in self._warned if model is None or w == model]:
                self._warned.discard(w)
                m.untokenizable_models.labels(w or NO_MODEL).set(0)
        logger.info("model %s: prompts tokenized with %s (fingerprint %s; from %s)", label,
                    tok.name, tok.fingerprint, origin)
        for iid, (rec_model, source, fp) in list(self._records.items()):
            if model is None or rec_model == model:
                self._check(iid, rec_model, source, fp)

    def _untokenizable(self, model: str | None, why: str = "") -> None:
        if model in self._warned or self.get(model) is not None:
            return
        self._warned.add(model)
        self.metrics.untokenizable_models.labels(model or NO_MODEL).set(1)
        logger.warning(
            "model %s: no tokenizer known to the router%s; its text and chat prompts are "
            "routed on load alone (no KV-aware prefix matching). Start the router with "
            "--tokenizer %sPATH, or have its engines name their tokenizer in their records",
            model or NO_MODEL, f" ({why})" if why else "", f"{model}=" if model else "")

    # --- records ------------------------------------------------------------------------------

    def on_worker(self, event: str, worker: Any) -> None:
        """A pools listener: every record (join, update) names its tokenizer or none."""
        iid = worker.instance_id
        if event == "leave":
            self._records.pop(iid, None)
            self._clear_mismatch(iid)
            return
        if event not in ("join", "record"):
            return
        model = worker.model
        if not self._started:
            return  # start() looks at every worker once the flags' tokenizers are loaded
        named = named_tokenizer(worker.record.get("tokenizer")) if worker.record else None
        if named is None or named[0] is None:
            self._records.pop(iid, None)
            self._clear_mismatch(iid)
            if self.get(model) is None and model not in self._pending_models():
                self._untokenizable(model, f"instance {iid}'s record names none"
                                    if worker.record else "")
            return
        source, fp = named
        self._records[iid] = (model, source, fp)
        if self.get(model) is not None:
            self._check(iid, model, source, fp)
            return
        if source in self._failed:
            self._untokenizable(model, self._failed[source])
            return
        if not can_load(source):
            self._untokenizable(model, f"instance {iid}'s record names {source!r}, which is "
                                       "not a path this host can read")
            return
        if source not in self._loading:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # no loop yet (a static worker has no record anyway)
            self._loading[source] = loop.create_task(self._load_for(model, source, iid),
                                                     name=f"tokenizer-{source}")

    def _pending_models(self) -> set[str | None]:
        loading = set(self._loading)
        return {m for m, s, _ in self._records.values() if s in loading}

    async def _load_for(self, model: str | None, source: str, iid: str) -> None:
        try:
            tok = await asyncio.to_thread(self._load, source)
        except (TokenizerError, OSError, ValueError) as exc:
            self._failed[source] = f"loading {source!r} failed: {exc}"
            logger.warning("tokenizer %r named by instance %s (model %s) failed to load: %s",
                           source, iid, model or NO_MODEL, exc)
            self._untokenizable(model, self._failed[source])
            return
        finally:
            self._loading.pop(source, None)
        if self.get(model) is None:
            self._use(model, tok, f"the record of instance {iid}")

    def _check(self, iid: str, model: str | None, source: str | None, fp: str | None) -> None:
        """Warn once and set the mismatch gauge when ``iid``'s record differs from ours."""
        ours = self.get(model)
        if ours is None:
            return
        if fp is None and source == BYTE:
            fp = self._load(BYTE).fingerprint
        if fp is None or fp == ours.fingerprint:
            self._clear_mismatch(iid)
            return
        labels = (iid, model or NO_MODEL, ours.fingerprint, fp)
        if self._mismatch.get(iid) == labels:
            return
        self._clear_mismatch(iid, tell=False)
        self._mismatch[iid] = labels
        self.metrics.tokenizer_mismatch.labels(*labels).set(1)
        for cb in self.mismatch_listeners:
            cb(iid, labels)
        logger.warning("instance %s (model %s) names tokenizer %s with fingerprint %s; the "
                       "router tokenizes with %s, fingerprint %s: their ids may differ, and "
                       "then no index lookup for its prompts can match", iid,
                       model or NO_MODEL, source, fp, ours.name, ours.fingerprint)

    def _clear_mismatch(self, iid: str, tell: bool = True) -> None:
        labels = self._mismatch.pop(iid, None)
        if labels is not None:
            try:
                self.metrics.tokenizer_mismatch.remove(*labels)
            except KeyError:
                pass
            if tell:
                for cb in self.mismatch_listeners:
                    cb(iid, None)

    def mismatch(self, iid: str) -> tuple[str, str, str, str] | None:
        """``iid``'s tokenizer mismatch, as the gauge labels it; None: none known."""
        return self._mismatch.get(iid)

    def describe(self, model: str | None) -> dict[str, Any] | None:
        """For /debug/route: the tokenizer of ``model``, or None."""
        tok = self.get(model)
        if tok is None:
            return None
        return {"kind": tok.kind, "source": tok.name, "fingerprint": tok.fingerprint}
