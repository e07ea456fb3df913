"""Every command line the docs show parses: each ``kvatlas ...`` line of README.md and docs/*.md
(fenced code blocks and inline code) goes through the CLI's own argparse parsers, and each
``bench/*.py`` invocation names a script that exists with flags it defines.

Doc lines are usage, not shell, so they are normalised before parsing: a trailing ``\\`` joins
lines, ``# ...`` comments and shell redirections are dropped, ``[optional parts]`` are kept (they
must parse too), alternatives (``a|b`` in a value, ``(x | y)`` or ``[x | y]`` between options)
are each parsed as their own variant, and an all-caps placeholder (``URL``, ``P``) given to a
typed flag is replaced by ``1``. A line that elides arguments (``...``, or any inline mention)
must name known commands, flags and choices, but need not give the required ones; an inline
mention without flags (`kvatlas bootstrap show`) only names a command.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvatlas.cli import _hoist_log_level, build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)*)`(?!`)")
_SHELL_END = re.compile(r"\s(?:>|2>|&&|;|\|(?=\s))")  # outside groups a spaced `|` is a pipe
_GROUP = re.compile(r"[\[(]([^\[\]()]*)[\])]")
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(?::[A-Z0-9_]+)?$")
_INVALID_VALUE = re.compile(r"invalid \w+ value: '([^']*)'")
_BENCH = re.compile(r"(?:^|[\s(])((?:\./)?bench/[\w/]+\.py)\b(.*)")


@dataclass(frozen=True)
class DocLine:
    """One command as a doc shows it."""

    doc: str
    """the doc's path, relative to the repository"""
    line: int
    """1-based line where the command starts"""
    text: str
    """the command, continuation lines joined"""
    elided: bool
    """an inline mention or a line with ``...``: required arguments may be left out"""

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def _code_lines(path: Path) -> list[DocLine]:
    """Commands in fenced code blocks, plus inline code spans in the prose."""
    rel = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    found: list[DocLine] = []
    prose: list[tuple[int, str]] = []
    in_fence = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if _FENCE.match(line):
            in_fence = not in_fence
            i += 1
            continue
        if not in_fence:
            prose.append((i + 1, line))
            i += 1
            continue
        start = i
        text = line
        while text.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        found.append(DocLine(rel, start + 1, text.strip(), elided=_has_ellipsis(text)))
    found.extend(_inline_spans(rel, prose))
    return found


def _inline_spans(rel: str, prose: list[tuple[int, str]]) -> list[DocLine]:
    """Inline code, which may wrap onto the next line within one paragraph."""
    spans: list[DocLine] = []
    text = "\n".join(line for _, line in prose)
    starts = [n for n, _ in prose]
    for m in _INLINE.finditer(text):
        line = starts[text.count("\n", 0, m.start())]
        spans.append(DocLine(rel, line, " ".join(m.group(1).split()), elided=True))
    return spans


def _has_ellipsis(text: str) -> bool:
    return bool(re.search(r"(^|\s|\])\.\.\.(\s|$)", text))


def _all_lines() -> list[DocLine]:
    return [doc_line for path in DOCS for doc_line in _code_lines(path)]


def _strip_shell(text: str) -> str:
    """``text`` without its comment and anything after a redirection or pipe."""
    text = re.sub(r"\s#\s.*$", "", text)
    text = re.sub(r"\](\.\.\.)", "]", text)
    depth = 0
    for j, ch in enumerate(text):
        depth += ch in "[(" and 1 or (ch in "])" and -1 or 0)
        if depth == 0 and _SHELL_END.match(text, j):
            return text[:j]
    return text


def _variants(text: str) -> list[str]:
    """Every reading of ``text``: optional groups kept, each alternative taken in turn."""
    m = _GROUP.search(text)
    if m is not None:
        inner = m.group(1)
        choices = [c.strip() for c in inner.split(" | ")] if " | " in inner else [inner]
        return [v for c in choices
                for v in _variants(text[:m.start()] + " " + c + " " + text[m.end():])]
    tokens = shlex.split(text)
    per_token = [t.split("|") if "|" in t and not t.startswith(("tcp:", "http")) else [t]
                 for t in tokens]
    return [shlex.join(p) for p in itertools.product(*per_token)]


def _relax(parser: argparse.ArgumentParser) -> None:
    """Make every required option of ``parser`` and its subcommands optional (elided lines)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _relax(child)
        elif action.option_strings:
            action.required = False
    for group in parser._mutually_exclusive_groups:
        group.required = False


def _parse(argv: list[str], elided: bool) -> str | None:
    """The parser's error for ``argv`` (None when it parses); typed placeholders become 1."""
    for _ in range(10):
        argv = _hoist_log_level(argv)
        parser = build_parser(argv)
        if elided:
            _relax(parser)
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parser.parse_args(argv)
            return None
        except SystemExit:
            message = err.getvalue().strip().splitlines()[-1] if err.getvalue() else "exit"
        if elided and "arguments are required" in message and not any(
                a.startswith("-") for a in argv):
            return None  # a command named in prose, without its arguments
        bad = _INVALID_VALUE.search(message)
        if bad and _PLACEHOLDER.match(bad.group(1)) and bad.group(1) in argv:
            argv = [("1" if a == bad.group(1) else a) for a in argv]
            continue
        return message
    return "too many placeholders"


KVATLAS_LINES = [d for d in _all_lines() if d.text.startswith("kvatlas ")]
BENCH_LINES = [d for d in _all_lines() if _BENCH.search(d.text)]


def test_docs_show_commands() -> None:
    """The extraction finds the docs' commands (a broken extractor would pass everything)."""
    texts = [d.text for d in KVATLAS_LINES]
    assert any(t.startswith("kvatlas cluster up") for t in texts), texts
    assert any(t.startswith("kvatlas router serve") and "--policy" in t for t in texts), texts
    assert len(KVATLAS_LINES) > 30 and len(BENCH_LINES) > 10, (len(KVATLAS_LINES), len(BENCH_LINES))


@pytest.mark.parametrize("doc_line", KVATLAS_LINES, ids=lambda d: f"{d.doc}:{d.line}")
def test_kvatlas_command_parses(doc_line: DocLine) -> None:
    failures = []
    for variant in _variants(_strip_shell(doc_line.text)):
        argv = shlex.split(variant)[1:]
        argv = [a for a in argv if a != "..."]
        error = _parse(argv, doc_line.elided)
        if error is not None:
            failures.append(f"{variant!r}: {error}")
    assert not failures, f"{doc_line}\n  " + "\n  ".join(failures)


def test_a_wrong_doc_line_fails() -> None:
    """The check itself: an unknown flag, a bad choice and a missing required flag are caught."""
    assert "unrecognized arguments: --no-such-flag" in _parse(
        ["instances", "--no-such-flag"], elided=True)
    assert "invalid choice" in _parse(["router", "serve", "--policy", "cache_free"], elided=True)
    assert "required" in _parse(["bootstrap", "serve"], elided=False)
    assert _parse(["bootstrap", "serve"], elided=True) is None
    assert _variants("kvatlas x (--a A | --b B) [--c 1|2]") == [
        "kvatlas x --a A --c 1", "kvatlas x --a A --c 2",
        "kvatlas x --b B --c 1", "kvatlas x --b B --c 2"]


def _bench_flags(script: Path) -> str:
    """The source a bench script's flags are defined in: the script and the bench modules it
    imports (its parser is built inside ``main``, so it is read, not run)."""
    text = script.read_text()
    for name in re.findall(r"^\s*(?:from|import)\s+(?:bench\.)?(_\w+)", text, re.M):
        module = script.parent / f"{name}.py"
        if module.exists():
            text += module.read_text()
    return text


@pytest.mark.parametrize("doc_line", BENCH_LINES, ids=lambda d: f"{d.doc}:{d.line}")
def test_bench_command_exists(doc_line: DocLine) -> None:
    m = _BENCH.search(doc_line.text)
    assert m is not None, str(doc_line)
    script = ROOT / m.group(1)
    assert script.is_file(), f"{doc_line}\n  no such script: {m.group(1)}"
    source = _bench_flags(script)
    rest = re.split(r"\s(?:\./)?bench/[\w/]+\.py\b", m.group(2))[0]  # the next script's own
    missing = [f for f in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest)
               if f'"{f}"' not in source and f"'{f}'" not in source]
    assert not missing, f"{doc_line}\n  {m.group(1)} defines no {', '.join(missing)}"
