"""Import rules (README "Layout"), checked in fresh subprocesses with an import tracker.

The executor never imports the planner or the planner's heavy dependencies; the
plan schema and the plan tools never import torch (click's test_light_imports).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TRACKER = """
import builtins, json, sys
seen = set()
direct = {{}}  # protrain module -> top-level names it imports itself
real_import = builtins.__import__
def tracking(name, globals=None, locals=None, fromlist=(), level=0):
    mod = real_import(name, globals, locals, fromlist, level)
    seen.add(mod.__name__)
    importer = (globals or {{}}).get("__name__", "")
    if importer.startswith("protrain.") and level == 0:
        direct.setdefault(importer, set()).add(name)
    return mod
builtins.__import__ = tracking
{body}
print("DIRECT:" + json.dumps({{k: sorted(v) for k, v in direct.items()}}))
print("IMPORTED:" + json.dumps(sorted(seen | set(sys.modules))))
"""


def imported(body: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", TRACKER.format(body=body)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = [x for x in out.splitlines() if x.startswith("IMPORTED:")][-1]
    return {
        m.split(".")[0] if not m.startswith("protrain.") else m
        for m in json.loads(line.removeprefix("IMPORTED:"))
    }


HEAVY = {"torch", "numpy", "scipy", "networkx", "pynvml", "click", "rich"}


PLANS = sorted(
    "protrain.plans" + ("" if p.stem == "__init__" else f".{p.stem}")
    for p in (Path(__file__).resolve().parent.parent / "plans").glob("*.py")
)


@pytest.mark.parametrize("module", [*PLANS, "protrain.executor"])
def test_contract_modules_import_only_stdlib_and_msgspec(module):
    """The plan contract (every module of ``protrain.plans``) and the executor's package face
    load neither torch nor numpy; the contract imports neither the executor nor the planner."""
    mods = imported(f"import {module}")
    assert not mods & HEAVY, sorted(mods & HEAVY)
    assert not any(m.startswith("protrain.planner") for m in mods)
    if module.startswith("protrain.plans"):
        assert not any(m.startswith("protrain.executor") for m in mods), module


def test_the_contract_face():
    """``from protrain.plans import load, dump, Plan, SCHEMA_VERSION, PlanError`` is the face."""
    from protrain import plans

    assert set(plans.__all__) == {"load", "dump", "Plan", "SCHEMA_VERSION", "PlanError"}
    plan = plans.load(EXAMPLE)
    assert isinstance(plan, plans.Plan) and plan.schema_version == plans.SCHEMA_VERSION
    assert plans.dump(plan) == EXAMPLE.read_bytes()
    with pytest.raises(plans.PlanError):
        plans.load(b"{}")


def direct_imports(body: str) -> dict[str, set[str]]:
    """protrain module → the names it imports itself (not what its imports pull in)."""
    out = subprocess.run(
        [sys.executable, "-c", TRACKER.format(body=body)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = [x for x in out.splitlines() if x.startswith("DIRECT:")][-1]
    return {k: set(v) for k, v in json.loads(line.removeprefix("DIRECT:")).items()}


def test_executor_runtime_never_imports_the_planner():
    # torch itself may import pynvml (it does, for CUDA memory queries), so the rule is
    # checked on what executor modules import themselves.
    mods = imported("import protrain.executor.check")
    assert "torch" in mods
    assert not any(m.startswith("protrain.planner") for m in mods)
    forbidden = {"scipy", "networkx", "pynvml", "click", "rich", "numpy"}
    for module, names in direct_imports("import protrain.executor.check").items():
        if module.startswith("protrain.executor"):
            tops = {n.split(".")[0] for n in names}
            assert not tops & forbidden, (module, tops & forbidden)
            assert not any(n.startswith("protrain.planner") for n in names), module


EXAMPLE = Path(__file__).resolve().parent.parent / "plans" / "gpt2-tiny" / "example.json"
OTHER = Path(__file__).resolve().parent.parent / "plans" / "gpt2-xl" / "a100-80g-w1.json"


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["show", str(EXAMPLE)],
        ["diff", str(EXAMPLE), str(OTHER)],
        ["validate", str(EXAMPLE)],
        ["explain", str(EXAMPLE)],
    ],
)
def test_cli_paths_without_torch(argv):
    """The plan tools on a committed plan load neither torch, numpy nor the runtime."""
    mods = imported(
        f"import sys; sys.argv = ['protrain', *{argv!r}]\n"
        "from protrain.planner.commands.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass"
    )
    assert "torch" not in mods and "numpy" not in mods
    assert not any(m.startswith("protrain.executor") for m in mods), sorted(
        m for m in mods if m.startswith("protrain.executor")
    )


def test_report_is_torch_free():
    assert "torch" not in imported("import protrain.planner.views.show")


def test_planner_face_is_lazy_and_complete():
    """``protrain.planner`` is the public face: importing it loads no torch, scipy or
    networkx, and each exported name resolves to the object its sub-package defines."""
    mods = imported("import protrain.planner")
    assert not {"torch", "scipy", "networkx"} & mods
    import importlib

    import protrain.planner as face

    for name in face.__all__:
        where = importlib.import_module(f"protrain.planner.{face._EXPORTS[name]}")
        assert getattr(face, name) is getattr(where, name), name
    assert set(dir(face)) >= set(face.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        face.nope  # noqa: B018
