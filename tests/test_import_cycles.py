"""No import cycle anywhere in the project's packages.

Every import counts: module level, inside functions, and under ``if TYPE_CHECKING:`` (a cycle
that only type checkers see still ties two modules together and tends to become a real one).
``from pkg import name`` depends on the submodule ``pkg.name`` when there is one, else on ``pkg``
itself; ``import a.b.c`` depends on the longest prefix of ``a.b.c`` that is a project module.
Importing a submodule also runs its parent packages' ``__init__``, but that edge is left out on
purpose: a package that imports its own submodules would otherwise always read as a cycle.
"""
from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("transfer", "index", "bootstrap", "engine", "router", "sidecar", "kvatlas",
            "tokenization")
MIN_MODULES = 100
"""Fewer modules than this means the walk went wrong (it must not pass by walking nothing)."""


def project_modules() -> dict[str, Path]:
    """``{dotted module name: file}`` of every .py file of the project packages."""
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        top = ROOT / pkg
        if not top.is_dir():
            continue
        for f in sorted(top.rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = f
    return mods


def _imported(tree: ast.AST, name: str, is_package: bool) -> Iterator[tuple[str, list[str]]]:
    """(module, names imported from it) of each import statement; relative ones resolved."""
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield module, [alias.name for alias in node.names]


def _resolve(module: str, mods: dict[str, Path]) -> str | None:
    """The longest prefix of ``module`` that is a project module (None: not ours)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in mods:
            return candidate
    return None


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        deps: set[str] = set()
        for module, names in _imported(tree, name, path.name == "__init__.py"):
            if names:
                for imported in names:
                    sub = f"{module}.{imported}"
                    target = sub if sub in mods else _resolve(module, mods)
                    if target is not None:
                        deps.add(target)
            else:
                target = _resolve(module, mods)
                if target is not None:
                    deps.add(target)
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = []
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        work.append((root, iter(sorted(graph[root]))))
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
            if low[v] == index[v]:
                comp: list[str] = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def _edges_within(comp: list[str], graph: dict[str, set[str]]) -> str:
    members = set(comp)
    return "; ".join(f"{a} -> {b}" for a in comp for b in sorted(graph[a] & members))


def test_the_walk_sees_the_project() -> None:
    mods = project_modules()
    assert len(mods) >= MIN_MODULES, f"only {len(mods)} modules found under {ROOT}"
    graph = import_graph(mods)
    # The resolution rules themselves, on imports known to exist.
    assert "index.table" in graph["index.mirror"]
    assert "router.http.messages" in graph["router.http.server"]
    assert "sidecar.config" in graph["sidecar.record"]


def top_level_packages() -> set[str]:
    """Every directory at the repository root that is a Python package (tests/ is not one)."""
    return {p.parent.name for p in ROOT.glob("*/__init__.py")}


def test_every_package_is_walked() -> None:
    # A package left out of PACKAGES would have its cycles go unseen (sidecar/ once was).
    assert top_level_packages() == set(PACKAGES), (
        f"add to PACKAGES: {sorted(top_level_packages() - set(PACKAGES))}; "
        f"gone from the tree: {sorted(set(PACKAGES) - top_level_packages())}")


def test_isort_knows_every_package_as_first_party() -> None:
    # ruff sorts a package missing from known-first-party among the third-party imports.
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    first_party = set(config["tool"]["ruff"]["lint"]["isort"]["known-first-party"])
    assert top_level_packages() <= first_party, (
        "add to [tool.ruff.lint.isort] known-first-party in pyproject.toml: "
        f"{sorted(top_level_packages() - first_party)}")


def test_resolution_rules(tmp_path: Path) -> None:
    files = {"pkg/__init__.py": "from pkg import wire\nVALUE = 1\n",
             "pkg/wire.py": "",
             "pkg/user.py": "from pkg import wire\nfrom . import wire as again\n",
             "pkg/plain.py": "from pkg import VALUE\n",
             "pkg/sub/__init__.py": "",
             "pkg/sub/deep.py": "from .. import wire\nimport pkg.sub\n",
             "pkg/late.py": "def f():\n    import pkg.user\n",
             "pkg/typed.py": "from typing import TYPE_CHECKING\n"
                             "if TYPE_CHECKING:\n    from pkg.late import f\n"}
    mods = {}
    for rel, text in files.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
        parts = Path(rel).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = import_graph(mods)
    # "from pkg import wire" is the submodule, not the package (so no cycle with pkg/__init__).
    assert graph["pkg"] == {"pkg.wire"} and graph["pkg.user"] == {"pkg.wire"}
    assert graph["pkg.plain"] == {"pkg"}
    assert graph["pkg.sub.deep"] == {"pkg.wire", "pkg.sub"}
    assert graph["pkg.late"] == {"pkg.user"} and graph["pkg.typed"] == {"pkg.late"}
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}) == [
        ["a", "b", "c"]]


def test_no_import_cycles() -> None:
    graph = import_graph(project_modules())
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(
        f"  {' <-> '.join(c)}  ({_edges_within(c, graph)})" for c in found)
