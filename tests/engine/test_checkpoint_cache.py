"""The dequantized checkpoint cache: one entry per file content, whatever path the file is
installed at, and a failed write leaves no temporary behind."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint import cache


@pytest.fixture()
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVATLAS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _model(path: Path, data: bytes = b"GGUF" + bytes(4096)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_two_install_locations_share_one_entry(tmp_path: Path, root: Path) -> None:
    first = _model(tmp_path / "venv-a" / "site-packages" / "model.gguf")
    second = _model(tmp_path / "venv-b" / "lib" / "other-name.gguf")
    target = cache.cache_file(first)
    assert target is not None
    assert cache.write(target, {"w": np.arange(6, dtype=np.float32)},
                       {"kvatlas_config": "{}", "source": str(first)})
    assert cache.cache_file(second) == target
    assert cache.read_metadata(cache.cache_file(second)) is not None, "the second copy missed"
    assert [p for p in root.iterdir() if p.suffix == ".safetensors"] == [target]


def test_a_failed_write_leaves_no_temporary(tmp_path: Path, root: Path) -> None:
    target = cache.cache_file(_model(tmp_path / "model.gguf"))
    assert target is not None
    target.mkdir(parents=True)  # the rename onto it fails, after the data was written
    (target / "in-the-way").write_text("")
    assert not cache.write(target, {"w": np.zeros(4, dtype=np.float32)},
                           {"kvatlas_config": "{}"})
    assert sorted(p.name for p in root.iterdir()) == [target.name]
