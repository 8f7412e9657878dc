"""Size budgets, counted on `ruff format`ted code by tools/loc.py: the executor at most 3,000
code lines, the plan contract (plans/) at most 1,100.

Code lines are lines holding a token that is neither a comment nor part of a docstring
(tools/loc.py ``count``). `.ci/run` checks the tree is formatted first, so the count
measures code, not how densely it is packed. The executor stays small enough to audit and to
import fast on every rank; the contract small enough to read as the file format's definition.
"""

from __future__ import annotations

import pytest

from tools import loc


@pytest.mark.parametrize("package", sorted(loc.BUDGETS))
def test_package_within_its_budget(package):
    n, budget = loc.package_lines(package), loc.BUDGETS[package]
    assert n <= budget, (
        f"{package}/ has {n} code lines, over its budget of {budget} "
        "(python tools/loc.py lists them per file): what decision or duplicate crept in?"
    )


def test_count_ignores_comments_docstrings_and_blank_lines(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        '"""Doc."""\n\n# a comment\nx = 1  # trailing\n\n\ndef f():\n    """Doc."""\n    return '
        "(\n        x\n    )\n"
    )
    assert loc.count(f) == (5, 4)  # the trailing comment shares its line with code
