"""Planning speed, side by side with earlier commits: ``make_plan`` and ``protrain fit``.

All trees (each ``--baseline REF`` and this one) run in one invocation, on this machine,
interleaved by the harness (baseline, current, baseline, current, ...; a fresh process per
tree and round) so that drift and load land on all alike; each figure is a median with its
spread, and the ratio is baseline / current (above 1: this tree is faster).

- ``make_plan`` on the committed analytic profiles (``plans/profiles``: llama-70b on
  a100-80g and rtx4090, gpt2-xl on rtx3090, mistral-7b on h100; each tree's own file) at
  the card's usable memory, host budget 4 TiB (so the host never binds and the search
  itself is timed): ``--calls`` timed calls per round after one warm-up call; and, of each
  call, the time spent in the exhaustive searches (``planning.SOLVERS["exhaustive"]``,
  wrapped: every chunk-size candidate's search, without building terms or emitting the
  plan). Each timed call starts with the planner's caches emptied (``search.grid._policy_grid``,
  ``search.layout._layout``, ``profiling.profile._version``; before the move
  ``grid``/``cost._chunk_need``), so it pays for its grids, their strip-only terms and its
  chunk layouts as a fresh ``protrain plan`` process does, not a previous call's.
- ``protrain fit --hardware rtx3090`` (both families' ladders), once per round: wall time
  of the command and its CPU time (user + system, from the children's rusage).

    python -m tools.bench plan-speed                                  # this tree alone
    python -m tools.bench plan-speed --baseline 754c22f --write        # against a commit
    python -m tools.bench plan-speed --baseline 754c22f --baseline main --rounds 4 --write
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from tools.bench import harness

CASES = (
    ("llama-70b", "a100-80g", "plans/profiles/llama-70b/llama-70b-a100-80g-b1-s4096.json"),
    ("llama-70b", "rtx4090", "plans/profiles/llama-70b/llama-70b-rtx4090-b1-s4096.json"),
    ("gpt2-xl", "rtx3090", "plans/profiles/gpt2-xl/gpt2-xl-rtx3090-b8-s1024.json"),
    ("mistral-7b", "h100", "plans/profiles/mistral-7b/mistral-7b-h100-b4-s2048.json"),
)
HOST_BUDGET = 4 << 40
CACHES = (  # (module under protrain.planner, cached function): a fresh process's caches
    ("search.grid", "_policy_grid"),  # (the planner by concern)
    ("search.layout", "_layout"),
    ("profiling.profile", "_version"),  # (the installed version, looked up once per process)
    ("search.emit", "_version"),  # (trees before it moved to profiling)
    ("grid", "_policy_grid"),  # (trees before that move)
    ("cost", "_chunk_need"),
)


def tree_root() -> Path:
    """The checkout whose ``protrain`` this process imports (a baseline's, under --baseline)."""
    import protrain.planner

    return Path(protrain.planner.__file__).resolve().parents[1]


def time_plans(calls: int) -> dict[str, list[float]]:
    """Per case: make_plan seconds per call and the seconds of those in the exhaustive search,
    wall clock, then the same in CPU seconds of the process (``time.process_time``)."""
    import msgspec

    try:  # the planner by concern (sub-packages), or a tree from before that move
        from protrain.planner.profiling.profile import Profile
        from protrain.planner.search import planning
    except ImportError:
        from protrain.planner import planning
        from protrain.planner.profile import Profile

    clears = []
    for module, fn in CACHES:
        try:
            clears.append(
                getattr(importlib.import_module("protrain.planner." + module), fn).cache_clear
            )
        except (ImportError, AttributeError):
            pass
    inner = planning.SOLVERS["exhaustive"]  # (every tree: the dict make_plan reads)
    spent = [0.0, 0.0]

    def timed(*a, **k):
        t, c = time.perf_counter(), time.process_time()
        try:
            return inner(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t
            spent[1] += time.process_time() - c

    planning.SOLVERS["exhaustive"] = timed
    out: dict[str, list[float]] = {}
    root = tree_root()
    try:
        for model, hw, path in CASES:
            prof = msgspec.json.decode((root / path).read_bytes(), type=Profile)
            budget = prof.hardware.usable_memory_bytes

            def run(prof=prof, budget=budget):
                planning.make_plan(prof, budget, host_budget_bytes=HOST_BUDGET)

            run()  # warm-up: imports, caches
            got: list[list[float]] = [[], [], [], []]
            for _ in range(calls):
                spent[0] = spent[1] = 0.0
                for clear in clears:
                    clear()
                t, c = time.perf_counter(), time.process_time()
                run()
                for xs, x in zip(
                    got, (time.perf_counter() - t, spent[0], time.process_time() - c, spent[1])
                ):
                    xs.append(x)
            for what, xs in zip(
                ("make_plan", "its searches", "make_plan, CPU time", "its searches, CPU time"), got
            ):
                out[f"{what}, {model} / {hw}"] = xs
    finally:
        planning.SOLVERS["exhaustive"] = inner
    return out


def time_fit() -> dict[str, list[float]]:
    """Wall seconds of ``protrain fit --hardware rtx3090``, and its CPU seconds (user + system)."""
    cli = next(
        m
        for m in ("protrain.planner.commands.cli", "protrain.planner.cli", "protrain.planner")
        if importlib.util.find_spec(m) is not None
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", cli, "fit", "--hardware", "rtx3090"],
        capture_output=True,
        text=True,
        cwd=tree_root(),
    )
    if out.returncode:
        raise RuntimeError(f"fit: {out.stderr[-2000:]}")
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "`protrain fit --hardware rtx3090`": [wall],
        "`protrain fit --hardware rtx3090`, CPU time": [cpu],
    }


def main(argv: list[str] | None = None, name: str = "plan-speed") -> int:
    ap = harness.parser(name, __doc__, rounds=3, what="interleaved processes per tree")
    ap.add_argument(
        "--calls", type=int, default=3, help="timed make_plan calls per case and round (default 3)"
    )
    ap.add_argument(
        "--no-fit", action="store_true", help="leave out `protrain fit` (the slow part)"
    )
    args = ap.parse_args(argv)

    def samples() -> dict[str, list[float]]:
        out = time_plans(args.calls)
        if not args.no_fit:
            out.update(time_fit())
        return out

    load_before = os.getloadavg()
    busy = [harness.others_running()]
    got = harness.samples_main(name, args, argv, samples)
    if got is None:  # (a worker process of the comparison)
        return 0
    busy.append(harness.others_running())
    load_after = os.getloadavg()
    *revs, current = got
    text = "\n".join(
        [
            harness.heading(name),
            "",
            (
                f"Command: `{harness.command(name, argv)}`; machine: {harness.machine()}; "
                f"{harness.now()}; load average {load_before[0]:.2f} before, {load_after[0]:.2f} "
                "after (1 min; the box is shared: other processes running before and after, "
                f"{busy[0]} and {busy[1]}); "
            )
            + (f"baseline{'s' if len(revs) > 1 else ''} {', '.join(revs)}, " if revs else "")
            + (
                f"this tree {current}. Each figure: median (min-max) over {args.rounds} processes "
                f"x {args.calls} calls (after a warm-up call in each, each timed call with the "
                "planner's caches emptied), trees interleaved in one run; fit: one run of the "
                "whole command per process. Wall clock, and CPU time (the process's user + system "
                "seconds: what the work costs when other jobs share the cores)."
            )
            + (" Ratio: baseline / this (above 1: faster now)." if revs else ""),
            "",
            harness.compare_table(got),
            "",
        ]
    )
    return harness.emit(name, text, args.write)
