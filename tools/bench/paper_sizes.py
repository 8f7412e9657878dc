"""The largest GPT-2 `protrain fit` plans on the ProTrain paper's servers, against its Table 2.

The paper (arXiv 2406.08334, Table 2) reports the largest GPT-2 it trains on an RTX
3090 server with 384 GiB of host RAM and an A100-80G server with 1 TiB, at one and
four GPUs: 34 / 37 B (1 / 4 x 3090) and 75 / 87 B (1 / 4 x A100). This tool runs,
for each server, exactly what

    protrain fit --hardware rtx3090  --host-memory 384GiB --world-size {1,4}
    protrain fit --hardware a100-80g --host-memory 1TiB   --world-size {1,4}

runs for the gpt2 family (``fit.run_fit(..., families=("gpt2",))``; the command
also runs the llama ladder, which the table leaves out), and asks whether llama-70b
(micro-batch 1 x 4096) plans on one A100-80G with 1 TiB. The planner's numbers are
predictions from analytic profiles: nothing runs on a GPU, so this is what the
planner *would* train, bounded by the cost model and by ``plans/accounting.py``'s
host layout (the bytes per offloaded parameter the table header prints).

    python -m tools.bench paper-sizes            # print the markdown section (~2 min on 2 cores)
    python -m tools.bench paper-sizes --write    # and replace its section in BENCHMARKS.md
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import time

from tools.bench import harness

ROOT = harness.ROOT

GiB = 2**30
UNLIMITED = "64TiB"
"""Host RAM for the device-bound column: more than any ladder rung offloads."""

SERVERS = [  # (hardware spec, host RAM as typed, world size, paper Table 2 largest GPT-2, billions)
    ("rtx3090", "384GiB", 1, 34),
    ("rtx3090", "384GiB", 4, 37),
    ("a100-80g", "1TiB", 1, 75),
    ("a100-80g", "1TiB", 4, 87),
]


def fit_row(hardware: str, host: str, world: int, paper_b: float) -> dict:
    from protrain.planner.commands.fit import describe, n_params, run_fit

    t0 = time.perf_counter()

    def echo(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    (r,) = run_fit(hardware, host_memory=host, world_size=world, families=("gpt2",), echo=echo)
    # The same search with the host out of the way: what the device alone allows.
    (free,) = run_fit(
        hardware,
        host_memory=UNLIMITED,
        world_size=world,
        families=("gpt2",),
        micro_batches=(1,),
        echo=echo,
    )
    nxt = f"{n_params(r.next_config) / 1e9:.2f}B: {r.limit}" if r.next_config else r.limit
    pl = r.plan.placement
    return dict(
        command=f"protrain fit --hardware {hardware} --host-memory {host} --world-size {world}",
        server=f"{world} x {hardware}, {host} host RAM",
        params_b=r.n_params / 1e9,
        shape=describe(r.config),
        paper_b=paper_b,
        micro_batch=r.micro_batch,
        iter_s=r.iter_time_us / 1e6,
        binds=r.binds,
        next=nxt,
        host_budget=r.host_budget_bytes,
        device_bound_b=free.n_params / 1e9,
        device_next=free.limit,
        seconds=time.perf_counter() - t0,
        placement=(
            f"{len(pl.persistent)} / {len(pl.homeless)} / {len(pl.device_homed)} of "
            f"{len(r.plan.chunks.items)}"
        ),
    )


def llama70b_row() -> str:
    """Does llama-70b (micro-batch 1 x 4096) plan on one A100-80G with 1 TiB? One line."""
    from protrain.planner.commands.fit import host_need_bytes
    from protrain.planner.hardware.spec import find_spec
    from protrain.planner.hardware.units import human_bytes
    from protrain.planner.models.zoo import block_paths, build
    from protrain.planner.profiling.analytic import analytic_profile
    from protrain.planner.search.planning import host_budget_per_rank, make_plan
    from protrain.plans.errors import ProtrainError

    spec = find_spec("a100-80g")
    host = host_budget_per_rank(2**40, 1)
    model = build("llama-70b", device="meta")
    profile = analytic_profile(
        model,
        name="llama-70b",
        blocks=block_paths(model),
        micro_batch=1,
        seq_len=4096,
        compute_dtype="bfloat16",
        spec=spec,
    )
    cmd = (
        "`protrain plan --model llama-70b --hardware a100-80g --batch 1 --seq 4096 --host-memory "
        f"{host / GiB:.2f}GiB -o llama-70b.json` (the per-rank budget `fit --host-memory 1TiB` "
        "gives one rank)"
    )
    try:
        plan, _ = make_plan(profile, spec.usable_memory_bytes, host_budget_bytes=host)
    except ProtrainError as e:
        return f"llama-70b on one A100-80G with 1 TiB: **does not plan**: {e.message} ({cmd})."
    need = host_need_bytes(plan)
    p = plan.placement
    return (
        "llama-70b on one A100-80G with 1 TiB: **plans**, "
        f"{plan.prediction.iter_time_us / 1e6:.1f} s per iteration predicted (1 x 4096 tokens), "
        f"device {human_bytes(plan.prediction.peak_memory_bytes)} of "
        f"{human_bytes(spec.usable_memory_bytes)}, host {human_bytes(need)} of {human_bytes(host)} "
        f"({need / host:.0%}); {len(p.persistent)} of {len(plan.chunks.items)} chunks persistent, "
        f"n_buffer {p.n_buffer} ({cmd})."
    )


def layout_note() -> str:
    from protrain.planner.search import memory_walk
    from protrain.planner.search.rules import HOST_SLOTS
    from protrain.plans import accounting

    eb = memory_walk.element_bytes("bfloat16")
    return (
        f"bf16 compute, fp32 master and Adam states: {eb.host} B of host memory per offloaded "
        f"parameter, {eb.host - eb.compute} B for the chunks a plan makes homeless when the host "
        f"is the limit (plus {HOST_SLOTS} pinned slot(s) of one chunk shard), and {eb.persistent} "
        "B of device memory per persistent one (`memory_walk.element_bytes`); at one rank an "
        "offloaded chunk's host states stop at its last parameter (`accounting.host_numel`), plus "
        f"the CPU step's fp32 scratch of {accounting.STEP_PIECE:,} elements per rank; none for the "
        "chunks a plan homes on the device when even every chunk homeless misses the host (their "
        f"shard's fp32 master and moments on the card, {memory_walk.HOMED_BYTES} B per element: "
        "executor/chunks.py [Note: device homes])"
    )


def section(rows: list[dict], llama: str, seconds: float) -> str:
    import platform

    head = (
        subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        or "?"
    )
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--", "planner", "executor"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        harness.heading("paper-sizes"),
        "",
        "Command: `python -m tools.bench paper-sizes --write` (each row is the gpt2 row of the "
        "`protrain fit` command it names; seq 1024, bf16, device budget = the spec's usable memory "
        "per rank, host budget per rank = SIZE / N less 10% and 2 GiB).",
        "",
        f"Machine: {platform.system()} {platform.release()}, os.cpu_count()={os.cpu_count()}, "
        f"Python {platform.python_version()} (analytic profiles and the planner only: nothing runs "
        f"on a GPU). Date: {date}. Commit: "
        f"{head}{' + uncommitted planner/executor changes' if dirty else ''}. {seconds:.0f} s in "
        "all.",
        "",
        f"Host layout: {layout_note()}.",
        "",
        "| server (paper's) | largest GPT-2 planned | shape | paper Table 2 | ratio | micro-batch, "
        "predicted s/iter | binds at that size | next size up stopped by | host unlimited "
        f"(`--host-memory {UNLIMITED}`, micro-batch 1) | command |",
        "|---|---:|---|---:|---:|---|---|---|---:|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['server']} | {r['params_b']:.2f}B | {r['shape']} | {r['paper_b']}B | "
            f"{r['params_b'] / r['paper_b']:.2f} | {r['micro_batch']}, {r['iter_s']:.1f} | "
            f"{r['binds']} | {r['next']} | {_bound(r)} | `{r['command']}` |"
        )
    out += ["", llama, "", reading(rows)]
    return "\n".join(out) + "\n"


def _bound(r: dict) -> str:
    """The device-bound size, marked when the ladder ended before the device did."""
    if r["device_next"] == "end of the ladder":
        return f"≥ {r['device_bound_b']:.2f}B (the ladder's end)"
    return f"{r['device_bound_b']:.2f}B"


def reading(rows: list[dict]) -> str:
    host_bound = [r for r in rows if r["next"].split(": ", 1)[-1].startswith("host memory")]
    ratios = ", ".join(f"{r['params_b'] / r['paper_b']:.2f}" for r in rows)
    text = (
        f"Reading. Ratios to the paper: {ratios}. The next size up is stopped by host memory in "
        f"{len(host_bound)} of {len(rows)} servers"
    )
    if host_bound:
        text += (
            (
                ": the host bytes per offloaded parameter (the header's figures: 12 B where the "
                "plan drops homes, none where it homes chunks on the device), not the device, "
                "bound these sizes; with the host out of the way the device alone would allow "
            )
            + ", ".join(_bound(r) for r in rows)
            + ". Rerun this tool after a host-layout change to refresh the table."
        )
    else:
        text += "."
    if all("placement" in r for r in rows):
        text += (
            " The winning plans' chunks, persistent / homeless / device-homed of all: "
            + ", ".join(r["placement"] for r in rows)
            + "."
        )
    for r1 in rows:
        for r4 in rows:
            if not (
                r1["command"].endswith("--world-size 1")
                and r4["command"].endswith("--world-size 4")
                and r4["command"].split("--world-size")[0] == r1["command"].split("--world-size")[0]
                and r4["params_b"] <= r1["params_b"]
                and _needs(r1["next"])
                and _needs(r4["next"])
            ):
                continue
            need1, use1 = _needs(r1["next"])
            need4, use4 = _needs(r4["next"])
            text += (
                f" {r4['server'].split(',')[0]} fits no larger a model than one card: at the next "
                f"size the four ranks need {4 * need4:.1f} GiB of host RAM in all against one "
                f"rank's {need1:.1f} (the persistent chunks' optimizer states are sharded over the "
                f"cards, so more of the model stays on the devices), but have {4 * use4:.1f} GiB "
                f"usable against {use1:.1f} (each rank's budget is its share less 10% and 2 GiB), "
                "and the ladder's next rung is too far up for the difference to reach it."
            )
    return text


def _needs(limit: str) -> tuple[float, float] | None:
    """``(needed, usable)`` GiB per rank, from a probe's ``host memory: needs X GiB, Y GiB
    usable``; None for any other limit (the device, the host floor's ``needs at least``)."""
    m = re.search(r"host memory: needs ([\d.]+) GiB, ([\d.]+) GiB usable", limit)
    return (float(m.group(1)), float(m.group(2))) if m else None


def main(argv: list[str] | None = None, name: str = "paper-sizes") -> int:
    ap = harness.parser(name, __doc__, rounds=1, what="runs (one: the planner is deterministic)")
    args = ap.parse_args(argv)
    harness.no_baseline(ap, args)
    t0 = time.perf_counter()
    rows = [fit_row(*s) for s in SERVERS]
    text = section(rows, llama70b_row(), time.perf_counter() - t0)
    return harness.emit(name, text, args.write)
