"""Edges of the worker HTTP API, alike on the monolithic, prefill and decode servers (and the
bootstrap server where it applies): a JSON body not in UTF-8 gets the router's exact 400, ``n`` >
1 is refused rather than answered with one sample, ``HEAD /health`` answers as ``GET``, and the
limits a router must respect (prompt tokens, body bytes) are published in /server_info and
/model_info and enforced as 4xx naming them."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from error_shapes import error_message
from pd_helpers import Pair, pd_body, start_pair

from bootstrap.config import BootstrapConfig
from bootstrap.http_limits import make_runner
from bootstrap.server import create_app as create_bootstrap_app
from engine.serve_config import EngineServerConfig
from engine.server import create_app
from kvatlas.etcd_proc import free_port

pytestmark = pytest.mark.timeout(90)
NOT_UTF8 = "body: is not UTF-8; send JSON encoded as UTF-8 (RFC 8259)"
PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


@pytest.fixture
async def urls() -> AsyncIterator[dict[str, str]]:
    """Base URLs of a monolithic server and of both halves of a PD pair."""
    mono = web.AppRunner(create_app(EngineServerConfig()))
    await mono.setup()
    port = free_port()
    await web.TCPSite(mono, "127.0.0.1", port).start()
    pair: Pair = await start_pair()
    try:
        yield {"monolithic": f"http://127.0.0.1:{port}", "prefill": pair.p_url,
               "decode": pair.d_url, "bport": str(pair.bport)}
    finally:
        await pair.decode.close()
        await pair.prefill.close()
        await mono.cleanup()


def bodies(bport: int) -> dict[str, dict[str, Any]]:
    """A valid body per path, PD bootstrap fields included (a monolithic server ignores them)."""
    pd = pd_body([256, *b"hello"], 2, bport)
    boot = {k: pd[k] for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")}
    return {"/generate": {"text": "hello", "sampling_params": {"max_new_tokens": 2}, **boot},
            "/v1/completions": {"prompt": "hello", "max_tokens": 2, **boot},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello"}],
                                     "max_tokens": 2, **boot}}


def encodings(doc: dict[str, Any]) -> dict[str, bytes]:
    text = json.dumps(doc)
    return {"utf-16": text.encode("utf-16"), "utf-16-le": text.encode("utf-16-le"),
            "utf-16-be": text.encode("utf-16-be"), "utf-32": text.encode("utf-32"),
            "utf-32-be": text.encode("utf-32-be"), "latin-1": text.replace(
                "hello", "h\u00e9llo").encode("latin-1")}


async def test_a_body_not_in_utf8_is_the_routers_400(urls: dict[str, str]) -> None:
    async with aiohttp.ClientSession() as s:
        for mode in ("monolithic", "prefill", "decode"):
            for path, doc in bodies(int(urls["bport"])).items():
                for name, raw in encodings(doc).items():
                    async with s.post(urls[mode] + path, data=raw,
                                      headers={"Content-Type": "application/json"}) as r:
                        got = (r.status, error_message(path, await r.json()))
                    assert got == (400, NOT_UTF8), (mode, path, name, got)


async def test_n_above_one_is_refused(urls: dict[str, str]) -> None:
    async with aiohttp.ClientSession() as s:
        for mode in ("monolithic", "prefill", "decode"):
            for path, doc in bodies(int(urls["bport"])).items():
                if path == "/generate":
                    body, field = {**doc, "sampling_params": {"max_new_tokens": 2, "n": 2}}, \
                        "sampling_params.n"
                else:
                    body, field = {**doc, "n": 3}, "n"
                async with s.post(urls[mode] + path, json=body) as r:
                    status, err = r.status, error_message(path, await r.json())
                assert status == 400 and err.startswith(f"{field}: only n = 1 is supported"), \
                    (mode, path, status, err)


async def test_head_health_answers_as_get(urls: dict[str, str]) -> None:
    boot = create_bootstrap_app(BootstrapConfig(instance_id="edges", model="tiny"))
    runner = make_runner(boot)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    targets = [urls["monolithic"], urls["prefill"], urls["decode"], f"http://127.0.0.1:{port}"]
    try:
        async with aiohttp.ClientSession() as s:
            for base in targets:
                for path in ("/health", "/liveness", "/readiness"):
                    if base.endswith(str(port)) and path != "/health":
                        continue  # the bootstrap server has /health only (as SGLang's)
                    async with s.get(base + path) as g, s.head(base + path) as h:
                        assert (h.status, h.content_type) == (g.status, g.content_type), base
                        assert g.status == 200 and await h.read() == b""
    finally:
        await runner.cleanup()


async def test_the_limits_are_published_and_enforced(urls: dict[str, str]) -> None:
    bport = int(urls["bport"])
    async with aiohttp.ClientSession() as s:
        for mode in ("monolithic", "prefill", "decode"):
            async with s.get(urls[mode] + "/server_info") as r:
                info = await r.json()
            async with s.get(urls[mode] + "/model_info") as r:
                model = await r.json()
            assert info["max_prompt_tokens"] == model["max_prompt_tokens"] == 2047, mode
            assert info["context_length"] == model["max_context_length"] == 2048
            assert info["max_body_bytes"] == model["max_body_bytes"] == 8 << 20
            too_long = [256] * 2048
            docs = {"/generate": {**pd_body(too_long, 1, bport)},
                    "/v1/completions": {**bodies(bport)["/v1/completions"],
                                        "prompt": too_long},
                    "/v1/chat/completions": {**bodies(bport)["/v1/chat/completions"],
                                             "messages": [{"role": "user",
                                                           "content": "x" * 2100}]}}
            docs["/generate-text"] = {**bodies(bport)["/generate"], "text": "y" * 2047}
            for path, body in docs.items():
                async with s.post(urls[mode] + path.removesuffix("-text"), json=body) as r:
                    status, err = r.status, error_message(path, await r.json())
                assert status == 400 and "at most 2047" in err, (mode, path, status, err)
            big = json.dumps({"text": "z" * (info["max_body_bytes"] + 1)})
            async with s.post(urls[mode] + "/generate", data=big) as r:
                status, err = r.status, (await r.json())["error"]
            assert status == 413 and str(info["max_body_bytes"]) in err, (mode, status, err)
