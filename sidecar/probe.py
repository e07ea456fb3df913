"""The engine's own HTTP answers the sidecar relies on: ``/health`` and its server info."""
from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)

INFO_PATHS = ("/get_server_info", "/server_info")
"""SGLang's (older and newer) names of the server-arguments document; kvatlas serves both."""


class EngineProbe:
    """Asks one engine; never raises on the engine's trouble, says what went wrong instead."""

    def __init__(self, url: str, timeout: float, info_timeout: float = 5.0) -> None:
        self.url = url
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
        for path in INFO_PATHS:
            try:
                async with self.session.get(
                        f"{self.url}{path}",
                        timeout=aiohttp.ClientTimeout(total=self.info_timeout)) as resp:
                    if resp.status != 200:
                        continue
                    doc = json.loads(await resp.text())
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                logger.debug("engine %s%s: %s", self.url, path, exc)
                continue
            if isinstance(doc, dict):
                return doc
        return {}
