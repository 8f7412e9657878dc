"""No test outside the `bench` marker asserts a time (issue 38 point 4).

The default and slow runs check counts, solver statuses, bytes and losses; a bound on
seconds or on a measured time fails on a loaded machine without anything being wrong, so
timing checks are marked `bench` (conftest.py: skipped unless `pytest -m bench` or
PROTRAIN_BENCH=1). This test reads every test source with ``ast`` and names each
comparison outside a bench test that involves

- a clock read: ``time.perf_counter``, ``time.time``, ``time.monotonic``,
  ``time.process_time``, ``time.thread_time``, their ``_ns`` forms and
  ``timeit.default_timer``, called as ``time.X()`` or imported by name;
- a variable assigned from one, directly or through other variables in the same function
  (``t0 = time.perf_counter()``; ``dt = time.perf_counter() - t0``; ``assert dt < 1``);
- a field named like a measured duration: ``seconds``, ``elapsed``, ``wall``,
  ``*_seconds``, ``build_s``, ``run_s``, ``took_s``, ``wall_s``, ``elapsed_s``
  (``result.seconds < 1``, ``rec["seconds"] < 60``, ``float(build_s) < 10``), which is
  how a time measured elsewhere (a solver's own clock, a child process's report) arrives
  in a test. Not every ``*_s``: ``time_s`` and ``*_per_s`` are predictions and rates the
  correctness tests compare exactly.

One form is allowed: a clock compared with a variable whose name contains ``deadline``
(``while time.monotonic() < deadline``). That bounds a wait on a subprocess or a file so
that a hang fails instead of stalling the run; it is a timeout, as ``subprocess.run(...,
timeout=...)`` is, not a claim about how fast the code is.

What it cannot see: ratios of times that arrive under other names (a measured profile's
``fwd_us``, which it cannot tell from a predicted one). Those are reviewed by hand; the
six probed-CPU checks of test_moe.py and test_profile.py's stability check are bench
tests for that reason.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CLOCKS = {
    f"{name}{ns}"
    for name in ("perf_counter", "time", "monotonic", "process_time", "thread_time")
    for ns in ("", "_ns")
}
TIMING_NAME = re.compile(r"^(seconds|elapsed|wall|\w+_seconds|(build|run|took|wall|elapsed)_s)$")


def _is_bench_mark(node: ast.expr) -> bool:
    """``pytest.mark.bench`` or ``pytest.mark.bench(...)``, anywhere in the expression
    (a list assigned to ``pytestmark`` included)."""
    return any(isinstance(n, ast.Attribute) and n.attr == "bench" for n in ast.walk(node))


class _Scan:
    def __init__(self, tree: ast.Module):
        self.clock_names: set[str] = set()  # from time import perf_counter [as pc]
        self.clock_modules = {"time"}  # import time [as t]
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module in ("time", "timeit"):
                for a in n.names:
                    if a.name in CLOCKS or a.name == "default_timer":
                        self.clock_names.add(a.asname or a.name)
            elif isinstance(n, ast.Import):
                for a in n.names:
                    if a.name in ("time", "timeit"):
                        self.clock_modules.add(a.asname or a.name)

    def is_clock(self, n: ast.AST) -> bool:
        if not isinstance(n, ast.Call):
            return False
        f = n.func
        if isinstance(f, ast.Name):
            return f.id in self.clock_names
        return (
            isinstance(f, ast.Attribute)
            and isinstance(f.value, ast.Name)
            and f.value.id in self.clock_modules
            and (f.attr in CLOCKS or f.attr == "default_timer")
        )

    def tainted(self, body: list[ast.stmt]) -> set[str]:
        """Names assigned, in these statements, from a clock read or another such name."""
        names: set[str] = set()
        assigns = []
        for stmt in body:
            for n in ast.walk(stmt):
                if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and n.value:
                    targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                    assigns.append((targets, n.value))
                elif isinstance(n, ast.NamedExpr):
                    assigns.append(([n.target], n.value))
        changed = True
        while changed:
            changed = False
            for targets, value in assigns:
                if self.timed(value, names, names_only=False):
                    for t in targets:
                        for m in ast.walk(t):
                            if isinstance(m, ast.Name) and m.id not in names:
                                names.add(m.id)
                                changed = True
        return names

    def timed(self, expr: ast.AST, tainted: set[str], names_only: bool = True) -> bool:
        for n in ast.walk(expr):
            if self.is_clock(n):
                return True
            if isinstance(n, ast.Name) and n.id in tainted:
                return True
            if names_only:  # (a comparison's operands; not assignments, or `seconds=` spreads)
                if isinstance(n, ast.Name) and TIMING_NAME.match(n.id):
                    return True
                if isinstance(n, ast.Attribute) and TIMING_NAME.match(n.attr):
                    return True
                if (
                    isinstance(n, ast.Subscript)
                    and isinstance(n.slice, ast.Constant)
                    and isinstance(n.slice.value, str)
                    and TIMING_NAME.match(n.slice.value)
                ):
                    return True
        return False

    def offences(self, body: list[ast.stmt]) -> list[ast.Compare]:
        tainted = self.tainted(body)
        found = []
        for stmt in body:
            for n in ast.walk(stmt):
                if not isinstance(n, ast.Compare):
                    continue
                operands = [n.left, *n.comparators]
                if any(isinstance(o, ast.Name) and "deadline" in o.id for o in operands):
                    continue  # a wait's timeout (the module docstring)
                if any(self.timed(o, tainted) for o in operands):
                    found.append(n)
        return found


def timing_assertions(source: str, path: str = "<string>") -> list[str]:
    """``path:line: function: comparison`` for each comparison of a time outside a bench test."""
    tree = ast.parse(source)
    scan = _Scan(tree)
    module_bench = any(
        isinstance(s, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in s.targets)
        and _is_bench_mark(s.value)
        for s in tree.body
    )
    if module_bench:
        return []
    units: list[tuple[str, list[ast.stmt]]] = [
        ("<module>", [s for s in tree.body if not isinstance(s, _DEFS)])
    ]

    def visit(defs: list[ast.stmt], prefix: str) -> None:
        for d in defs:
            if not isinstance(d, _DEFS) or any(_is_bench_mark(x) for x in d.decorator_list):
                continue
            if isinstance(d, ast.ClassDef):
                visit(d.body, f"{prefix}{d.name}.")
            else:
                units.append((f"{prefix}{d.name}", d.body))

    visit(tree.body, "")
    return [
        f"{path}:{c.lineno}: {name}: {ast.unparse(c)}"
        for name, body in units
        for c in scan.offences(body)
    ]


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def test_no_test_outside_bench_compares_a_time():
    found = [
        hit
        for path in sorted(TESTS.rglob("*.py"))
        for hit in timing_assertions(path.read_text(), str(path.relative_to(TESTS.parent)))
    ]
    assert not found, (
        "timing assertions outside the `bench` marker (mark the test @pytest.mark.bench, "
        "keeping its counts, statuses and bytes in a test the default or slow run keeps):\n"
        + "\n".join(found)
    )


def test_the_scan_names_each_form_of_a_timing_check():
    # What tests/ held before issue 38 point 4, in small, and what stays allowed.
    source = textwrap.dedent(
        """
        import time
        import pytest
        from time import perf_counter as pc

        def test_clock_inline():
            t0 = time.perf_counter()
            run()
            assert time.perf_counter() - t0 < 20

        def test_clock_through_variables():
            t0 = pc()
            run()
            took = pc() - t0
            ms = took * 1000
            assert ms < 5

        def test_reported_seconds(result, rec, text):
            assert result.status == "optimal" and result.seconds < 1.0
            assert rec["seconds"] < 60
            seconds, message = text.split("\\n", 1)
            assert float(seconds) < 25.0
            build_s, rss = text.split()
            assert float(build_s) < 10.0 and int(rss) < 2**30

        class TestGrouped:
            def test_ns(self):
                t = time.monotonic_ns()
                assert time.monotonic_ns() - t <= 10**9

        def helper_that_checks():
            start = time.process_time()
            return time.process_time() - start > 1

        @pytest.mark.bench
        def test_timed_on_purpose():
            t0 = time.perf_counter()
            assert time.perf_counter() - t0 < 1

        @pytest.mark.bench
        class TestBench:
            def test_in_a_bench_class(self, result):
                assert result.seconds < 1

        def test_a_wait_with_a_deadline(proc):
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.05)
            assert proc.returncode == 0

        def test_timing_printed_not_asserted(capsys, counts):
            t0 = time.perf_counter()
            print(f"{time.perf_counter() - t0:.1f} s")
            assert counts == [1, 2] and len(counts) < 3

        def test_timedelta_keyword(datetime):
            assert datetime.timedelta(seconds=20).total_seconds
        """
    )
    hits = timing_assertions(source)
    named = [h.split(": ")[1] for h in hits]
    assert named == [
        "test_clock_inline",
        "test_clock_through_variables",
        "test_reported_seconds",
        "test_reported_seconds",
        "test_reported_seconds",
        "test_reported_seconds",
        "TestGrouped.test_ns",
        "helper_that_checks",
    ], hits
    bench_module = "import pytest, time\npytestmark = [pytest.mark.bench]\n" + textwrap.dedent(
        """
        def test_anything():
            t0 = time.time()
            assert time.time() - t0 < 1
        """
    )
    assert timing_assertions(bench_module) == []
