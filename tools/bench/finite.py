"""What the finite-state guard costs: step time with and without it, in one process.

The guard (executor/optim.py [Note: finite-state guard]) reads every gradient once
before its chunk steps: one sum per gradient on the CPU-Adam worker (offloaded
chunks, ``during_backward``), one sum per persistent chunk and one read back before
the device steps, and nothing at all where the global norm is computed anyway
(``after_backward``: clipping, or the plan's schedule). This tool trains two engines
per plan, the guard on and off (``PROTRAIN_NO_FINITE_CHECK=1`` when the second is built),
from the same model, seed and batches, in alternating blocks of steps (alternating which
comes first), so both settings see the same machine drift. It reports the median step time
of each, their ratio, and the time spent inside the guard's checks (the optimizer's public
``guard_seconds``).

    python -m tools.bench finite                  # print the table
    python -m tools.bench finite --write          # and replace its section of BENCHMARKS.md
"""

from __future__ import annotations

import datetime
import os
import statistics
import time

import torch

from protrain.executor import AdamWConfig, wrap
from protrain.planner.models.data import batches, load_tokens
from protrain.planner.models.zoo import block_paths
from protrain.planner.search.emit import emit
from protrain.plans import plan as P
from tools.bench import harness
from tools.bench.executor import build_model

MODEL, MICRO_BATCH, SEQ_LEN, CHUNK = "gpt2-6l-256", 4, 128, 1 << 20


def plans() -> list[tuple[str, P.Plan]]:
    meta = build_model(MODEL, "meta", 0)
    blocks = block_paths(meta)
    tr = P.Training(
        micro_batch=MICRO_BATCH,
        seq_len=SEQ_LEN,
        compute_dtype="float32",
        master_dtype="float32",
        world_size=1,
        grad_accum=1,
    )

    def plan(persistent, n_buffer, cpu_adam=None):
        return emit(
            meta,
            name=MODEL,
            blocks=blocks,
            training=tr,
            chunk_numel=CHUNK,
            persistent=persistent,
            n_buffer=n_buffer,
            policies=["keep"] * len(blocks),
            cpu_adam=cpu_adam,
        )

    n = len(plan([], 10**6).chunks.items)
    return [
        ("persistent (device steps)", plan(list(range(n)), 0)),
        ("offloaded, during_backward (worker)", plan([], 2, "during_backward")),
        ("offloaded, after_backward (the norm)", plan([], 2, "after_backward")),
    ]


def _engine(plan: P.Plan, guarded: bool):
    """An engine on the same model and seed, with the guard on or off (``PROTRAIN_NO_FINITE_CHECK``,
    read once when the engine is built)."""
    if guarded:
        os.environ.pop("PROTRAIN_NO_FINITE_CHECK", None)
    else:
        os.environ["PROTRAIN_NO_FINITE_CHECK"] = "1"
    try:
        return wrap(build_model(MODEL, "cpu", 0), plan, AdamWConfig(lr=1e-3), device="cpu")
    finally:
        os.environ.pop("PROTRAIN_NO_FINITE_CHECK", None)


def measure(
    plan: P.Plan, warmup: int, repeats: int, block: int
) -> tuple[dict[bool, list[float]], float]:
    """Seconds per step with the guard on (True) and off (False), blocks of ``block`` steps on two
    engines (same model, seed and batches), alternating which runs first, and the seconds a guarded
    step spends inside the guard's checks (mean; the optimizer's public ``guard_seconds``)."""
    engines = {True: _engine(plan, True), False: _engine(plan, False)}
    streams = {g: batches(load_tokens(), MICRO_BATCH, SEQ_LEN, 0) for g in engines}
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for g, engine in engines.items():
            for _ in range(warmup):
                engine.step(next(streams[g]))
            engine.optim.wait_all()
        inside = engines[True].optim.guard_seconds
        for r in range(repeats):
            for guarded in (True, False) if r % 2 == 0 else (False, True):
                for _ in range(block):
                    t0 = time.perf_counter()
                    engines[guarded].step(next(streams[guarded]))
                    times[guarded].append(time.perf_counter() - t0)
        engines[True].optim.wait_all()  # the last CPU steps' checks, counted
        inside = engines[True].optim.guard_seconds - inside
    finally:
        for engine in engines.values():
            engine.close()
    return times, inside / max(len(times[True]), 1)


def check_alone(plan: P.Plan, runs: int = 30) -> tuple[float, int]:
    """Median seconds of the check itself, as the worker runs it on each chunk (the spans its
    step reads; the masters stand in for the gradients: same shapes, finite), and the
    elements checked. Less noisy than a difference of two step times on a shared machine."""
    from protrain.executor.optim import all_finite

    engine = wrap(build_model(MODEL, "cpu", 0), plan, AdamWConfig(lr=1e-3), device="cpu")
    o = engine.optim
    views = [
        o.read_by_step(c.id, list(range(len(c.params))), o.master[c.id])
        for c in engine.store.chunks
    ]
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for v in views:
            all_finite(v)
        times.append(time.perf_counter() - t0)
    engine.close()
    return statistics.median(times), sum(t.numel() for v in views for t in v)


def main(argv: list[str] | None = None, name: str = "finite") -> int:
    ap = harness.parser(
        name, __doc__, rounds=6, what="blocks of steps per setting, alternating order"
    )
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--block", type=int, default=8, help="steps per block")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    harness.no_baseline(ap, args)
    args.repeats = args.rounds
    torch.set_num_threads(args.threads)
    t0, load0 = time.time(), os.getloadavg()[0]
    rows, ratios, shares = [], [], []
    for label, plan in plans():
        times, inside = measure(plan, args.warmup, args.repeats, args.block)
        on, off = (statistics.median(times[g]) for g in (True, False))
        rows.append(
            f"| {label} | {off * 1e3:.1f} | {on * 1e3:.1f} | {on / off:.3f} | {inside * 1e3:.2f} "
            f"({inside / off:.1%}) |"
        )
        ratios.append(on / off)
        shares.append(inside / off)
        print(rows[-1], flush=True)
    alone, elements = check_alone(plan)
    rows.append(
        f"| the check alone: one sum per span of parameters, {elements / 1e6:.2f}M fp32 gradient "
        f"elements | — | — | — | {alone * 1e3:.2f} ({alone / off:.1%}) |"
    )
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = (
        f"""{harness.heading(name)}

Command: `{harness.command(name, argv)}`

Machine: {harness.machine()}.

Date: {date}. Model {MODEL} (fp32), micro-batch {MICRO_BATCH} x {SEQ_LEN} tokens, 1M-element
chunks; per plan two engines (guard on; off by `PROTRAIN_NO_FINITE_CHECK=1`), {args.warmup}
warm-up steps each, then {args.repeats} blocks of {args.block} steps per setting, alternating
between them (alternating which comes first); median wall time of a whole `Engine.step`;
{time.time() - t0:.0f} s in all; load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after
(2 cores shared with other work: read differences under a few % as noise).

| plan | step ms, guard off | step ms, guard on | on / off | ms in the guard per step (share) |
|---|---:|---:|---:|---:|
"""
        + "\n".join(rows)
        + f"""

Reading: the guard's cost is the last column, timed inside its checks during the guarded
steps ({min(shares):.1%} to {max(shares):.1%} of a step; the after_backward plan's guard only
reads the global norm the step computes anyway). The on / off ratios of whole steps
({min(ratios):.3f} to {max(ratios):.3f}) are two medians on a 2-core machine shared with other
work, so they carry its drift, which here is larger than the guard's cost; the check alone,
over spans the size of this model's gradients, takes {alone * 1e3:.1f} ms.
"""
    )
    return harness.emit(name, text, args.write)
