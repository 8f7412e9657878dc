"""The import graph of ``plans/``, ``executor/`` and ``planner/`` has no cycle and no upward
edge, function-level and ``TYPE_CHECKING`` imports included: a function-level import keeps
torch out of light commands, it never hides a cycle, and a type-only import is still a
dependency of the code's meaning.

The graph is read from the source (``ast``), so an import inside a function or under
``if TYPE_CHECKING:`` counts as much as one at the top. An import of a package's name
(``from . import homes``) is an edge to that module.

Layers, lowest first: ``plans`` (the contract) < ``executor`` (the runtime) < ``planner``;
inside the planner, sub-packages in the order ``LAYERS``: the machine's quantities
(hardware), the models, their profiles, the search that turns a profile into a plan, the
views that render plans, and the commands, which also run the engine (``train``,
``measure``: measuring runs the engine on a plan the search emits).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "protrain.plans": ROOT / "plans",
    "protrain.executor": ROOT / "executor",
    "protrain.planner": ROOT / "planner",
}
LAYERS = ["hardware", "models", "profiling", "search", "views", "commands"]
"""The planner's sub-packages, lowest first: each may import those before it, never after."""


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of ``known`` that module ``name`` (at ``path``) imports anywhere in its body."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out: set[str] = set()
    todo = list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
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
    assert _imports("p.c", tmp_path / "c.py", {"p.c", "p.b"}) == {"p.b"}  # a type is a dependency


def _layer(module: str) -> tuple[int, int]:
    """(package rank, planner rank) of a module: an edge may only go down or sideways.

    The planner's root modules: ``shipped`` (where the shipped data lies) sits below every
    sub-package; the face (``protrain.planner``) and the entry points beside it
    (``__main__``, ``regen``, ``example_plan``) above them all."""
    parts = module.split(".")
    top = ["plans", "executor", "planner"].index(parts[1])
    if top != 2:
        return top, 0
    if len(parts) == 2:
        return top, len(LAYERS)
    if parts[2] in LAYERS:
        return top, LAYERS.index(parts[2])
    return top, -1 if parts[2] == "shipped" else len(LAYERS)


def upward_edges(g: nx.DiGraph) -> list[str]:
    """Edges from a lower layer to a higher one."""
    return sorted(f"{a} -> {b}" for a, b in g.edges() if _layer(b) > _layer(a))


def test_layers_import_one_way():
    """plans < executor < planner, and the planner's sub-packages in ``LAYERS`` order."""
    assert not upward_edges(import_graph()), "upward imports:\n" + "\n".join(
        upward_edges(import_graph())
    )


def test_the_graph_fails_on_an_added_cycle_or_upward_edge(monkeypatch):
    """The two checks above catch what they exist for: a cycle through a type-only import
    (identity <-> plan, as it was) and an upward edge (search -> views, as it was)."""
    real = import_graph()
    g = real.copy()
    g.add_edge("protrain.plans.plan", "protrain.plans.validation")  # validation imports plan
    assert any(len(c) > 1 for c in nx.simple_cycles(g))
    g = real.copy()
    g.add_edge("protrain.planner.search.milp", "protrain.planner.views.show")
    assert upward_edges(g) == ["protrain.planner.search.milp -> protrain.planner.views.show"]
    g = real.copy()
    g.add_edge("protrain.plans.plan", "protrain.executor.engine")
    assert upward_edges(g) == ["protrain.plans.plan -> protrain.executor.engine"]


def _repeated_imports(path: Path) -> list[str]:
    """Function-level imports of a module the file already imports at its top."""
    tree = ast.parse(path.read_text())

    def key(node: ast.Import | ast.ImportFrom) -> set[str]:
        if isinstance(node, ast.Import):
            return {a.name for a in node.names}
        return {f"{'.' * node.level}{node.module or ''}:{a.name}" for a in node.names}

    top = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            top |= key(node)
    inner = [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom)) and n not in tree.body
    ]
    return sorted(f"{path.name}:{n.lineno} {k}" for n in inner for k in key(n) & top)


def test_no_function_level_import_repeats_a_module_level_one(tmp_path):
    """A function-level import is for keeping torch out of light commands; one that repeats
    the module's own top-level import does nothing but hide where the dependency is."""
    repeats = [r for p in _modules().values() for r in _repeated_imports(p)]
    assert not repeats, repeats
    (tmp_path / "m.py").write_text(
        "import os\nfrom .a import b\n\ndef f():\n    from .a import b\n"
    )
    assert _repeated_imports(tmp_path / "m.py") == ["m.py:5 .a:b"]
