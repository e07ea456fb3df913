"""Chat messages checked as OpenAI's chat completions API checks them, in one place: the router,
the engines (through every tokenizer's ``render_chat``) and the CLI (``--message``, ``--chat``)
refuse the same messages with the same field name.

A message is an object with a ``role`` from :data:`OPENAI_ROLES` and a ``content`` (a string, or
a list of text parts); only an assistant turn that calls tools (``tool_calls``, or the older
``function_call``) may leave ``content`` out or null. Whether a model's template takes a role is
the template's own business (it refuses with its message).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenization.base import ChatTemplateError, message_text

OPENAI_ROLES = ("system", "user", "assistant", "tool", "developer", "function")
"""The roles OpenAI's chat completions API accepts."""


class MessageError(ChatTemplateError):
    """A chat message OpenAI's API would refuse; ``path`` names the field
    (``messages[1].role``), ``reason`` what to change. A client error: HTTP 400."""


def _calls_tools(msg: Mapping[str, Any]) -> bool:
    return msg.get("role") == "assistant" and bool(msg.get("tool_calls") or msg.get("function_call"))


def check_message(i: int, msg: Any) -> dict[str, Any]:
    """Message ``i`` with its content flattened to text (:func:`message_text`); MessageError
    naming the first field OpenAI would refuse."""
    at = f"messages[{i}]"
    if not isinstance(msg, Mapping):
        raise MessageError(at, f"must be an object with role and content, got {type(msg).__name__}")
    role = msg.get("role")
    if role is None:
        raise MessageError(f"{at}.role", f"is required: one of {', '.join(OPENAI_ROLES)}")
    if role not in OPENAI_ROLES:
        raise MessageError(f"{at}.role", f"must be one of {', '.join(OPENAI_ROLES)}, got {role!r}")
    if msg.get("content") is None and not _calls_tools(msg):
        raise MessageError(f"{at}.content", "is required (a string or a list of text parts); only "
                                            "an assistant turn with tool_calls may leave it out")
    flat = dict(msg)
    flat["content"] = message_text(msg.get("content"), f"{at}.content")
    return flat


def check_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """``messages`` checked (:func:`check_message`) with each content flattened to text; a
    MessageError names the first malformed message."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise MessageError("messages", "must be a non-empty list of {role, content} objects")
    return [check_message(i, msg) for i, msg in enumerate(messages)]
