"""Files derived from a model file (a converted tokenizer, a dequantized checkpoint), cached on
disk and shared by every copy of that file.

Where: ``$KVATLAS_CACHE_DIR`` (default ``~/.cache/kvatlas``; an empty value disables the cache).
Key: the source's content (streamed xxh3-128: ~16 ms for the 98 MB SmolLM2 GGUF from the page
cache, ~160 ms cold) plus the deriver's version, never its path: a model installed in two
virtualenvs, or copied, shares one entry. Entries are written under a temporary name in the
cache directory and renamed into place, so a reader never sees half an entry, and the temporary
is removed whatever stopped the write.
"""
from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import xxhash

CACHE_ENV = "KVATLAS_CACHE_DIR"
TMP_PREFIX = ".tmp-"
"""Names of entries being written (never read as entries)."""
_CHUNK = 1 << 20


def cache_root() -> Path | None:
    """``$KVATLAS_CACHE_DIR`` (default ``~/.cache/kvatlas``); None when set empty (no cache)."""
    env = os.environ.get(CACHE_ENV)
    if env == "":
        return None
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvatlas"


def content_hash(source: Path) -> str:
    """xxh3-128 of the file's bytes, hex. Remembered per process for an unchanged file (same
    inode, size and mtime), since one start asks for it more than once."""
    st = source.stat()
    return _hash(str(source.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _hash(path: str, inode: int, size: int, mtime_ns: int) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def cache_entry(source: Path, version: str) -> Path | None:
    """The name (without suffix) of what version ``version`` of a deriver makes from ``source``;
    None when the cache is disabled. The caller adds its own subfolder or suffix."""
    root = cache_root()
    if root is None:
        return None
    return root / f"{content_hash(source)}-v{version}"


def publish_file(target: Path, write: Callable[[Path], None]) -> None:
    """Make ``target`` by ``write(tmp)`` on a temporary file beside it, then an atomic rename.
    Whatever ``write`` or the rename raises is raised again, after the temporary is removed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=TMP_PREFIX)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # readable by other users' processes sharing the cache directory
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def publish_dir(target: Path, fill: Callable[[Path], None]) -> bool:
    """Make the directory ``target`` by ``fill(tmp)`` on a temporary directory beside it, then a
    rename. False when ``target`` already existed (another process made it first; its copy is
    kept). Whatever ``fill`` or the rename raises is raised again, after the temporary is
    removed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=TMP_PREFIX))
    try:
        fill(tmp)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
            return False
        return True
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
