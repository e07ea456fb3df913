"""Rendering chat messages with a model's jinja chat template, as Hugging Face's
``apply_chat_template`` (and so SGLang and vLLM) renders them.

The environment is what templates are written against: a sandbox, ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception(msg)`` (a template's way to
refuse messages), a ``tojson`` that does not HTML-escape, ``strftime_now(fmt)``. The variables are
``messages``, ``tools``, ``add_generation_prompt``, the tokenizer's special tokens (``bos_token``,
``eos_token``, ``unk_token``, ``pad_token``) and the request's ``chat_template_kwargs`` (e.g.
``enable_thinking``). A template is compiled once and kept.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from tokenization.base import ChatTemplateError
from tokenization.messages import check_messages

RESERVED = frozenset({"messages", "tools", "add_generation_prompt"})
"""Template variables a request's ``chat_template_kwargs`` may not set."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes '<', '>' and '&': templates expect the JSON as written.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_DICT_ATTRS = frozenset(dir(dict))
_STR_METHODS = frozenset(a for a in dir(str) if not a.startswith("_")) - {"format", "format_map"}


class _Sandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with its attribute lookup answered directly for the lookups templates make
    hundreds of times per render: a message's key (``message.content``), a string method
    (``.startswith``), ``loop.index0`` and ``ns.x``. Each answer is the one the sandbox gives;
    its general path (a failed ``getattr``, then a safety check through ABC ``isinstance``
    calls) was two thirds of a Qwen3 render. Calls still go through the sandbox's checks."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if kind is dict and attribute not in _DICT_ATTRS:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        if kind is str and attribute in _STR_METHODS:
            return getattr(obj, attribute)
        if (kind is LoopContext or kind is Namespace) and not attribute.startswith("_"):
            try:
                return getattr(obj, attribute)
            except AttributeError:
                pass
        return super().getattr(obj, attribute)


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template of ``source``; ChatTemplateError when it does not parse."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError("chat_template", f"does not parse: {exc}") from None


def request_template_args(body: Mapping[str, Any]) -> tuple[list[Any] | None, dict[str, Any]]:
    """(``tools``, ``chat_template_kwargs``) of an OpenAI chat body, as the template receives
    them: the engine and the router read a request with this one function, so that they render
    the same text. ChatTemplateError names a field of the wrong shape, or a kwarg that would
    set what the request's own fields set."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ChatTemplateError("tools", f"must be a list, got {type(tools).__name__}")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return tools, {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ChatTemplateError("chat_template_kwargs", "must be an object")
    reserved = RESERVED & set(kwargs)
    if reserved:
        raise ChatTemplateError("chat_template_kwargs", f"must not set {sorted(reserved)}: the "
                                                        "request's own fields set them")
    return tools, kwargs


class ChatTemplate:
    """One model's template and the special tokens it may use."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None]) -> None:
        self.source = source
        self._template = compile_template(source)
        self._specials = {k: v for k, v in special_tokens.items() if v is not None}

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[Any] | None = None, **template_kwargs: Any) -> str:
        """The prompt text; ChatTemplateError carrying the template's own message when it
        raises (``raise_exception``, or an error evaluating it on these messages)."""
        flat = check_messages(messages)
        bad = RESERVED & set(template_kwargs)
        if bad:
            raise ChatTemplateError("chat_template_kwargs", f"must not set {sorted(bad)}")
        variables = {**self._specials, **template_kwargs}
        try:
            return self._template.render(messages=flat, tools=tools,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError("messages", f"the model's chat template refused them: "
                                                f"{exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise ChatTemplateError("messages", f"the model's chat template failed on them: "
                                                f"{type(exc).__name__}: {exc}") from None
