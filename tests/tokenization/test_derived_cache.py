"""Derived cache entries (converted tokenizers, dequantized checkpoints): keyed by the source's
content, so copies share one entry, and written under a temporary name that is gone whatever
stopped the write."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tokenization import assets
from tokenization.derived import TMP_PREFIX, cache_entry, publish_dir, publish_file
from tokenization.gguf import _cache_dir, load_gguf_tokenizer


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("KVATLAS_CACHE_DIR", str(root))
    return root


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if p.name.startswith(TMP_PREFIX))


def test_copies_of_one_file_share_an_entry(tmp_path: Path, cache: Path) -> None:
    a, b, other = tmp_path / "a" / "model.gguf", tmp_path / "b" / "renamed.gguf", tmp_path / "o.gguf"
    for path, data in ((a, b"weights" * 1000), (b, b"weights" * 1000), (other, b"other")):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    assert cache_entry(a, "1") == cache_entry(b, "1")
    assert cache_entry(a, "1") != cache_entry(other, "1")
    assert cache_entry(a, "1") != cache_entry(a, "2")
    entry = cache_entry(a, "1")
    assert entry is not None and entry.parent == cache


def test_an_edited_file_gets_a_new_entry(tmp_path: Path, cache: Path) -> None:
    source = tmp_path / "model.gguf"
    source.write_bytes(b"first")
    before = cache_entry(source, "1")
    source.write_bytes(b"other")  # same size: only the content tells them apart
    assert cache_entry(source, "1") != before


def test_no_entry_when_the_cache_is_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVATLAS_CACHE_DIR", "")
    source = tmp_path / "m.gguf"
    source.write_bytes(b"x")
    assert cache_entry(source, "1") is None


@pytest.mark.parametrize("error", [OSError("disk full"), RuntimeError("interrupted")])
def test_a_failed_file_write_leaves_nothing(cache: Path, error: Exception) -> None:
    target = cache / "entry.safetensors"

    def half_then_fail(tmp: Path) -> None:
        tmp.write_bytes(b"half a file")
        raise error

    with pytest.raises(type(error)):
        publish_file(target, half_then_fail)
    assert list(cache.iterdir()) == [], "the temporary file was left behind"


def test_a_file_write_replaces_atomically(cache: Path) -> None:
    target = cache / "entry"
    publish_file(target, lambda tmp: tmp.write_bytes(b"one"))
    publish_file(target, lambda tmp: tmp.write_bytes(b"two"))
    assert target.read_bytes() == b"two" and [p.name for p in cache.iterdir()] == ["entry"]


def test_a_failed_directory_fill_leaves_nothing(cache: Path) -> None:
    def half_then_fail(tmp: Path) -> None:
        (tmp / "tokenizer.json").write_text("{")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        publish_dir(cache / "tok", half_then_fail)
    assert list(cache.iterdir()) == [], "the temporary directory was left behind"


def test_a_lost_race_keeps_the_winners_copy_and_no_temporary(cache: Path) -> None:
    target = cache / "tok"
    target.mkdir(parents=True)
    (target / "tokenizer.json").write_text("winner")
    assert publish_dir(target, lambda tmp: (tmp / "tokenizer.json").write_text("loser")) is False
    assert (target / "tokenizer.json").read_text() == "winner"
    assert _leftovers(cache) == []


def test_gguf_tokenizer_cache_is_shared_and_leaves_no_temporary(tmp_path: Path,
                                                                cache: Path) -> None:
    original = assets.smollm2_gguf()
    copy = tmp_path / "elsewhere" / "copy.gguf"
    copy.parent.mkdir()
    shutil.copyfile(original, copy)
    entry = _cache_dir(original)
    assert entry is not None and entry == _cache_dir(copy)
    # An entry that cannot be completed (here: a stale directory without tokenizer.json where
    # the rename must land) still loads the tokenizer, from memory, and leaves no temporary.
    entry.mkdir(parents=True)
    (entry / "stale").write_text("")
    ids = load_gguf_tokenizer(copy).encode("hello world")
    assert _leftovers(cache) == []
    shutil.rmtree(entry)
    assert load_gguf_tokenizer(original).encode("hello world") == ids
    assert (entry / "tokenizer.json").is_file()
    assert sorted(p.name for p in (cache / "tokenizers").iterdir()) == [entry.name]
