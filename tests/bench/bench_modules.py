"""Loading bench modules in the tests: bench/ is not a package, and putting it first on sys.path
would shadow the ``index`` package with bench/index.py (and ``router`` with bench/router.py)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load(name: str, as_name: str | None = None) -> ModuleType:
    """bench/``name``.py, loaded once from its file as module ``as_name`` (default ``name``;
    give one where ``name`` is a package's too). Load a module's helpers first."""
    key = as_name or name
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[key] = mod
    spec.loader.exec_module(mod)
    return mod
