"""One exception root per layer: every exception class a package defines derives from it, so
a caller can catch "anything this layer raises" and each server maps its tree to HTTP in one
place (router.errors.error_response, bootstrap.server's middleware, engine.http_common)."""
from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

ROOTS = {
    "transfer": "transfer.base:TransferLayerError",
    "index": "index.errors:IndexLayerError",
    "bootstrap": "bootstrap.errors:BootstrapLayerError",
    "engine": "engine.errors:EngineError",
    "router": "router.errors:RouterError",
    "sidecar": "sidecar.errors:SidecarError",
    "tokenization": "tokenization.base:TokenizationError",
}
"""Each layer's root. Private classes (a leading ``_``) are control flow inside one module
(``bootstrap.client._Retry``, ``router.http.server._StopParsing``) and never leave it."""

WITHOUT_ROOT = {"kvatlas": "the CLI: its errors end the process with a message, nobody catches "
                           "them by layer"}
"""Packages that have no root on purpose, and why."""


def _load(spec: str) -> type[BaseException]:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def _exception_classes(package: str) -> list[type[BaseException]]:
    pkg = importlib.import_module(package)
    names = [package] + [m.name for m in pkgutil.walk_packages(pkg.__path__, package + ".")]
    found = []
    for name in names:
        module = importlib.import_module(name)
        found += [obj for obj in vars(module).values()
                  if inspect.isclass(obj) and issubclass(obj, BaseException)
                  and obj.__module__ == name and not obj.__name__.startswith("_")]
    return found


@pytest.mark.parametrize("package", sorted(ROOTS))
def test_every_exception_derives_from_the_layers_root(package: str) -> None:
    root = _load(ROOTS[package])
    classes = _exception_classes(package)
    assert root in classes
    strays = [f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, root)]
    assert not strays, f"give these {root.__name__} as a base: {strays}"


def test_every_package_has_a_root_or_a_reason() -> None:
    # A package missing here has its stray exceptions go unseen (sidecar/ once was).
    root = Path(__file__).resolve().parents[1]
    packages = {p.parent.name for p in root.glob("*/__init__.py")}
    assert packages == set(ROOTS) | set(WITHOUT_ROOT), (
        f"give these a root in ROOTS: {sorted(packages - set(ROOTS) - set(WITHOUT_ROOT))}")


def test_roots_kept_the_builtin_bases_callers_catch() -> None:
    from bootstrap.errors import TopologyMismatch
    from index.events.errors import MalformedEvent
    from transfer.backends.cuda_ipc import BackendUnavailable
    from transfer.base import InvalidTransition
    from transfer.wire import AuthError, WireError
    for cls, base in ((MalformedEvent, ValueError), (WireError, ValueError),
                      (AuthError, ValueError), (TopologyMismatch, ValueError),
                      (InvalidTransition, RuntimeError), (BackendUnavailable, RuntimeError)):
        assert issubclass(cls, base), (cls, base)


def test_router_errors_carry_their_answer() -> None:
    from router.errors import BadRequest, NoWorkers, Overloaded, UnknownModel
    from router.http.client import UpstreamError
    cases = [(BadRequest("text", "is missing"), 400, {}),
             (BadRequest("body", "too big", 413), 413, {}),
             (UnknownModel("model 'x' is not served here"), 404, {}),
             (NoWorkers("decode", "none registered"), 503, {"role": "decode"}),
             (Overloaded(429, "too many requests"), 429, {}),
             (UpstreamError("http://w:1", "reset"), 502, {})]
    for exc, status, extra in cases:
        assert (exc.status, exc.extra) == (status, extra), exc


def test_bootstrap_refusals_carry_their_answer() -> None:
    from bootstrap.errors import BadRequest, RegistrationError
    assert (BadRequest("empty").status, BadRequest("big", 413).status) == (400, 413)
    assert BadRequest("empty").body() == {"error": "empty"}
    exc = RegistrationError(409, "page_size differs", "page_size")
    assert (exc.status, exc.body()) == (409, {"error": "page_size differs", "field": "page_size"})
