"""A prompt on the command line, and the tokenizer that turns it into the ids an engine prefills.

A prompt is one of ``--prompt TEXT``, ``--chat FILE`` (a JSON list of ``{"role", "content"}``
messages) or ``--message ROLE=TEXT`` given once per message, in order. The ids follow the rules of
``tokenization.base``: text is encoded with ``add_special_tokens=True`` (BOS only where the
model's tokenizer adds one), messages are rendered by the model's chat template and encoded
without special tokens (the template writes them).

The tokenizer (``--tokenizer PATH|alias|byte``, else found): ``tokenizer_source`` says where it
comes from when not given -- the instance records the cluster's engines publish in etcd
(``record.tokenizer.source``), then the model's own name when it is a known alias, then the byte
tokenizer of kvatlas's reference models (``tiny``, ``bench``).
"""
from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from index.record import InstanceRecord, RecordReader, named_tokenizer
from kvatlas.cli import CLIError
from tokenization import BYTE, ChatTemplateError
from tokenization.messages import OPENAI_ROLES, check_message, check_messages

logger = logging.getLogger(__name__)

CHAT_ROLES = OPENAI_ROLES
"""Roles ``--message`` accepts: OpenAI's (the model's template may still refuse one)."""


TOKENIZER_HELP = ("tokenizer: a tokenizer directory, a .gguf file, a model alias (smollm2-135m) "
                  "or 'byte' (default: the one the cluster's instances of the model publish in "
                  "etcd, else the model's own when --model names a known one, else byte)")


def add_prompt_args(parser: argparse.ArgumentParser, *extra: tuple[str, dict[str, Any]],
                    tokenizer_help: str = TOKENIZER_HELP) -> argparse._MutuallyExclusiveGroup:
    """``--prompt``/``--chat``/``--message`` (exactly one kind required; ``extra`` adds more
    choices to the same group, after ``--prompt``) and ``--tokenizer``."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    for flag, kw in extra:
        src.add_argument(flag, **kw)
    src.add_argument("--chat", metavar="FILE",
                     help="chat messages: a JSON list of {\"role\", \"content\"} objects; - = stdin")
    src.add_argument("--message", action="append", metavar="ROLE=TEXT",
                     help=f"one chat message, ROLE one of {', '.join(CHAT_ROLES)}; repeat it "
                          "for each message, in order")
    parser.add_argument("--tokenizer", default=None, metavar="PATH|ALIAS", help=tokenizer_help)
    return src


def parse_message(text: str, index: int = 0) -> dict[str, str]:
    """``ROLE=TEXT`` as message ``index``; CLIError when the ``=`` is missing or OpenAI would
    refuse the message (``tokenization.messages``)."""
    role, sep, content = text.partition("=")
    if not sep:
        raise CLIError(f"--message {text!r}: expected ROLE=TEXT (e.g. user=Hello), with ROLE one "
                       f"of {', '.join(CHAT_ROLES)}")
    message = {"role": role, "content": content}
    try:
        check_message(index, message)
    except ChatTemplateError as exc:
        raise CLIError(f"--message {text!r}: {exc}") from None
    return message


def load_chat(path: str) -> list[dict[str, Any]]:
    """The messages of a ``--chat`` file; CLIError naming the file and the first bad item."""
    import sys
    where = f"--chat {path}"
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"{where}: cannot read it: {exc}") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise CLIError(f"{where}: not JSON ({exc}); expected a list of {{\"role\", \"content\"}} "
                       "messages") from None
    if not isinstance(doc, list) or not doc:
        got = "an empty list" if doc == [] else f"a JSON {type(doc).__name__}"
        raise CLIError(f"{where}: expected a non-empty JSON list of {{\"role\", \"content\"}} "
                       f"messages, got {got}")
    try:
        check_messages(doc)
    except ChatTemplateError as exc:
        raise CLIError(f"{where}: {exc}") from None
    return doc


def chat_messages(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """The messages of ``--chat``/``--message``, or None for a text (or token-id) prompt."""
    if getattr(args, "chat", None) is not None:
        return load_chat(args.chat)
    if getattr(args, "message", None):
        return [parse_message(m, i) for i, m in enumerate(args.message)]
    return None


def load(source: str) -> Any:
    """The tokenizer ``source`` names (``tokenization.load_tokenizer``). A missing or unreadable
    one raises ``TokenizerError``, whose message names the path: the CLI prints that one line."""
    from tokenization import load_tokenizer
    return load_tokenizer(source)


def record_sources(records: Iterable[InstanceRecord], model: str) -> dict[str, str]:
    """Tokenizer source by fingerprint (or by source when a record has none) over the records
    of ``model``: what the cluster's engines say they tokenize with."""
    found: dict[str, str] = {}
    for rec in records:
        named = named_tokenizer(rec.tokenizer) if rec.model == model else None
        if named is not None and named[0] is not None:
            source, fingerprint = named
            found.setdefault(fingerprint or source, source)
    return found


def parse_records(kvs: Iterable[Any], instance_of: Any) -> list[InstanceRecord]:
    """The instance records among etcd ``kvs`` that parse (``RecordReader``: the others are
    logged once and left out)."""
    reader = RecordReader("kvatlas: instance record")
    records = (reader.read(kv.key, kv.value, instance_of(kv.key)) for kv in kvs)
    return [r for r in records if r is not None]


def tokenizer_source(given: str | None, model: str, records: Iterable[InstanceRecord],
                     where: str) -> str:
    """Where the tokenizer of ``model`` (a canonical name) comes from; see the module docstring.
    ``where`` names the etcd the records came from, for the error when they disagree."""
    if given:
        return given
    found = record_sources(records, model)
    if len(found) > 1:
        raise CLIError(f"the instances of model {model} in etcd at {where} publish different "
                       f"tokenizers ({', '.join(sorted(found.values()))}): pass --tokenizer")
    if found:
        return next(iter(found.values()))
    if _known_model(model):
        return model
    return BYTE


def _known_model(model: str) -> bool:
    """True when ``model`` is a name tokenization ships a tokenizer for (an alias or a served
    name such as ``HuggingFaceTB/SmolLM2-135M-Instruct``)."""
    from tokenization.assets import is_known
    return is_known(model)


def encode(tokenizer: Any, args: argparse.Namespace,
           messages: list[dict[str, Any]] | None, add_special_tokens: bool = True) -> list[int]:
    """The ids an engine prefills for the prompt of ``args`` (text) or ``messages`` (chat)."""
    if messages is not None:
        return list(tokenizer.encode_chat(messages))
    try:
        return list(tokenizer.encode(args.prompt, add_special_tokens=add_special_tokens))
    except UnicodeEncodeError:
        raise CLIError("--prompt is not valid UTF-8 (it contains a lone surrogate)") from None
