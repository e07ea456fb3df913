"""A stand-in for ``vllm serve`` in the tests: vLLM's HTTP API and its KV-event publisher.

``python tests/vllm_stub.py --port P --events-port E --model M --block-size 16`` serves
``/health``, ``/v1/models`` (``max_model_len``, LoRA adapters with a ``parent``),
``/v1/completions`` and ``/v1/chat/completions`` (non-streamed, and SSE with ``stream: true``)
and ``/metrics`` (the ``vllm:*`` gauges and counters). Every prompt served is tokenized with the
project's tokenization package, and its new full blocks are published as vLLM publishes them:
one ``BlockStored`` per request covering its consecutive uncached full blocks (``token_ids`` of all
of them, ``block_size`` per block, ``parent_block_hash`` the engine hash of the block before),
in a ``KVEventBatch(ts, events, data_parallel_rank)`` on a ZMQ PUB bound at ``tcp://*:E`` as
vLLM's is for ``"endpoint": "tcp://*:E"``; frames ``[topic, seq (8 bytes big-endian), msgpack]``.
``--encoding array`` is msgspec's ``array_like=True, omit_defaults=True, tag=True`` (older
vLLM: ``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium]``); ``map`` is
vLLM 0.33's (every field named, ``lora_name`` nil). Engine hashes are the stub's own (SHA-256
low 64 bits, unsigned), never kvatlas's: a consumer must recompute its keys from token ids.

``--no-kv-events``: no publisher at all (vLLM without ``--kv-events-config``);
``--no-prefix-caching``: a publisher that never publishes (no prefix cache, no BlockStored).
With ``--replay-port R`` a ROUTER answers ``[b"", start_seq]`` with every kept batch, then
the end marker. Generation is fake: it echoes up to ``max_tokens`` characters of the prompt.

PD roles (vLLM's NixlConnector contract, ``kv_transfer_params``; no KV moves):
``--kv-role producer`` (a ``kv_producer`` prefill): a request whose ``kv_transfer_params`` has
``do_remote_decode`` gets 1 token and a top-level ``kv_transfer_params`` of vLLM 0.33's shape
(``nixl/pull_scheduler.py`` ``request_finished``; ``--kv-mode push``: ``push_scheduler.py``'s,
without expiry and registration generation), its ``remote_block_ids`` the stub cache's ids of the
prompt's blocks, ``remote_engine_id``/``remote_host``/``remote_port`` from ``--engine-id``,
``--side-channel-host``/``--side-channel-port``. ``--kv-role consumer`` (a ``kv_consumer``
decode): a push request lacking ``remote_engine_id``/``remote_host``/``remote_port``/``tp_size``
is refused (400, where vLLM's ``params[...]`` raises KeyError); pull params lacking block ids
or the producer's coordinates make it "recompute" (vLLM's silent fallback), which it records.
Either role's engine request id is vLLM's: ``cmpl-<X-Request-Id>-<8 hex>`` (``chatcmpl-`` for
chat). ``GET /debug/requests`` lists what it got (the last 10000): path, ``x_request_id``,
``request_id``, the body, ``recomputed``.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import secrets
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenization import load_tokenizer  # noqa: E402

logger = logging.getLogger(__name__)

END = b"\xff" * 8


def producer_params(*, mode: str, engine_id: str, request_id: str, host: str, port: int,
                    tp_size: int, block_ids: list[int], n_tokens: int) -> dict[str, Any]:
    """What vLLM 0.33's connector answers from ``request_finished`` on a prefill asked
    ``do_remote_decode`` (``nixl/pull_scheduler.py``; push: ``push_scheduler.py``'s, without
    expiry and registration generation), for every stand-in for vLLM (this stub, the router
    tests' stubs, the router bench's). Written apart from kvatlas's engine on purpose: a
    stand-in for vLLM must not share kvatlas's reading of vLLM."""
    params: dict[str, Any] = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [block_ids],
        "remote_engine_id": engine_id, "remote_request_id": request_id, "remote_host": host,
        "remote_port": port, "tp_size": tp_size, "dcp_size": 1, "pp_size": 1,
        "remote_num_tokens": n_tokens}
    if mode == "pull":
        params["remote_blocks_expiry_time"] = None
        params["remote_registration_generation"] = 0
    params["transfer_mode"] = mode
    return params


class VllmStub:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tok = load_tokenizer(args.tokenizer)
        self.cached: set[int] = set()
        self.seq = 0
        self.kept: list[tuple[int, bytes]] = []
        self.prompt_tokens = 0
        self.queries = 0
        self.hits = 0
        self.requests = 0
        self.block_ids: dict[int, int] = {}
        """Engine hash -> the stub cache's block id (what a producer's params name)."""
        self.received: deque[dict[str, Any]] = deque(maxlen=10000)
        self.ctx = zmq.asyncio.Context()
        self.pub: zmq.asyncio.Socket | None = None
        self.router: zmq.asyncio.Socket | None = None

    # --- KV events ---------------------------------------------------------------------------

    def engine_hash(self, parent: int | None, tokens: list[int]) -> int:
        data = json.dumps([parent, tokens, self.args.model]).encode()
        return int.from_bytes(hashlib.sha256(data).digest()[-8:], "big")

    def store(self, ids: list[int]) -> list[int]:
        """Cache the prompt's full blocks; publish the new ones as one BlockStored; the
        engine hashes of all of them."""
        bs = self.args.block_size
        parent: int | None = None
        start_parent: int | None = None
        first_new: int | None = None
        hashes: list[int] = []
        every: list[int] = []
        for i in range(len(ids) // bs):
            h = self.engine_hash(parent, ids[i * bs:(i + 1) * bs])
            every.append(h)
            self.queries += bs
            if h in self.cached and first_new is None:
                self.hits += bs
                parent = h
                continue
            if first_new is None:
                first_new = i
                start_parent = parent
            hashes.append(h)
            parent = h
        if first_new is None or not self.args.prefix_caching:
            return every
        self.cached.update(hashes)
        tokens = ids[first_new * bs:(first_new + len(hashes)) * bs]
        if self.args.encoding == "map":
            event: Any = {"type": "BlockStored", "block_hashes": hashes,
                          "parent_block_hash": start_parent, "token_ids": tokens,
                          "block_size": bs, "lora_id": None, "medium": "GPU", "lora_name": None}
        else:
            event = ["BlockStored", hashes, start_parent, tokens, bs, None, "GPU"]
        self.publish([time.time(), [event], None])
        return every

    # --- PD (kv_transfer_params) ---------------------------------------------------------------

    def producer_params(self, hashes: list[int], engine_rid: str, n_tokens: int
                        ) -> dict[str, Any]:
        """This prefill's answer to ``do_remote_decode`` (``producer_params``)."""
        a = self.args
        blocks = [self.block_ids.setdefault(h, len(self.block_ids) + 1) for h in hashes]
        return producer_params(mode=a.kv_mode, engine_id=a.engine_id or f"stub-{a.port}",
                               request_id=engine_rid, host=a.side_channel_host,
                               port=a.side_channel_port, tp_size=a.tp_size, block_ids=blocks,
                               n_tokens=n_tokens)

    def consumer_check(self, params: dict[str, Any]) -> tuple[str | None, bool]:
        """(why a decode refuses the params, whether it computes the prompt itself)."""
        if self.args.kv_mode == "push":
            missing = [k for k in ("remote_engine_id", "remote_host", "remote_port", "tp_size")
                       if k not in params]
            if missing:
                return f"KeyError: {missing[0]!r} (push mode needs {missing})", False
            return None, False
        needed = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
        blocks = params.get("remote_block_ids")
        return None, not blocks or any(params.get(k) is None for k in needed)

    async def debug_requests(self, _: web.Request) -> web.Response:
        return web.json_response({"requests": list(self.received)})

    def publish(self, batch: list[Any]) -> None:
        if self.pub is None:
            return
        payload = msgpack.packb(batch, use_bin_type=True)
        seq = self.seq
        self.seq += 1
        self.kept.append((seq, payload))
        self.pub.send_multipart([self.args.topic.encode(), seq.to_bytes(8, "big"), payload])

    async def serve_replay(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3:
                continue
            start = int.from_bytes(frames[2], "big")
            for seq, payload in self.kept:
                if seq >= start:
                    await self.router.send_multipart([frames[0], b"", self.args.topic.encode(),
                                                      seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([frames[0], b"", b"", END, b""])

    # --- HTTP ----------------------------------------------------------------------------------

    def prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise web.HTTPBadRequest(text=json.dumps({"error": "messages required"}),
                                         content_type="application/json")
            return list(self.tok.encode_chat(messages))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if not isinstance(prompt, str):
            raise web.HTTPBadRequest(text=json.dumps({"error": "prompt required"}),
                                     content_type="application/json")
        return list(self.tok.encode(prompt))

    async def generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "body is not JSON"}, status=400)
        if body.get("model") not in (None, self.args.model, *self.args.lora):
            return web.json_response({"error": f"model {body.get('model')!r} not served"},
                                     status=404)
        ids = self.prompt_ids(body, chat)
        if len(ids) > self.args.max_model_len:
            return web.json_response({"error": "prompt longer than max_model_len"}, status=400)
        x_rid = request.headers.get("X-Request-Id")
        rid = (f"{'chatcmpl' if chat else 'cmpl'}-{x_rid or secrets.token_hex(16)}"
               f"-{secrets.token_hex(4)}")
        params = body.get("kv_transfer_params")
        params = params if isinstance(params, dict) else None
        role = self.args.kv_role
        seen: dict[str, Any] = {"path": request.path, "x_request_id": x_rid, "request_id": rid,
                                "body": body, "recomputed": False}
        self.received.append(seen)
        if role == "consumer" and params is not None and params.get("do_remote_prefill"):
            refused, seen["recomputed"] = self.consumer_check(params)
            if refused is not None:
                seen["refused"] = refused
                return web.json_response({"error": refused}, status=400)
        self.requests += 1
        self.prompt_tokens += len(ids)
        hashes = self.store(ids)
        n = int(body.get("max_tokens") or 4)
        answer_params = None
        if role == "producer" and params is not None and params.get("do_remote_decode"):
            n = 1
            answer_params = self.producer_params(hashes, rid, len(ids))
        text = self.tok.decode(ids)[:n]
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": "length"}
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length"}
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(text),
                 "total_tokens": len(ids) + len(text)}
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            return web.json_response({"id": rid, "object": obj, "model": self.args.model,
                                      "choices": [choice], "usage": usage,
                                      "kv_transfer_params": answer_params})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, ch in enumerate(text):
            delta: dict[str, Any] = ({"index": 0, "delta": {"content": ch}} if chat
                                     else {"index": 0, "text": ch})
            chunk = {"id": rid, "object": obj + ".chunk", "model": self.args.model,
                     "choices": [delta]}
            if i == len(text) - 1:
                # vLLM: the params ride on the chunk with the finish reason only.
                delta["finish_reason"] = "length"
                chunk["kv_transfer_params"] = answer_params
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(self, _: web.Request) -> web.Response:
        base = {"id": self.args.model, "object": "model", "owned_by": "vllm",
                "root": self.args.model, "parent": None, "max_model_len": self.args.max_model_len}
        loras = [{"id": name, "object": "model", "owned_by": "vllm", "root": f"/loras/{name}",
                  "parent": self.args.model, "max_model_len": self.args.max_model_len}
                 for name in self.args.lora]
        return web.json_response({"object": "list", "data": [base, *loras]})

    async def metrics(self, _: web.Request) -> web.Response:
        labels = f'{{model_name="{self.args.model}",engine="0"}}'
        lines = [f"vllm:num_requests_running{labels} 0.0",
                 f"vllm:num_requests_waiting{labels} 0.0",
                 f"vllm:kv_cache_usage_perc{labels} {min(1.0, len(self.cached) / 1024):.4f}",
                 f"vllm:prompt_tokens_total{labels} {float(self.prompt_tokens)}",
                 f"vllm:request_success_total{labels} {float(self.requests)}",
                 f"vllm:prefix_cache_queries_total{labels} "
                 f"{float(self.queries if self.args.prefix_caching else 0)}",
                 f"vllm:prefix_cache_hits_total{labels} {float(self.hits)}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    async def start(self) -> web.AppRunner:
        a = self.args
        if a.kv_events:
            self.pub = self.ctx.socket(zmq.PUB)
            self.pub.bind(f"tcp://*:{a.events_port}")
            if a.replay_port:
                self.router = self.ctx.socket(zmq.ROUTER)
                self.router.bind(f"tcp://*:{a.replay_port}")
                asyncio.get_running_loop().create_task(self.serve_replay())
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/debug/requests", self.debug_requests)
        app.router.add_post("/v1/completions", lambda r: self.generate(r, False))
        app.router.add_post("/v1/chat/completions", lambda r: self.generate(r, True))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, a.host, a.port).start()
        return runner


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--events-port", type=int, default=5557)
    p.add_argument("--replay-port", type=int, default=None)
    p.add_argument("--topic", default="kv-events")
    p.add_argument("--model", required=True)
    p.add_argument("--tokenizer", default="byte")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--encoding", choices=("array", "map"), default="array")
    p.add_argument("--lora", action="append", default=[], help="a served LoRA adapter's name")
    p.add_argument("--kv-role", choices=("producer", "consumer"), default=None,
                   help="a PD half (vLLM's kv_producer / kv_consumer); default: aggregated")
    p.add_argument("--kv-mode", choices=("pull", "push"), default="pull",
                   help="NixlConnector (pull) or NixlPushConnector (push)")
    p.add_argument("--engine-id", default=None,
                   help="producer: kv_transfer_config engine_id (default stub-PORT)")
    p.add_argument("--side-channel-host", default="127.0.0.1")
    p.add_argument("--side-channel-port", type=int, default=5600)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--no-kv-events", dest="kv_events", action="store_false")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    return p.parse_args(argv)


async def main() -> None:
    stub = VllmStub(parse_args())
    runner = await stub.start()
    print(f"vllm stub on {stub.args.host}:{stub.args.port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main())
