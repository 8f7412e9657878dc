"""How the probed-CPU timing checks of tests/test_moe.py read from run to run on this machine.

Each run is a fresh process that calls the tests' fixture (``probed_block_us``: the spec
probed every 4 of 12 interleaved rounds, the blocks measured in them, one thread, the
thread's CPU clock) and prints, per model, the analytic time over the measured one
(forward, backward), the MoE over its dense twin (analytic over the median of pairs
measured back to back), the host's median ``Tensor.view`` time, and whether the absolute
checks would run or skip there (``_calibrated``). The summary gives each figure's range
over the runs whose absolute checks ran, and the paired ones over all.

    python tools/bench_moe_spread.py --runs 6           # print
    python tools/bench_moe_spread.py --runs 6 --write   # and replace its section of BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Probed-CPU timing checks, run to run (tools/bench_moe_spread.py)"
ONE_RUN = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import test_moe as T
spec, times, host, paired = T.probed_block_us.__wrapped__()
print(json.dumps({
    "gflops": spec.matmul_fp32_flops_per_s / 1e9, "host_ns": host,
    "skip": host > T.SLOW_HOST * T.CAL_HOST_NS,
    "ratios": {n: [a[i] / m[i] for i in (0, 1)] for n, (a, m) in times.items()},
    "paired": [times["moe"][0][i] / times["dense"][0][i] / paired[i] for i in (0, 1)],
}))
"""


def span(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}x" if xs else "n/a"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument(
        "--write", action="store_true", help="replace this tool's section of BENCHMARKS.md"
    )
    args = ap.parse_args(argv)
    runs = []
    for i in range(args.runs):
        out = subprocess.run(
            [sys.executable, "-c", ONE_RUN, str(ROOT / "tests")],
            capture_output=True,
            text=True,
            check=True,
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
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
        SECTION,
        "",
        "Command: `python tools/bench_moe_spread.py --runs "
        f"{args.runs}{' --write' if args.write else ''}`; machine: {os.cpu_count()}-core CPU box "
        f"({sys.platform}), {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. "
        f"{len(runs)} runs, {len(runs) - len(ran)} with the absolute checks skipped (host median "
        "over 1.2x the calibration box's 1,100 ns); probes "
        f"{min(r['gflops'] for r in runs):.0f}-{max(r['gflops'] for r in runs):.0f} GFLOP/s, host "
        f"medians {min(r['host_ns'] for r in runs):.0f}-{max(r['host_ns'] for r in runs):.0f} ns. "
        "Analytic over measured, min-max over the runs (the absolute ones over the runs that ran "
        "them); the checks' bound is 0.75-1.25x.",
        "",
        "| check | range |",
        "|---|---|",
        *(f"| {a} | {b} |" for a, b in rows),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        md_path = ROOT / "BENCHMARKS.md"
        md = md_path.read_text()
        if SECTION in md:
            a = md.index(SECTION)
            b = md.find("\n## ", a + len(SECTION))
            md = md[:a] + text + ("\n" + md[b + 1 :] if b >= 0 else "")
        else:
            md = md.rstrip() + "\n\n" + text
        md_path.write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
