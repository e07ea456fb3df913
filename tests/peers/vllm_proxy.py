"""vLLM's own PD test proxy (``toy_proxy_server.py``), fetched for the tests, never committed.

It is not in the vLLM wheel, so this downloads the vllm 0.33.0 sdist from PyPI once into a
git-ignored cache (``.kvatlas/peers/``), checks its sha256, and extracts only that file, unchanged.
``make test`` runs it (``python tests/peers/vllm_proxy.py``) so the test that drives a pair of our
engines through that proxy never skips. ``KVATLAS_VLLM_SDIST`` may name a local copy of the sdist.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".kvatlas" / "peers"
PROXY = CACHE / "toy_proxy_server.py"
SDIST_URL = ("https://files.pythonhosted.org/packages/f7/25/"
             "aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz")
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
MEMBER = "vllm-0.33.0/tests/v1/kv_connector/nixl_integration/toy_proxy_server.py"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch() -> Path:
    """The proxy's path, downloading and extracting it on first use; RuntimeError saying what
    failed (a download, a checksum) otherwise."""
    if PROXY.exists():
        return PROXY
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        sdist = Path(tmp) / "vllm-0.33.0.tar.gz"
        local = os.environ.get("KVATLAS_VLLM_SDIST")
        try:
            if local:
                shutil.copyfile(local, sdist)
            else:
                with urllib.request.urlopen(SDIST_URL, timeout=120) as r, sdist.open("wb") as f:
                    shutil.copyfileobj(r, f)
        except OSError as exc:
            raise RuntimeError(f"cannot fetch the vllm sdist ({local or SDIST_URL}): {exc}; set "
                               "KVATLAS_VLLM_SDIST to a local copy") from None
        got = _sha256(sdist)
        if got != SDIST_SHA256:
            raise RuntimeError(f"vllm sdist sha256 is {got}, expected {SDIST_SHA256}")
        with tarfile.open(sdist) as tar:
            src = tar.extractfile(MEMBER)
            if src is None:
                raise RuntimeError(f"{MEMBER} is not a file in the vllm sdist")
            part = Path(tmp) / PROXY.name
            part.write_bytes(src.read())
        part.replace(PROXY)  # whole or absent: a killed fetch leaves no half file
    return PROXY


if __name__ == "__main__":
    try:
        print(fetch())
    except RuntimeError as exc:
        sys.exit(f"vllm_proxy: {exc}")
