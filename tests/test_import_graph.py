"""The import graph of ``planner/`` and ``executor/`` has no cycle, function-level imports
included: a function-level import keeps torch out of light commands, it never hides a cycle.

The graph is read from the source (``ast``), so an import inside a function counts as
much as one at the top; only ``if TYPE_CHECKING:`` blocks are left out (they never run).
An import of a package's name (``from . import homes``) is an edge to that module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"protrain.planner": ROOT / "planner", "protrain.executor": ROOT / "executor"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of ``known`` that module ``name`` (at ``path``) imports anywhere in its body."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out: set[str] = set()
    todo = list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = (
                ".".join(
                    base[: len(base) - node.level + 1] + ([node.module] if node.module else [])
                )
                if node.level
                else node.module
            )
            for a in node.names:  # `from pkg import module` is an edge to the module, else to pkg
                out.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod)
        todo.extend(ast.iter_child_nodes(node))
    found = set()
    for m in out:
        while m and m not in known:
            m = m.rpartition(".")[0]
        if m and m != name:
            found.add(m)
    return found


def import_graph() -> nx.DiGraph:
    mods = _modules()
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for name, path in mods.items():
        g.add_edges_from((name, dep) for dep in _imports(name, path, set(mods)))
    return g


def test_no_import_cycles():
    g = import_graph()
    # A package's __init__ imports its submodules lazily or not at all; an edge from a
    # submodule to its package's face is not a cycle through code that runs first.
    cycles = sorted(sorted(c) for c in nx.simple_cycles(g) if len(c) > 1)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_graph_sees_function_level_imports(tmp_path):
    # The test's own guard: an import inside a function body is an edge.
    (tmp_path / "a.py").write_text("def f():\n    from .b import x\n")
    (tmp_path / "b.py").write_text("import os\n")
    deps = _imports("p.a", tmp_path / "a.py", {"p.a", "p.b"})
    assert deps == {"p.b"}
    (tmp_path / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import x\n"
    )
    assert _imports("p.c", tmp_path / "c.py", {"p.c", "p.b"}) == set()
