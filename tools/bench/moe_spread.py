"""How the probed-CPU timing checks of tests/test_moe.py read from run to run on this machine.

Each run is a fresh process that calls the tests' fixture (``probed_block_us``: the spec
probed every 4 of 12 interleaved rounds, the blocks measured in them, one thread, the
thread's CPU clock) and prints, per model, the analytic time over the measured one
(forward, backward), the MoE over its dense twin (analytic over the median of pairs
measured back to back), the host's median ``Tensor.view`` time, and whether the absolute
checks would run or skip there (``_calibrated``). The summary gives each figure's range
over the runs whose absolute checks ran, and the paired ones over all.

What it measures is the tests' own fixture, so it gets it the way the tests do: each run is
``pytest --collect-only tests/test_moe.py`` with this module as a plugin (``-p``), whose
collection hook calls the collected module's fixture and writes its figures to a file.
Nothing here imports from tests/.

    python -m tools.bench moe-spread --rounds 6           # print
    python -m tools.bench moe-spread --rounds 6 --write   # and replace its section of BENCHMARKS.md
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.bench import harness

OUT_ENV = "PROTRAIN_MOE_SPREAD_OUT"


def pytest_collection_modifyitems(session, config, items):
    """The plugin's one hook (``-p tools.bench.moe_spread``, with ``$PROTRAIN_MOE_SPREAD_OUT``
    set): one call of test_moe's ``probed_block_us``, its figures to that file, no test run."""
    out = os.environ.get(OUT_ENV)
    if not out:
        return
    T = next(item.module for item in items if item.module.__name__.endswith("test_moe"))
    spec, times, host, paired = T.probed_block_us.__wrapped__()
    Path(out).write_text(
        json.dumps(
            {
                "gflops": spec.matmul_fp32_flops_per_s / 1e9,
                "host_ns": host,
                "skip": host > T.SLOW_HOST * T.CAL_HOST_NS,
                "ratios": {n: [a[i] / m[i] for i in (0, 1)] for n, (a, m) in times.items()},
                "paired": [times["moe"][0][i] / times["dense"][0][i] / paired[i] for i in (0, 1)],
            }
        )
    )
    items[:] = []


def one_run() -> dict:
    with tempfile.TemporaryDirectory(prefix="moe-spread-") as tmp:
        out = Path(tmp) / "run.json"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-n0",
                "--collect-only",
                "-p",
                "no:cacheprovider",
            ]
            + ["-p", "tools.bench.moe_spread", str(harness.ROOT / "tests" / "test_moe.py")],
            cwd=harness.ROOT,
            env={**os.environ, OUT_ENV: str(out)},
            capture_output=True,
            text=True,
        )
        if not out.exists():  # (pytest exits 5, "no tests collected", when the hook did its work)
            raise RuntimeError(
                f"test_moe's fixture did not run:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            )
        return json.loads(out.read_text())


def span(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}x" if xs else "n/a"


def main(argv: list[str] | None = None, name: str = "moe-spread") -> int:
    ap = harness.parser(name, __doc__, rounds=6, what="runs, each a fresh process")
    args = ap.parse_args(argv)
    harness.no_baseline(ap, args)
    runs = []
    for i in range(args.rounds):
        r = one_run()
        runs.append(r)
        print(
            f"run {i + 1}: {r['gflops']:.0f} GFLOP/s, host {r['host_ns']:.0f} ns "
            f"({'absolute checks skip' if r['skip'] else 'absolute checks run'}); "
            + "; ".join(f"{n} {f:.2f}x / {b:.2f}x" for n, (f, b) in r["ratios"].items())
            + f"; MoE/dense paired {r['paired'][0]:.2f}x / {r['paired'][1]:.2f}x",
            flush=True,
        )
    ran = [r for r in runs if not r["skip"]]
    rows = [
        (f"{n} {phase}, absolute", span([r["ratios"][n][i] for r in ran]))
        for n in runs[0]["ratios"]
        for i, phase in enumerate(("forward", "backward"))
    ]
    rows += [
        (f"MoE/dense {phase}, paired", span([r["paired"][i] for r in runs]))
        for i, phase in enumerate(("forward", "backward"))
    ]
    lines = [
        harness.heading(name),
        "",
        f"Command: `{harness.command(name, argv)}`; machine: {os.cpu_count()}-core CPU box "
        f"({sys.platform}), {harness.now()}. {len(runs)} runs, {len(runs) - len(ran)} with the "
        "absolute checks skipped (host median over 1.2x the calibration box's 1,100 ns); probes "
        f"{min(r['gflops'] for r in runs):.0f}-{max(r['gflops'] for r in runs):.0f} GFLOP/s, host "
        f"medians {min(r['host_ns'] for r in runs):.0f}-{max(r['host_ns'] for r in runs):.0f} ns. "
        "Analytic over measured, min-max over the runs (the absolute ones over the runs that ran "
        "them); the checks' bound is 0.75-1.25x.",
        "",
        "| check | range |",
        "|---|---|",
        *(f"| {a} | {b} |" for a, b in rows),
    ]
    return harness.emit(name, "\n".join(lines) + "\n", args.write)
