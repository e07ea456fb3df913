"""The engine's own HTTP answers the sidecar relies on: ``/health`` and its server info (SGLang's
``/get_server_info``; vLLM's ``/v1/models``, turned into the same fields)."""
from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp

from tokenization import can_load

logger = logging.getLogger(__name__)

INFO_PATHS = ("/get_server_info", "/server_info")
"""SGLang's (older and newer) names of the server-arguments document; kvatlas serves both."""


class EngineProbe:
    """Asks one engine; never raises on the engine's trouble, says what went wrong instead."""

    def __init__(self, url: str, timeout: float, info_timeout: float = 5.0,
                 engine: str = "sglang", model: str | None = None) -> None:
        self.url = url
        self.engine = engine
        self.model = model
        """The model the sidecar registers (vLLM: which ``/v1/models`` entry to read)."""
        self.timeout = timeout
        self.info_timeout = info_timeout
        """SGLang's server info asks its scheduler: slower under load than ``/health``."""
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # No pooling: each check is its own connection, so a restarted engine is never judged
        # by a kept-alive connection to the process that died.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True),
            timeout=aiohttp.ClientTimeout(total=self.timeout))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "start() first"
        return self._session

    async def health(self) -> str | None:
        """None when ``GET /health`` answers 200, else why not (for the log and the record)."""
        try:
            async with self.session.get(f"{self.url}/health") as resp:
                if resp.status == 200:
                    return None
                return f"GET /health answered {resp.status}"
        except TimeoutError:
            return f"GET /health got no answer within {self.timeout:g} s"
        except aiohttp.ClientError as exc:
            return f"GET /health failed ({type(exc).__name__}: {exc})"

    async def server_info(self) -> dict[str, Any]:
        """The engine's server arguments (page size, tokenizer, engine kind); {} when it serves
        none (not an error: the record then says less)."""
        if self.engine == "vllm":
            doc = await self._get_json("/v1/models")
            return vllm_info(doc, self.model) if doc is not None else {}
        for path in INFO_PATHS:
            doc = await self._get_json(path)
            if isinstance(doc, dict):
                return doc
        return {}

    async def _get_json(self, path: str) -> Any:
        """The JSON ``GET path`` answers with 200; None otherwise (logged at debug)."""
        try:
            async with self.session.get(
                    f"{self.url}{path}",
                    timeout=aiohttp.ClientTimeout(total=self.info_timeout)) as resp:
                if resp.status != 200:
                    return None
                return json.loads(await resp.text())
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            logger.debug("engine %s%s: %s", self.url, path, exc)
            return None


def vllm_info(doc: Any, model: str | None) -> dict[str, Any]:
    """vLLM's ``/v1/models`` as the server-info fields the record reads: ``engine``, the
    context length and prompt limit (``max_model_len``), ``served_model`` (the entry's id: what
    requests must name), ``tokenizer_path`` (the model id or its root when the tokenization
    package can load it, as SGLang's server info names its tokenizer) and ``lora_adapters``
    (entries with a parent: their blocks hash in another namespace)."""
    data = doc.get("data") if isinstance(doc, dict) else None
    entries = [e for e in data if isinstance(e, dict) and isinstance(e.get("id"), str)] \
        if isinstance(data, list) else []
    bases = [e for e in entries if not e.get("parent")]
    entry = next((e for e in bases if e["id"] == model), bases[0] if bases else None)
    info: dict[str, Any] = {"engine": "vllm",
                            "lora_adapters": sorted(e["id"] for e in entries if e.get("parent"))}
    if entry is None:
        return info
    info["served_model"] = entry["id"]
    limit = entry.get("max_model_len")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        info["context_length"] = info["max_prompt_tokens"] = limit
    for source in (entry["id"], entry.get("root")):
        if isinstance(source, str) and source and can_load(source):
            info["tokenizer_path"] = source
            break
    return info
