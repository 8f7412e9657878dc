"""The planner and tools observe the engine only through its public API (issue #16).

Two contracts bind the planner to the executor: the plan file (plans/plan.py) and
``Engine``'s public methods, events included (``Engine.on_event``, executor/events.py).
Private executor names are not a contract: a planner that reads or replaces them breaks
silently the day the executor changes. This test scans planner/ and tools/ (AST, no
imports) for

- an attribute access ``<expr>._x`` where ``_x`` is a private name the executor defines
  (``self._x = …``, ``def _x``, a module-level ``_x``), on anything but ``self``/``cls``;
- a string ``"_x"`` naming one (``getattr(obj, "_x")``, ``setattr(obj, "_x", …)``), and
  ``from protrain.executor… import _x``;
- monkeypatching of the engine: an assignment or ``del`` of ``<expr>.name``, a call
  that names an executor member by string (``setattr(engine.optim, "step_device", …)``,
  a helper's ``patch(e.replayer, "begin", …)``) and ``<expr>.__dict__``, wherever
  ``<expr>`` is an engine or one of its parts: a name or attribute called ``engine``, or
  an attribute named as one of ``Engine``'s parts (``e.replayer``, ``self.engine.acts``).
  Objects of other libraries (a Hugging Face config, a module's forward) are not the
  executor's, and patching them is not this test's business.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = sorted((ROOT / "planner").rglob("*.py")) + sorted((ROOT / "tools").rglob("*.py"))


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def executor_names(root: Path = ROOT / "executor") -> tuple[set[str], set[str], set[str]]:
    """(private names, attribute and method names, the Engine's parts) the executor defines.

    The parts are what ``Engine.__init__`` assigns to ``self`` from a constructor call
    (``self.replayer = Replayer(…)``): the objects a patch of "the engine" patches."""
    attrs: set[str] = set()
    module_level: set[str] = set()
    parts = {"engine"}
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                module_level.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                module_level |= {t.id for t in targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                attrs |= {
                    f.name
                    for f in node.body
                    if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                }
                if node.name == "Engine":
                    for sub in ast.walk(node):
                        if isinstance(sub, ast.Assign) and isinstance(sub.value, ast.Call):
                            parts |= {
                                t.attr
                                for t in sub.targets
                                if isinstance(t, ast.Attribute) and _is_self(t.value)
                            }
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for sub in ast.walk(t):
                        if isinstance(sub, ast.Attribute) and _is_self(sub.value):
                            attrs.add(sub.attr)
    private = {n for n in attrs | module_level if n.startswith("_") and not _dunder(n)}
    return private, {n for n in attrs if not _dunder(n)}, parts


def violations(source: str, filename: str, names: tuple[set[str], set[str], set[str]]) -> list[str]:
    """Each place in ``source`` that reaches past the executor's public API, as
    ``file:line: what``."""
    private, attrs, parts = names
    found = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{node.lineno}: {what}")

    def engine_part(node: ast.expr) -> bool:
        """``node`` is an engine or a part of one (see the module doc)."""
        return not _is_self(node) and any(
            (isinstance(n, ast.Attribute) and n.attr in parts)
            or (isinstance(n, ast.Name) and n.id == "engine")
            for n in ast.walk(node)
        )

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            if node.attr in private and not _is_self(node.value):
                flag(node, f"executor private `{ast.unparse(node)}`")
            elif node.attr == "__dict__" and engine_part(node.value):
                flag(node, f"`{ast.unparse(node)}` (instance patching)")
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in private
        ):
            flag(node, f"executor private named by string {node.value!r}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "protrain.executor"
        ):
            for alias in node.names:
                if alias.name in private:
                    flag(node, f"imports executor private `{alias.name}`")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = list(
                node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            )
            while targets:
                t = targets.pop()
                if isinstance(t, (ast.Tuple, ast.List)):
                    targets += t.elts
                elif isinstance(t, ast.Attribute) and engine_part(t.value):
                    flag(t, f"sets engine member `{ast.unparse(t)}` (monkeypatching)")
        elif (
            isinstance(node, ast.Call)
            and any(engine_part(a) for a in node.args)
            and any(isinstance(a, ast.Constant) and a.value in attrs for a in node.args)
        ):
            flag(node, f"names an engine member by string: `{ast.unparse(node)[:70]}`")
    return found


def test_planner_and_tools_use_only_the_engines_public_api():
    names = executor_names()
    found = [v for path in SCANNED for v in violations(path.read_text(), path.name, names)]
    assert not found, (
        "planner/tools reach into executor internals; observe with Engine.on_event "
        "(executor/events.py) or add a public method:\n  " + "\n  ".join(found)
    )


def test_the_scan_finds_what_the_old_trace_did():
    """The patterns planner/views/trace.py and planner/profiling/profile.py used before issue
    #16."""
    names = executor_names()
    assert {"replayer", "acts", "optim", "copies", "store"} <= names[2]
    old = """
def install(self, e, wrap):
    e.replayer.observer = self.observer
    e.acts.count = True
    setattr(e.optim, "submit_cpu_step", wrap(e.optim.submit_cpu_step))
    self._patch(e.optim, "_cpu_step", wrap)
    e.copies.__dict__.pop("upload", None)
    return e.optim._cpu_step
"""
    found = violations(old, "old.py", names)
    assert sorted({int(f.split(":")[1]) for f in found}) == [3, 4, 5, 6, 7, 8], found
    # ... and none of the engine's public API is flagged.
    assert not violations(
        "def f(e, cb):\n    off = e.on_event(cb)\n    e.step(b)\n    e.optim.wait_all()\n",
        "new.py",
        names,
    )


def test_every_mutant_finds_its_line():
    """tools/mutants.py edits one line of one file per mutant; a refactor that moves or rewrites
    that line leaves the mutant testing nothing (seven had drifted when this test came)."""
    from tools import mutants

    stale = [
        f"{m.name} ({m.package}/{m.file})"
        for m in mutants.MUTANTS
        if not (ROOT / m.package / m.file).is_file()
        or (ROOT / m.package / m.file).read_text().count(m.old) != 1
    ]
    assert not stale, "mutants whose line is gone (or not unique): " + "; ".join(stale)
