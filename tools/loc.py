"""Count code lines (no blank lines, comments or docstrings) per package, like tinygrad's sz.py.

Counted on the tree as it is: `.ci/run` checks it is `ruff format`ted (100 columns), so a
line is a formatted line and packing code onto fewer lines buys nothing. Budgets: the
executor (the runtime, small enough to audit and to import fast on every rank) at most
3,000 code lines, the plan contract (plans/) at most 1,100; tests/test_loc.py asserts both.
Also printed: the comment+docstring ratio per package.

    python tools/loc.py
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def count(path: Path) -> tuple[int, int]:
    """(code lines, comment + docstring lines) of one Python file."""
    src = path.read_text()
    doc_lines: set[int] = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                doc_lines.update(range(body[0].lineno, body[0].end_lineno + 1))
        # Attribute docstrings (a string statement after a field), as plan.py uses.
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            doc_lines.update(range(node.lineno, node.end_lineno + 1))
    comment_lines: set[int] = set()
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comment_lines.add(tok.start[0])
        elif tok.type not in (
            tokenize.NL,
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.ENDMARKER,
        ):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    code = code_lines - doc_lines
    return len(code), len(comment_lines | (doc_lines - code))


BUDGETS = {"executor": 3000, "plans": 1100}
"""Formatted code lines each package may hold."""


def package_lines(pkg: str) -> int:
    """Code lines of one package (its top-level .py files and below)."""
    return sum(count(p)[0] for p in sorted((ROOT / pkg).rglob("*.py")))


def main() -> int:
    total = {}
    for pkg in ("plans", "executor", "planner"):
        rows = [
            (str(p.relative_to(ROOT / pkg)), *count(p)) for p in sorted((ROOT / pkg).rglob("*.py"))
        ]
        code = sum(r[1] for r in rows)
        notes = sum(r[2] for r in rows)
        total[pkg] = code
        print(
            f"{pkg}/  {code} code lines, {notes} comment+doc lines ({notes / max(code, 1):.2f} per "
            "code line)"
        )
        for name, c, n in rows:
            print(f"  {name:<26} {c:5d} {n:5d}")
    for pkg, budget in BUDGETS.items():
        print(f"{pkg} budget: {total[pkg]} / {budget} code lines")
    return 0 if all(total[p] <= b for p, b in BUDGETS.items()) else 1


if __name__ == "__main__":
    sys.exit(main())
