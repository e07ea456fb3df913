"""``kvatlas generate --prompt TEXT [--stream]``: generate through the router."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import aiohttp

from kvatlas.commands.route import add_router_args, router_url


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("generate", help="generate text through the router")
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    parser.add_argument("--json", action="store_true", help="print the router's JSON answer")
    add_router_args(parser)
    parser.set_defaults(func=cmd_generate)


async def _generate(url: str, args: argparse.Namespace) -> int:
    from kvatlas.cli import CLIError
    body = {"text": args.prompt, "stream": args.stream,
            "sampling_params": {"max_new_tokens": args.max_new_tokens,
                                "temperature": args.temperature}}
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(f"{url}/generate", json=body) as resp:
            rid = resp.headers.get("x-request-id", "")
            if resp.status != 200:
                text = await resp.text()
                try:
                    text = json.loads(text).get("error", text)
                except (ValueError, AttributeError):
                    pass
                raise CLIError(f"router answered {resp.status}: {text} (request {rid})")
            if not args.stream:
                answer = await resp.json(content_type=None)
                print(json.dumps(answer, indent=2) if args.json else answer.get("text", answer))
                return 0
            printed = ""
            async for raw in resp.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    continue
                if args.json:
                    print(data)
                    continue
                text = event.get("text", "")
                # SGLang streams the cumulative text; print only what is new.
                delta = text[len(printed):] if text.startswith(printed) else text
                printed = text if text.startswith(printed) else printed + text
                sys.stdout.write(delta)
                sys.stdout.flush()
            if not args.json:
                print()
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from kvatlas.cli import CLIError
    url = router_url(args)
    try:
        return asyncio.run(_generate(url, args))
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise CLIError(f"router at {url} not reachable: {exc!r}") from None
