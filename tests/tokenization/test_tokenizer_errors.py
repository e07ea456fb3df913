"""What a user gets wrong: a tokenizer path that is missing or not a tokenizer, messages a
template refuses, content parts that are not text. Each is one error naming what to fix."""
from __future__ import annotations

from pathlib import Path

import pytest

from tokenization import (
    ByteTokenizer,
    ChatTemplateError,
    TokenizationError,
    TokenizerError,
    load_tokenizer,
)
from tokenization.assets import qwen3_tokenizer_dir
from tokenization.hf_dir import load_hf_dir


def test_missing_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(TokenizerError, match="nope.*no such file"):
        load_tokenizer(str(missing))


@pytest.mark.parametrize("what", ["empty dir", "not a tokenizer", "bad json", "bad gguf"])
def test_unreadable_tokenizers_are_refused(tmp_path: Path, what: str) -> None:
    if what == "empty dir":
        target = tmp_path
    elif what == "not a tokenizer":
        target = tmp_path / "notes.txt"
        target.write_text("hello")
    elif what == "bad json":
        (tmp_path / "tokenizer.json").write_text("{not json")
        target = tmp_path
    else:
        target = tmp_path / "model.gguf"
        target.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(str(target))
    assert str(target) in str(info.value)
    assert isinstance(info.value, TokenizationError)


def test_template_that_raises_is_a_chat_template_error(tmp_path: Path) -> None:
    src = qwen3_tokenizer_dir()
    (tmp_path / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}")
    tok = load_hf_dir(tmp_path)
    assert tok.encode_chat([{"role": "user", "content": "a"}]) == tok.encode("a", False)
    with pytest.raises(ChatTemplateError, match="roles must alternate") as info:
        tok.encode_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert info.value.path == "messages"


@pytest.mark.parametrize("tok", [ByteTokenizer(), load_tokenizer("qwen3")],
                         ids=["byte", "qwen3"])
def test_content_parts_other_than_text_are_named(tok: object) -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ChatTemplateError) as info:
        tok.encode_chat(msgs)  # type: ignore[attr-defined]
    assert info.value.path == "messages[0].content[1]" and "image_url" in info.value.reason
    text_parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                               {"type": "text", "text": "b"}]}]
    assert tok.encode_chat(text_parts) == tok.encode_chat(  # type: ignore[attr-defined]
        [{"role": "user", "content": "a\nb"}])


def test_lone_surrogate_is_a_value_error() -> None:
    for tok in (ByteTokenizer(), load_tokenizer("qwen3")):
        with pytest.raises(ValueError):
            tok.encode("bad \ud800 text")


@pytest.mark.parametrize("escape", ["{{ messages[0].__class__.__mro__ }}",
                                    "{{ ''.__class__.__base__.__subclasses__() }}",
                                    "{{ messages[0].content.__class__ }}",
                                    "{% set l = loop %}{{ messages.__len__() }}",
                                    "{{ messages.append(1) }}"])
def test_templates_stay_sandboxed(tmp_path: Path, escape: str) -> None:
    """The fast attribute lookups (dict keys, str methods, loop, namespace) leave the sandbox's
    refusals as they are: a template reaching for internals or mutating its input fails, or
    gets nothing (the sandbox's unsafe undefined renders empty), as it does in jinja's own."""
    src = qwen3_tokenizer_dir()
    (tmp_path / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text(escape)
    tok = load_hf_dir(tmp_path)
    msgs = [{"role": "user", "content": "hi"}]
    try:
        assert tok.render_chat(msgs) == ""
    except ChatTemplateError:
        pass
    assert msgs == [{"role": "user", "content": "hi"}]
