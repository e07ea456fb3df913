"""``kvatlas generate (--prompt TEXT | --chat FILE | --message ROLE=TEXT...) [--stream]``: generate
through the router.

A text prompt goes to ``/generate`` (``text``), chat messages to ``/v1/chat/completions``: the
router and the engines tokenize them with the model's tokenizer and chat template, as for any
client. With ``--tokenizer`` the command encodes the prompt here instead and sends the ids to
``/generate`` (``input_ids``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import aiohttp

from kvatlas.commands._prompt import add_prompt_args
from kvatlas.commands.route import (
    SEND_IDS_HELP,
    add_router_args,
    error_message,
    prompt_body,
    router_url,
    unreachable,
)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("generate", help="generate text through the router")
    add_prompt_args(parser, tokenizer_help=SEND_IDS_HELP)
    parser.add_argument("--model", default=None, help="model name (default: the router's)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    parser.add_argument("--json", action="store_true", help="print the router's JSON answer")
    add_router_args(parser)
    parser.set_defaults(func=cmd_generate)


def request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """(path, body) of the request for ``args``."""
    prompt = prompt_body(args)
    if "messages" in prompt:
        body: dict[str, Any] = {**prompt, "max_tokens": args.max_new_tokens,
                                "temperature": args.temperature, "stream": args.stream}
        path = "/v1/chat/completions"
    else:
        body = {**prompt, "stream": args.stream,
                "sampling_params": {"max_new_tokens": args.max_new_tokens,
                                    "temperature": args.temperature}}
        path = "/generate"
    if args.model:
        body["model"] = args.model
    return path, body


def answer_text(path: str, answer: Any) -> str:
    """The generated text of a non-streamed answer."""
    if not isinstance(answer, dict):
        return str(answer)
    if path == "/generate":
        return str(answer.get("text", answer))
    try:
        return str(answer["choices"][0]["message"]["content"])
    except (KeyError, IndexError, TypeError):
        return json.dumps(answer)


def event_text(path: str, event: Any, printed: str) -> tuple[str, str]:
    """(new text, all text so far) of one streamed event: ``/generate`` streams the cumulative
    text (SGLang's shape), chat completions stream deltas."""
    if not isinstance(event, dict):
        return "", printed
    if path != "/generate":
        try:
            delta = event["choices"][0]["delta"].get("content") or ""
        except (KeyError, IndexError, TypeError, AttributeError):
            delta = ""
        return delta, printed + delta
    text = str(event.get("text", ""))
    if text.startswith(printed):
        return text[len(printed):], text
    return text, printed + text


async def _generate(url: str, path: str, body: dict[str, Any], args: argparse.Namespace) -> int:
    from kvatlas.cli import CLIError
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(f"{url}{path}", json=body) as resp:
            rid = resp.headers.get("x-request-id", "")
            if resp.status != 200:
                text = await resp.text()
                try:
                    text = error_message(json.loads(text))
                except ValueError:
                    pass
                raise CLIError(f"router answered {resp.status}: {text} (request {rid})")
            if not args.stream:
                answer = await resp.json(content_type=None)
                print(json.dumps(answer, indent=2) if args.json else answer_text(path, answer))
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
                delta, printed = event_text(path, event, printed)
                sys.stdout.write(delta)
                sys.stdout.flush()
            if not args.json:
                print()
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    path, body = request(args)
    url = router_url(args)
    try:
        return asyncio.run(_generate(url, path, body, args))
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise unreachable(url, exc, args.timeout) from None
