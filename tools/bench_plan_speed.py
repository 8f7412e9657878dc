"""Planning speed, side by side with an earlier commit: ``make_plan`` and ``protrain fit``.

All trees (one or more baselines and this one) run in one invocation, on this machine,
interleaved (baseline, current, baseline, current, ...) so that drift and load land on all
alike; each figure is a median with its spread, and the ratio is baseline / current (above 1:
this tree is faster).

- ``make_plan`` on the committed analytic profiles (``plans/profiles``: llama-70b on
  a100-80g and rtx4090, gpt2-xl on rtx3090, mistral-7b on h100) at the card's usable
  memory, host budget 4 TiB (so the host never binds and the search itself is timed), in a
  fresh process per tree that times ``--repeats`` calls after one warm-up call; and, of
  each call, the time spent in the exhaustive searches (``planning.SOLVERS["exhaustive"]``,
  wrapped: every chunk-size candidate's search, without building terms or emitting the plan).
  Each timed call starts with the planner's caches emptied (``search.grid._policy_grid``,
  ``search.layout._layout``, ``profiling.profile._version``; before the move ``grid``/``cost._chunk_need``), so it pays for its grids, their
  strip-only terms and its chunk layouts as a fresh ``protrain plan`` process does, not a
  previous call's.
- ``protrain fit --hardware rtx3090`` (both families' ladders), wall time of the command and
  its CPU time (user + system, from the children's rusage).

The baseline tree is exported with ``git archive`` into a temporary directory and installed
there (``pip install --no-deps -e``, in a virtual environment that sees this one's packages),
so nothing of this checkout is touched.

    python tools/bench_plan_speed.py                    # print the table (baseline 754c22f)
    python tools/bench_plan_speed.py --write            # and update BENCHMARKS.md
    python tools/bench_plan_speed.py --baseline HEAD~1  # against another commit
    python tools/bench_plan_speed.py --baseline 754c22f --baseline main --write  # both, one table
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
SECTION = "## Planning speed against {rev} (tools/bench_plan_speed.py)"

CASES = (
    ("llama-70b", "a100-80g", "plans/profiles/llama-70b/llama-70b-a100-80g-b1-s4096.json"),
    ("llama-70b", "rtx4090", "plans/profiles/llama-70b/llama-70b-rtx4090-b1-s4096.json"),
    ("gpt2-xl", "rtx3090", "plans/profiles/gpt2-xl/gpt2-xl-rtx3090-b8-s1024.json"),
    ("mistral-7b", "h100", "plans/profiles/mistral-7b/mistral-7b-h100-b4-s2048.json"),
)
HOST_BUDGET = 4 << 40

WORKER = r"""
import json, sys, time
import msgspec
try:  # the planner by concern (sub-packages), or a tree from before that move
    from protrain.planner.profiling.profile import Profile
    from protrain.planner.search import planning
except ImportError:
    from protrain.planner.profile import Profile
    from protrain.planner import planning
root, path, repeats, HOST_BUDGET = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prof = msgspec.json.decode(open(root + "/" + path, "rb").read(), type=Profile)
budget = prof.hardware.usable_memory_bytes
inner = planning.SOLVERS["exhaustive"]  # (both trees: the dict make_plan reads)
caches = []  # a fresh process's caches for each timed call (in the trees that have them)
for module, name in (("search.grid", "_policy_grid"), ("search.layout", "_layout"),  # (the planner by concern)
                     ("profiling.profile", "_version"),  # (the installed version, looked up once per process)
                     ("grid", "_policy_grid"), ("cost", "_chunk_need")):  # (trees before that move)
    try:
        caches.append(getattr(__import__("protrain.planner." + module, fromlist=[name]), name).cache_clear)
    except (ImportError, AttributeError):
        pass
def clear():
    for c in caches:
        c()
spent = [0.0, 0.0]
def timed(*a, **k):
    t, c = time.perf_counter(), time.process_time()
    try:
        return inner(*a, **k)
    finally:
        spent[0] += time.perf_counter() - t
        spent[1] += time.process_time() - c
planning.SOLVERS["exhaustive"] = timed
def run():
    planning.make_plan(prof, budget, host_budget_bytes=HOST_BUDGET)
run()  # warm-up: imports, caches
plan, search, plan_cpu, search_cpu = [], [], [], []
for _ in range(repeats):
    spent[0] = spent[1] = 0.0
    clear()
    t, c = time.perf_counter(), time.process_time()
    run()
    plan.append(time.perf_counter() - t); plan_cpu.append(time.process_time() - c)
    search.append(spent[0]); search_cpu.append(spent[1])
print("TIMES " + json.dumps([plan, search, plan_cpu, search_cpu]))
"""


def export_tree(rev: str, into: Path) -> Path:
    """``rev``'s tree under ``into``/tree, installed into ``into``/venv; the venv's python."""
    tree = into / "tree"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    venv = into / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "-e", str(tree)],
        check=True,
        capture_output=True,
    )
    where = subprocess.run(
        [str(py), "-c", "import protrain.planner as p; print(p.__file__)"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert where.startswith(str(tree)), f"the baseline venv imports {where}, not {tree}"
    return py


def time_plan(py: Path, root: Path, path: str, repeats: int) -> list[list[float]]:
    """``[make_plan seconds per call, seconds of those in the exhaustive search]``, wall clock,
    then the same in CPU seconds of the process (``time.process_time``)."""
    out = subprocess.run(
        [str(py), "-c", WORKER, str(root), path, str(repeats), str(HOST_BUDGET)],
        capture_output=True,
        text=True,
        cwd=root,
    )
    if out.returncode:
        raise RuntimeError(f"{py} on {path}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.split("TIMES ", 1)[1])


def time_fit(py: Path, root: Path) -> tuple[float, float]:
    """Wall seconds of the command, and its CPU seconds (user + system)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    cli = "protrain.planner.cli" if (root / "planner" / "cli.py").exists() else "protrain.planner"
    out = subprocess.run(
        [str(py), "-m", cli, "fit", "--hardware", "rtx3090"],
        capture_output=True,
        text=True,
        cwd=root,
    )
    if out.returncode:
        raise RuntimeError(f"fit with {py}: {out.stderr[-2000:]}")
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def others_running() -> int:
    """Processes running or runnable on this box now, outside this benchmark's session (the
    trees it times run in it): what shares the cores with the timed ones."""
    mine, n = os.getsid(0), 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            n += fields[0] == "R" and int(fields[3]) != mine  # (state, ..., session)
    return n


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} s ({min(xs):.3f}-{max(xs):.3f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--baseline",
        action="append",
        help="commit to compare against (default 754c22f); repeat for several, all in one table",
    )
    ap.add_argument(
        "--repeats", type=int, default=3, help="timed make_plan calls per process (default 3)"
    )
    ap.add_argument(
        "--rounds", type=int, default=3, help="interleaved processes per tree (default 3)"
    )
    ap.add_argument(
        "--fit-rounds", type=int, default=3, help="interleaved fit runs per tree (default 3)"
    )
    ap.add_argument("--write", action="store_true", help=f"update {BENCHMARKS_MD.name}")
    args = ap.parse_args(argv)

    def short(rev: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", rev],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()

    revs = [short(r) for r in (args.baseline or ["754c22f"])]
    head = short("HEAD")
    dirty = bool(
        subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    current = f"{head}{'+' if dirty else ''}"
    names = [*revs, current]
    load_before = os.getloadavg()
    busy = [others_running()]  # sampled before each timed process
    rows = []
    with tempfile.TemporaryDirectory(prefix="protrain-baseline-") as tmp:
        trees = []
        for rev in revs:
            (Path(tmp) / rev).mkdir()
            trees.append((rev, export_tree(rev, Path(tmp) / rev), Path(tmp) / rev / "tree"))
        trees.append((current, Path(sys.executable), ROOT))
        for model, hw, path in CASES:
            got = {name: ([], [], [], []) for name in names}
            for _ in range(args.rounds):
                for name, py, root in trees:
                    busy.append(others_running())
                    for mine, times in zip(got[name], time_plan(py, root, path, args.repeats)):
                        mine.extend(times)
            for i, what in enumerate(
                ("make_plan", "its searches", "make_plan, CPU time", "its searches, CPU time")
            ):
                label = f"{what}, {model} / {hw}"
                rows.append((label, [got[n][i] for n in names]))
                print(
                    f"{label}: " + ", ".join(f"{n} {spread(got[n][i])}" for n in names), flush=True
                )
        got = {name: ([], []) for name in names}
        for _ in range(args.fit_rounds):
            for name, py, root in trees:
                busy.append(others_running())
                for mine, t in zip(got[name], time_fit(py, root)):
                    mine.append(t)
        rows.append(("`protrain fit --hardware rtx3090`", [got[n][0] for n in names]))
        rows.append(("`protrain fit --hardware rtx3090`, CPU time", [got[n][1] for n in names]))
        print(
            "fit: "
            + ", ".join(f"{n} {spread(got[n][0])} (CPU {spread(got[n][1])})" for n in names),
            flush=True,
        )
    load_after = os.getloadavg()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "python tools/bench_plan_speed.py " + " ".join(
        shlex.quote(a) for a in (argv or sys.argv[1:])
    )
    section = SECTION.format(rev=" and ".join(revs))
    lines = [
        section,
        "",
        f"Command: `{cmd.strip()}`; machine: {os.cpu_count()}-core CPU box ({sys.platform}), "
        f"{when}; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after (1 min; the "
        f"box is shared: other processes running at {len(busy)} samples, median "
        f"{statistics.median(busy):g}, max {max(busy)}); baseline{'s' if len(revs) > 1 else ''} "
        f"{', '.join(revs)}, this tree {current}. Each figure: median (min-max) over {args.rounds} "
        f"processes x {args.repeats} calls (after a warm-up call in each, each timed call with the "
        f"planner's caches emptied), trees interleaved in one run; fit: {args.fit_rounds} runs of "
        "the whole command each. Wall clock, and CPU time (the process's user + system seconds: "
        "what the work costs when other jobs share the cores). Ratio: baseline / this (above 1: "
        "faster now).",
        "",
        "| what | " + " | ".join(names) + " | " + " | ".join(f"ratio {r}" for r in revs) + " |",
        "|---|" + "---|" * (len(names) + len(revs)),
    ]
    for label, per in rows:
        this = statistics.median(per[-1])
        lines.append(
            f"| {label} | "
            + " | ".join(spread(xs) for xs in per)
            + " | "
            + " | ".join(f"{statistics.median(xs) / this:.2f}x" for xs in per[:-1])
            + " |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        md = BENCHMARKS_MD.read_text()
        if section in md:
            a = md.index(section)
            b = md.find("\n## ", a + len(section))
            md = (
                md[:a] + text + ("\n" + md[b + 1 :] if b >= 0 else "")
            )  # (a blank line before the next section)
        else:
            md = md.rstrip() + "\n\n" + text
        BENCHMARKS_MD.write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
