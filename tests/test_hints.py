"""Every ``HINT:`` names only flags that exist: the hint of each error raised in the
packages is read from the source (the hint argument of every ``...Error(message, hint)``
call) and each ``--flag`` in it is looked up on the command it names (``protrain CMD``),
or on any command when it names none. A hint that sends a user to a flag that does not
exist (``--seq-len``, ``--micro-batch``) is worse than no hint."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import click

from protrain.planner.commands.cli import main

ROOT = Path(__file__).resolve().parent.parent
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
COMMAND = re.compile(r"protrain ((?:hardware )?[a-z]+)")
# Flags of other programs that hints may name.
FOREIGN = {"--index-url", "--nproc-per-node", "--nnodes"}


def _strings(node: ast.AST) -> str:
    """The literal text of a hint expression (f-string holes become spaces)."""
    return " ".join(
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    )


def hints() -> list[tuple[str, int, str]]:
    out = []
    for path in sorted([*ROOT.glob("planner/**/*.py"), *ROOT.glob("executor/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = (
                node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            )
            if not name.endswith("Error"):
                continue
            hint = next((k.value for k in node.keywords if k.arg == "hint"), None)
            if hint is None and len(node.args) >= 2:
                hint = node.args[1]
            if hint is not None:
                out.append((path.name, node.lineno, _strings(hint)))
    return out


def _options() -> dict[str, set[str]]:
    opts = {}
    for name, cmd in main.commands.items():
        opts[name] = {o for p in cmd.get_params(click.Context(cmd)) for o in p.opts}
        for sub, subcmd in getattr(cmd, "commands", {}).items():
            opts[f"{name} {sub}"] = {
                o for p in subcmd.get_params(click.Context(subcmd)) for o in p.opts
            }
    return opts


def test_every_hint_names_existing_flags():
    opts = _options()
    everywhere = set().union(*opts.values())
    found, bad = 0, []
    for where, line, text in hints():
        flags = set(FLAG.findall(text)) - FOREIGN
        found += bool(flags)
        commands = [c for c in COMMAND.findall(text) if c in opts]
        for flag in sorted(flags):
            ok = any(flag in opts[c] for c in commands) if commands else flag in everywhere
            if not ok:
                bad.append(
                    f"{where}:{line}: {flag} "
                    f"({'on ' + ', '.join(commands) if commands else 'on no command'}): {text!r}"
                )
    assert found > 20  # the walk finds the hints (it would pass vacuously otherwise)
    assert not bad, "\n".join(bad)
