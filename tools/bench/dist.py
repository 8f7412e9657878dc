"""Communication on CPU with gloo: the ZeRO-3 collectives, measured against the cost model.

What it answers: how long do the collectives the executor issues (executor/dist.py)
take on this machine, and how far is the cost model's communication term
(planner/search/cost.py ``make_terms``: ``t_up`` = own-shard upload + all-gather, ``t_down``
= reduce-scatter + own-shard download, ``allreduce_us_per_chunk`` for a persistent
chunk) from them? A ``cpu`` spec has no collective bandwidth
(``allgather_bytes_per_s`` = 0), so ``collective_bandwidth`` falls back to the spec's
copy link, a single-process memcpy; this tool says by how much that under-predicts.

Two parts, each rank a process started by ``torch.multiprocessing.spawn`` (gloo over
127.0.0.1, ``torch.set_num_threads(1)`` per rank, as tests/distworker.py does):

1. Micro-benchmark, W = 2 and 3: the executor's three collectives through
   ``executor.dist.Comm`` at chunk sizes of fp32 — all-gather into the padded
   buffer in place from the own shard, reduce-scatter of the full buffer into a
   shard, all-reduce of the full buffer. A ``dist.barrier()`` before every sample
   keeps rank skew out; a sample is the fastest rank's time (the last rank out of
   the barrier waits for no one, so it times the transfer itself, the same estimator
   as "net of waiting" in part 2); median of ``--rounds`` after ``--warmup``. The
   baseline, in the same run on rank 0 while the others wait: ``Tensor.copy_`` of
   the same bytes, which is what the cpu spec's link measures. Bus bandwidth is the
   nccl-tests convention: (W-1)/W x bytes / time for all-gather and reduce-scatter,
   2 (W-1)/W x bytes / time for all-reduce; the model predicts (W-1)/W x bytes /
   ``collective_bandwidth(spec, bytes)`` (x 2 for all-reduce), as ``make_terms``
   charges a chunk.
2. End to end, W = 1, 2, 3: each model trained with a plan from ``emit`` (chunk 0
   persistent, the rest offloaded, every block kept), each rank on its slice of
   the global batch (``batches(..., rank=r, world_size=W)``). The engine's
   ``collective`` events (``Engine.on_event``) give every collective's wall time
   with its name; per step we sum them by kind, and per collective take the fastest
   rank's time as the transfer net of waiting for late ranks. The predicted
   communication per step uses the cost model's own counts (``model_counts``), once
   with the probed spec (the memcpy fallback) and once with ``allgather_bytes_per_s``
   set from part 1. Total runtime ~1.5-2 minutes on 2 cores.

    python -m tools.bench dist              # print the section
    python -m tools.bench dist --write      # and replace its section of BENCHMARKS.md
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from protrain.executor import AdamWConfig, wrap
from protrain.executor.dist import Comm
from protrain.planner.hardware.probe import probe
from protrain.planner.hardware.spec import link_bandwidth
from protrain.planner.models.data import batches, load_tokens
from protrain.planner.models.zoo import block_paths
from protrain.planner.profiling.profile import measure
from protrain.planner.search.cost import Terms, collective_bandwidth, make_terms, predict
from protrain.planner.search.emit import emit
from protrain.plans import plan as P
from protrain.plans import validation as V
from tools.bench import harness
from tools.bench.executor import build_model

KiB, MiB = 2**10, 2**20
OPS = ("all-gather", "reduce-scatter", "all-reduce")
# (model, chunk_numel): a latency-bound 256 KiB chunk and a bandwidth-bound 4 MiB one,
# the same sizes as the micro-benchmark's first two rows.
E2E = (("gpt2-tiny", 64 * KiB), ("gpt2-6l-256", MiB))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )


# ---------------------------------------------------------------------------
# Part 1: micro-benchmark (rank bodies)


def micro_rank(
    rank: int, world: int, port: int, out: str, sizes: list[int], warmup: int, repeats: int
) -> None:
    torch.set_num_threads(1)
    init(rank, world, port)
    try:
        comm = Comm(world)
        res: dict[str, dict[str, list[float]]] = {}
        for size in sizes:
            shard = comm.shard_numel(size // 4)
            full = torch.randn(shard * world)  # padded to W shards, as the chunk buffers are
            mine = torch.empty(shard)
            ops = {
                "all-gather": lambda full=full: comm.all_gather(full, "bench"),
                "reduce-scatter": lambda full=full, mine=mine: comm.reduce_scatter(
                    mine, full, "bench"
                ),
                "all-reduce": lambda full=full: comm.all_reduce(full, "bench"),
            }
            row = res[str(size)] = {}
            for name, fn in ops.items():
                samples = []
                for i in range(warmup + repeats):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    if i >= warmup:
                        samples.append(time.perf_counter() - t0)
                full.normal_()  # all-reduce sums grew the values; keep them ordinary
                row[name] = samples
            # The baseline: one memcpy of the same bytes on rank 0, the others waiting.
            dist.barrier()
            if rank == 0:
                src, dst = torch.randn(shard * world), torch.empty(shard * world)
                samples = []
                for i in range(warmup + repeats):
                    t0 = time.perf_counter()
                    dst.copy_(src)
                    if i >= warmup:
                        samples.append(time.perf_counter() - t0)
                row["memcpy"] = samples
            dist.barrier()
        Path(out, f"micro{world}.rank{rank}.json").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# Part 2: end to end (rank bodies)


def make_plan(
    name: str,
    world: int,
    micro: int,
    seq: int,
    chunk_numel: int,
    persistent: list[int],
    n_buffer: int,
) -> P.Plan:
    meta = build_model(name, "meta", 0)
    blocks = block_paths(meta)
    tr = P.Training(
        micro_batch=micro,
        seq_len=seq,
        compute_dtype="float32",
        master_dtype="float32",
        world_size=world,
        grad_accum=1,
    )
    return emit(
        meta,
        name=name,
        blocks=blocks,
        training=tr,
        chunk_numel=chunk_numel,
        persistent=persistent,
        n_buffer=n_buffer,
        policies=["keep"] * len(blocks),
    )


def train_rank(
    rank: int,
    world: int,
    port: int,
    out: str,
    name: str,
    micro: int,
    seq: int,
    chunk_numel: int,
    persistent: list[int],
    n_buffer: int,
    warmup: int,
    steps: int,
) -> None:
    torch.set_num_threads(1)
    if world > 1:
        init(rank, world, port)
    try:
        plan = make_plan(name, world, micro, seq, chunk_numel, persistent, n_buffer)
        engine = wrap(build_model(name, "cpu", 1), plan, AdamWConfig(lr=1e-3), device="cpu")
        calls: list[tuple[str, float]] = []  # (what, seconds) per collective, in issue order
        began: dict[str, float] = {}

        def timed(ev) -> None:  # every collective is announced (executor/events.py)
            if ev.kind == "collective" and ev.edge == "begin":
                began[ev.detail] = ev.time_s
            elif ev.kind == "collective":
                calls.append((ev.detail, ev.time_s - began.pop(ev.detail)))

        engine.on_event(timed)
        data = batches(load_tokens(), micro, seq, 1, rank=rank, world_size=world)
        step_s, per_step, losses = [], [], []
        for i in range(warmup + steps):
            x, y = next(data)
            n0 = len(calls)
            t0 = time.perf_counter()
            r = engine.step((x, y))  # ends in the loss all-reduce and loss.item()
            dt = time.perf_counter() - t0
            losses.append(r.loss)
            if i >= warmup:
                step_s.append(dt)
                per_step.append(calls[n0:])
        engine.close()
        Path(out, f"{name}.w{world}.rank{rank}.json").write_text(
            json.dumps({"step_s": step_s, "calls": per_step, "losses": losses})
        )
    finally:
        if world > 1:
            dist.destroy_process_group()


def spawn(fn, world: int, *args) -> None:
    mp.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)


# ---------------------------------------------------------------------------
# The cost model's side


def model_counts(t: Terms, n_persist: int, n_buffer: int) -> dict[str, int]:
    """Collectives per step as ``cost.evaluate`` charges them (its own lines, as counts):
    an all-gather per chunk upload (forward uploads + backward re-fetches, the
    ``n_buffer`` chunks used last in forward being still resident), a reduce-scatter
    per offloaded chunk's gradient offload, an all-reduce per persistent chunk. The
    loss all-reduce (and the gradient-norm one when clipping) is not charged."""
    C = t.n_chunks
    off = (np.arange(C) >= n_persist).astype(np.int64)
    order = sorted(np.nonzero(off)[0], key=lambda c: (-t.last_fwd_use[c], -c))
    cached = np.zeros(C, dtype=np.int64)
    cached[order[:n_buffer]] = 1
    again = np.cumsum(t.up_bwd[::-1], axis=0)[::-1] > 1  # a cached chunk's later backward uses
    refetch = int(
        (t.up_bwd @ (off * (1 - cached))).sum() + ((t.up_bwd * again) @ (off * cached)).sum()
    )
    return {
        "all-gather": int((t.up_fwd @ off).sum()) + refetch,
        "reduce-scatter": int((t.offload_at @ off).sum()),
        "all-reduce": n_persist,
    }


def gather_us(t: Terms) -> float:
    """One chunk's all-gather (= reduce-scatter) time in the model: (W-1)/W x padded bytes / bw."""
    return t.allreduce_us_per_chunk / 2


def kind(what: str) -> str:
    if what.startswith("all-gather of chunk"):
        return "all-gather"
    if what.startswith("reduce-scatter of gradients"):
        return "reduce-scatter"
    if what.startswith("all-reduce of gradients"):
        return "all-reduce"
    return "scalar all-reduce"  # the loss; the gradient norm when clipping


# ---------------------------------------------------------------------------
# Report helpers


def med(xs) -> float:
    return statistics.median(xs)


def fmt_bytes(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def gbs(x: float) -> str:
    return f"{x / 1e9:.2f}"


def ms(s: float) -> str:
    return f"{s * 1e3:.2f}" if s < 0.1 else f"{s * 1e3:.1f}"


def busbw(op: str, world: int, nbytes: int, seconds: float) -> float:
    return (2 if op == "all-reduce" else 1) * (world - 1) / world * nbytes / seconds


# ---------------------------------------------------------------------------


# Analysis


def tms(s: float) -> str:
    """Seconds as milliseconds, with enough digits for a few-µs memcpy."""
    return f"{s * 1e3:.3f}" if s < 0.01 else f"{s * 1e3:.2f}" if s < 0.1 else f"{s * 1e3:.1f}"


def analyse_micro(spec, sizes: list[int], micro: dict[int, list[dict]]) -> tuple[list[str], dict]:
    """The micro-benchmark table, and per (W, size, op) the figures the reading uses."""
    rows = [
        "| W | bytes (padded) | collective | median ms | bus GB/s | memcpy ms (GB/s) | model bw "
        "GB/s | predicted ms | predicted / measured | × memcpy time |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    res = {}
    for world in sorted(micro):
        for size in sizes:
            nbytes = -(-(size // 4) // world) * world * 4
            mc = med(micro[world][0][str(size)]["memcpy"])
            bw = collective_bandwidth(spec, nbytes)
            for op in OPS:
                # Per repeat the fastest rank's time: the last to leave the barrier waits for no
                # one.
                t = med(min(s) for s in zip(*(r[str(size)][op] for r in micro[world])))
                pred = (2 if op == "all-reduce" else 1) * (world - 1) / world * nbytes / bw
                res[(world, size, op)] = dict(
                    t=t,
                    bus=busbw(op, world, nbytes, t),
                    pred=pred,
                    memcpy=mc,
                    memcpy_bw=nbytes / mc,
                    model_bw=bw,
                )
                r = res[(world, size, op)]
                rows.append(
                    f"| {world} | {fmt_bytes(size)} ({nbytes:,}) | {op} | {tms(t)} | "
                    f"{gbs(r['bus'])} | {tms(mc)} ({gbs(r['memcpy_bw'])}) | {gbs(bw)} | "
                    f"{tms(pred)} | {pred / t:.3f} | {t / mc:,.0f} |"
                )
    return rows, res


def net_time(rr: list[dict], keep) -> float:
    """Per collective the fastest rank's time (the last to arrive waits for no one), summed over
    the collectives of a step that ``keep`` names; median over steps."""
    calls = [r["calls"] for r in rr]
    return med(
        sum(
            min(c[s][k][1] for c in calls)
            for k in range(len(calls[0][s]))
            if keep(calls[0][s][k][0])
        )
        for s in range(len(calls[0]))
    )


def run_e2e(
    spec, name: str, chunk_numel: int, args, out: str, mres: dict
) -> tuple[list[str], list[dict]]:
    """Train ``name`` on W = 1, 2, 3 ranks; the section's table for it and the figures for the
    reading."""
    t_model = time.perf_counter()
    probe_plan = make_plan(name, 1, args.batch, args.seq, chunk_numel, [], 10**6)
    need = V.segment_chunks(probe_plan)
    n_chunks = len(probe_plan.chunks.items)
    persistent = [0]  # the embeddings' chunk stays (the paper's choice); the rest is offloaded
    n_buffer = max(2, max(len(ids - set(persistent)) for ids in need.values()))
    model = build_model(name, "cpu", 1)
    n_params = sum(p.numel() for p in model.parameters())
    prof = measure(
        model,
        name=name,
        blocks=block_paths(model),
        micro_batch=args.batch,
        seq_len=args.seq,
        compute_dtype="float32",
        device="cpu",
        spec=spec,
        warmup=2,
        iterations=5,
    )
    del model
    runs: dict[int, list[dict]] = {}
    for world in (1, 2, 3):
        print(f"{name} W={world}", file=sys.stderr)
        spawn(
            train_rank,
            world,
            out,
            name,
            args.batch,
            args.seq,
            chunk_numel,
            persistent,
            n_buffer,
            args.warmup,
            args.steps,
        )
        runs[world] = [
            json.loads(Path(out, f"{name}.w{world}.rank{r}.json").read_text()) for r in range(world)
        ]
    base = med(runs[1][0]["step_s"])
    rows = [
        "| W | step ms, per rank | × W=1 | in collectives ms, per rank | net of waiting ms "
        "| outside collectives ms (× W=1 step) | collectives / step: measured (model) "
        "| net ms per call, AG / RS / AR (micro-benchmark) | predicted comm ms, fallback | ÷ net "
        "| predicted comm ms, measured bus bw | ÷ net "
        "| predicted step ms: fallback → measured bus bw |",
        "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    figures = []
    for world in (1, 2, 3):
        rr = runs[world]
        assert all(r["losses"] == rr[0]["losses"] for r in rr), "ranks disagree on the global loss"
        names = [[[w for w, _ in step] for step in r["calls"]] for r in rr]
        assert all(n == names[0] for n in names), "ranks issued different collectives"
        steps = [med(r["step_s"]) for r in rr]
        t = make_terms(prof, chunk_numel, world)
        pred_step = predict(t, len(persistent), n_buffer, 0, 0).time_us / 1e6
        if world == 1:
            rows.append(
                f"| 1 | {tms(steps[0])} | 1.00 | — | — | {tms(steps[0])} (1.00) | — (no process "
                f"group) | — | 0 | — | 0 | — | {tms(pred_step)} |"
            )
            base_pred = pred_step
            continue
        counts = model_counts(t, len(persistent), n_buffer)
        seen = {k: 0 for k in (*OPS, "scalar all-reduce")}
        for w in names[0][0]:
            seen[kind(w)] += 1
        in_coll = [med(sum(d for _, d in step) for step in r["calls"]) for r in rr]
        outside = statistics.mean(s - c for s, c in zip(steps, in_coll))

        net_all = net_time(rr, lambda w: True)
        net_chunks = net_time(rr, lambda w: kind(w) != "scalar all-reduce")
        per_call = {
            op: net_time(rr, lambda w, op=op: kind(w) == op) / seen[op] for op in OPS if seen[op]
        }
        bench = {op: mres[(world, chunk_numel * 4, op)]["t"] for op in OPS}
        calls_txt = (
            " / ".join(tms(per_call[op]) if op in per_call else "—" for op in OPS)
            + " ("
            + " / ".join(tms(bench[op]) for op in OPS)
            + ")"
        )
        units = sum(counts[op] * (2 if op == "all-reduce" else 1) for op in OPS)  # all-gather-times
        pred = units * gather_us(t) / 1e6
        bw2 = mres[(world, chunk_numel * 4, "all-gather")]["bus"]
        spec2 = msgspec.structs.replace(spec, allgather_bytes_per_s=round(bw2))
        prof2 = msgspec.structs.replace(prof, hardware=spec2)
        t2 = make_terms(prof2, chunk_numel, world)
        pred2 = units * gather_us(t2) / 1e6
        pred2_step = predict(t2, len(persistent), n_buffer, 0, 0).time_us / 1e6
        counts_txt = (
            f"AG {seen['all-gather']} ({counts['all-gather']}), RS {seen['reduce-scatter']} "
            f"({counts['reduce-scatter']}), AR {seen['all-reduce']} ({counts['all-reduce']}); "
            f"+ {seen['scalar all-reduce']} scalar AR (not modelled)"
        )
        rows.append(
            f"| {world} | {' / '.join(tms(s) for s in steps)} | {max(steps) / base:.2f} | "
            f"{' / '.join(tms(c) for c in in_coll)} | {tms(net_all)} | {tms(outside)} "
            f"({outside / base:.2f}) | {counts_txt} | {calls_txt} | {tms(pred)} | "
            f"{pred / net_chunks:.3f} | {tms(pred2)} | {pred2 / net_chunks:.2f} | {tms(pred_step)} "
            f"→ {tms(pred2_step)} |"
        )
        figures.append(
            dict(
                name=name,
                world=world,
                step=max(steps),
                base=base,
                in_coll=statistics.mean(in_coll),
                net=net_all,
                net_chunks=net_chunks,
                outside=outside,
                pred=pred,
                pred2=pred2,
                pred_step=pred_step,
                pred2_step=pred2_step,
                bw2=bw2,
                per_call=per_call,
                bench=bench,
                base_pred=base_pred,
                units=units,
                gather2=gather_us(t2) / 1e6,
                counts_match=all(seen[op] == counts[op] for op in OPS),
            )
        )
    text = [
        f"#### {name}: {n_params / 1e6:.2f}M params, {n_chunks} chunks of {chunk_numel:,} elements "
        f"({fmt_bytes(chunk_numel * 4)} fp32); chunk 0 persistent, {n_chunks - 1} offloaded, "
        f"n_buffer {n_buffer}, every block kept",
        "",
        *rows,
        "",
        "Profile for the predictions: `measure(...)` in one process, 2 warmup + 5 iterations, the "
        f"probed spec; {time.perf_counter() - t_model:.0f} s for this model in all.",
        "",
    ]
    return text, figures


def reading(spec, sizes: list[int], mres: dict, e2e: list[dict], load) -> str:
    big, small = sizes[-1], sizes[0]
    ratio = [r["pred"] / r["t"] for r in mres.values()]
    per_op = "; ".join(
        f"{op} {min(r['pred'] / r['t'] for k, r in mres.items() if k[2] == op):.3f}–"
        f"{max(r['pred'] / r['t'] for k, r in mres.items() if k[2] == op):.3f}"
        for op in OPS
    )
    xmem = [r["t"] / r["memcpy"] for r in mres.values()]
    link_fit = [r["memcpy_bw"] / r["model_bw"] for r in mres.values()]
    worlds = sorted({k[0] for k in mres})
    ag_curve = "; ".join(
        f"W={w} " + " → ".join(gbs(mres[(w, s, "all-gather")]["bus"]) for s in sizes)
        for w in worlds
    )
    lat = [mres[(w, small, op)]["t"] for w in worlds for op in OPS]
    # Share of a smallest-size collective that its bytes explain at the best bus bandwidth seen.
    best = {op: max(r["bus"] for k, r in mres.items() if k[2] == op) for op in OPS}
    moving = [
        (2 if op == "all-reduce" else 1)
        * (w - 1)
        / w
        * small
        / best[op]
        / mres[(w, small, op)]["t"]
        for w in worlds
        for op in OPS
    ]
    rs_ar = [
        mres[(w, s, "reduce-scatter")]["t"] / mres[(w, s, "all-reduce")]["t"]
        for w in worlds
        for s in sizes
        if s > small
    ]
    parts = []
    for r in e2e:
        parts.append(
            f"{r['name']} W={r['world']}: the collectives take {tms(r['in_coll'])} ms of a "
            f"{tms(r['step'])} ms step ({r['in_coll'] / r['step']:.0%}; {tms(r['net'])} ms net of "
            f"waiting), the fallback predicts {tms(r['pred'])} ms of chunk collectives against "
            f"{tms(r['net_chunks'])} ms net (under by {r['net_chunks'] / r['pred']:.0f}×); with "
            f"the measured bus bandwidth {r['pred2'] / r['net_chunks']:.2f}×; predicted step "
            f"{r['pred_step'] / r['step']:.2f}× → {r['pred2_step'] / r['step']:.2f}× the measured "
            "one"
        )
    counts_ok = all(r["counts_match"] for r in e2e)
    outside = "; ".join(f"{r['name']} W={r['world']} {r['outside'] / r['base']:.2f}×" for r in e2e)
    fixed = [r["pred2"] / r["net_chunks"] for r in e2e]
    under = [r["net_chunks"] / r["pred"] for r in e2e]
    ag_train = [r["per_call"]["all-gather"] / r["bench"]["all-gather"] for r in e2e]
    rs_ag = [r["per_call"]["reduce-scatter"] / r["per_call"]["all-gather"] for r in e2e]
    ar_ag = [r["per_call"]["all-reduce"] / r["per_call"]["all-gather"] for r in e2e]
    w1 = sorted({(r["name"], r["base_pred"] / r["base"]) for r in e2e})
    w1_txt = ", ".join(f"{n} {x:.2f}×" for n, x in w1)
    rng = lambda xs: f"{min(xs):.2f}–{max(xs):.2f}×"  # noqa: E731
    return "\n\n".join(
        [
            "**Reading.** *Micro-benchmark.* The cpu spec has no collective bandwidth, so the "
            "model charges a collective at memcpy speed; gloo over loopback is nowhere near that. "
            f"Predicted / measured is {min(ratio):.3f}–{max(ratio):.3f} ({per_op}): the fallback "
            f"under-predicts a collective {1 / max(ratio):.0f}–{1 / min(ratio):.0f}×. The memcpy "
            f"measured in the same run is {rng(link_fit)} the probed link at the same size (the "
            "same operation, but single calls here and looped ones in the probe, on a machine "
            "whose load changed between the two), and the collectives take "
            f"{min(xmem):,.0f}–{max(xmem):,.0f}× a memcpy of the same bytes. At {fmt_bytes(small)} "
            f"a collective costs {tms(min(lat))}–{tms(max(lat))} ms, of which moving the bytes at "
            "the best bus bandwidth measured for that collective would take at most "
            f"{max(moving):.0%}: the rest is latency (socket round trips, ring steps, waking the "
            "other processes), which a bandwidth alone cannot express; the all-gather's bus "
            f"bandwidth over {' → '.join(fmt_bytes(s) for s in sizes)} is {ag_curve} GB/s, at best "
            f"{gbs(max(mres[(w, s, 'all-gather')]['bus'] for w in worlds for s in sizes))} GB/s "
            f"against the {gbs(collective_bandwidth(spec, big))} GB/s memcpy link at "
            f"{fmt_bytes(big)}. Reduce-scatter takes {min(rs_ar):.1f}–{max(rs_ar):.1f}× an "
            f"all-reduce of the same buffer (at {fmt_bytes(sizes[1])} and up), where the model "
            "charges it half an all-reduce: gloo has no reduce-scatter of its own — "
            "`ProcessGroupGloo::reduce_scatter_tensor_coalesced` clones the input, all-reduces "
            "the whole buffer and copies out the own slice — so on gloo the collective in "
            "`t_down` is an all-reduce plus a copy, whatever bandwidth the spec gives.",
            "*End to end.* "
            + (
                (
                    "The executor issued exactly the chunk collectives the model counts "
                    "(all-gathers, reduce-scatters, all-reduces per step, in every run), so the "
                    "gap is the time per collective, not the accounting. "
                )
                if counts_ok
                else (
                    "The executor's collective counts differ from the model's in some run (see the "
                    "tables). "
                )
            )
            + "; ".join(parts)
            + ". "
            "Set from the micro-benchmark, `allgather_bytes_per_s` takes the communication term "
            "from "
            f"{min(under):.0f}–{max(under):.0f}× under to {rng(fixed)} the measured net time: a "
            "bus bandwidth taken "
            "at the chunk's own size folds its latency in. What is left: in training a chunk "
            "all-gather costs "
            f"{rng(ag_train)} its micro-benchmark time (there the ranks had the cores to "
            "themselves; here the "
            "other ranks' compute and CPU-Adam threads share them), a reduce-scatter costs "
            f"{rng(rs_ag)} an "
            "all-gather where the model charges the same, and the persistent chunk's all-reduce "
            f"{rng(ar_ag)} an "
            "all-gather where the model charges 2×. The rest of the step grows as well, and no "
            "communication "
            f"term explains it: time outside collectives is {outside} the W=1 step, because W "
            "ranks, each with "
            f"its CPU-Adam worker thread, share {os.cpu_count()} cores (W=3 oversubscribes them), "
            "and the waits "
            'in "in collectives" beyond the net time are ranks arriving late for the same reason. '
            "The model "
            "assumes each rank has its device and cores to itself, as on a GPU node; for scale, "
            "at W=1 it "
            f"predicts {w1_txt} the measured step (a 5-iteration profile on a shared box).",
            "*How far to trust this.* This is gloo over loopback TCP on a 2-core VM: bus "
            f"bandwidths of at most {gbs(max(r['bus'] for r in mres.values()))} GB/s, where NCCL "
            "reaches tens of GB/s over PCIe and hundreds over NVLink, and W ranks compete for the "
            "same cores; the numbers calibrate nothing about GPUs. They say that on a cpu spec "
            "the memcpy fallback under-predicts communication by orders of magnitude, so a W > 1 "
            "plan made from a probed cpu spec believes ZeRO-3 is nearly free. *What the probe "
            "should measure:* with a world size given, spawn W local ranks on the backend the "
            "executor will use (gloo for cpu, nccl for cuda) and time `all_gather_into_tensor` "
            "and `reduce_scatter_tensor` themselves (not one inferred from the other: gloo's "
            "reduce-scatter is an all-reduce) over the link curve's sizes; store a curve or a "
            "latency + size / bandwidth fit per collective (`allgather_bytes_per_s` and "
            "`reduce_scatter_bytes_per_s` exist; a latency does not), have `make_terms` use the "
            "reduce-scatter figure in `t_down` and measure all-reduce for the persistent chunks; "
            "until then, a cpu spec with `allgather_bytes_per_s` = 0 should warn when planning "
            f"for W > 1. Load average {load[0]:.2f} before, {load[1]:.2f} after, on "
            f"{os.cpu_count()} cores: one sample of a shared machine.",
        ]
    )


# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None, name: str = "dist") -> int:
    ap = harness.parser(name, __doc__, rounds=10, what="timed samples per collective")
    ap.add_argument(
        "--sizes",
        default="256KiB,4MiB,32MiB",
        help="micro-benchmark buffer sizes (fp32), comma-separated, KiB/MiB",
    )
    ap.add_argument("--warmup", type=int, default=3, help="untimed samples / steps (default 3)")
    ap.add_argument(
        "--steps", type=int, default=6, help="measured training steps per run (default 6)"
    )
    ap.add_argument("--batch", type=int, default=4, help="micro-batch per rank (default 4)")
    ap.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    args = ap.parse_args(argv)
    harness.no_baseline(ap, args)
    args.repeats = args.rounds
    sizes = sorted(int(s[:-3]) * (MiB if s.endswith("MiB") else KiB) for s in args.sizes.split(","))
    missing = [fmt_bytes(c * 4) for _, c in E2E if c * 4 not in sizes]
    if missing or len(sizes) < 2:
        ap.error(
            f"--sizes needs at least two sizes, including the end-to-end chunk sizes "
            f"{', '.join(fmt_bytes(c * 4) for _, c in E2E)}"
        )
    command = harness.command(name, argv)

    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    t_start = time.perf_counter()
    spec = probe("cpu", quick=True)
    probe_s = time.perf_counter() - t_start
    load_tokens()  # a missing data file fails here, before any rank starts
    with tempfile.TemporaryDirectory(prefix="bench_dist.") as out:
        micro: dict[int, list[dict]] = {}
        for world in (2, 3):
            print(f"micro-benchmark W={world}", file=sys.stderr)
            spawn(micro_rank, world, out, sizes, args.warmup, args.repeats)
            micro[world] = [
                json.loads(Path(out, f"micro{world}.rank{r}.json").read_text())
                for r in range(world)
            ]
        micro_s = time.perf_counter() - t_start - probe_s
        rows1, mres = analyse_micro(spec, sizes, micro)
        e2e_text, figures = [], []
        for model, chunk_numel in E2E:
            text, figs = run_e2e(spec, model, chunk_numel, args, out, mres)
            e2e_text += text
            figures += figs
    elapsed_s = time.perf_counter() - t_start
    load = (load_before, os.getloadavg()[0])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = "\n".join(
        [
            harness.heading(name),
            "",
            f"Command: `{command}`",
            "",
            f"Machine: {harness.machine()}.",
            "",
            f'Date: {date}. Spec: `probe("cpu", quick=True)` in {probe_s:.1f} s (memcpy link '
            f"{gbs(link_bandwidth(spec, sizes[-1], 'h2d'))} GB/s at {fmt_bytes(sizes[-1])}; "
            f"`allgather_bytes_per_s` = {spec.allgather_bytes_per_s}, so `collective_bandwidth` "
            "falls back to "
            "the memcpy link at the buffer's size). Ranks: `torch.multiprocessing.spawn`, gloo "
            "over 127.0.0.1, "
            "`torch.set_num_threads(1)` in every rank and in the parent (probe, profiles). "
            f"{elapsed_s:.0f} s in "
            f"all ({micro_s:.0f} s of it the micro-benchmark); load average {load[0]:.2f} before, "
            f"{load[1]:.2f} after, on {os.cpu_count()} cores.",
            "",
            "### Collectives at chunk sizes",
            "",
            "fp32 buffers through `executor.dist.Comm`, as the executor calls it: all-gather in "
            "place into the padded buffer from the own shard, reduce-scatter of the full buffer "
            f"into a shard, all-reduce of the full buffer. {args.warmup} warmup + {args.repeats} "
            "timed samples each, a `dist.barrier()` before every sample; a sample is the fastest "
            "rank's time (the last to leave the barrier waits for no one: that rank times the "
            "transfer itself); median. Bus GB/s: (W-1)/W × bytes / time, × 2 for all-reduce "
            "(nccl-tests' busbw). memcpy: `Tensor.copy_` of the same bytes on rank 0 in the same "
            "run, the others waiting (what the cpu spec's link measures). Model bw: "
            "`collective_bandwidth(spec, bytes)`; predicted: (W-1)/W × bytes / model bw, × 2 for "
            "all-reduce, as `make_terms` charges a chunk. × memcpy time: the collective's median "
            "over the memcpy's.",
            "",
            *rows1,
            "",
            "### End to end: training with ZeRO-3",
            "",
            "Each model trained by `wrap` with a plan from `emit` for W ranks "
            f"(`Training(world_size=W)`), micro-batch {args.batch} × {args.seq} tokens per rank "
            f"from `batches(..., rank=r, world_size=W)`, {args.warmup} warmup + {args.steps} "
            "measured steps. Every rank times `engine.step` and every collective (its begin and "
            "end events from `Engine.on_event`, whose name says which chunk and why). Step: "
            "median per rank; × W=1: the slowest rank's over the single process's. In "
            "collectives: per rank, median over steps of the summed collective time, waiting for "
            "slower ranks included. Net of waiting: per collective the fastest rank's time, "
            "summed over a step, median over steps. Outside collectives: step minus in "
            "collectives, mean over ranks. Collectives per step: counted from the recorded calls; "
            "in parentheses the cost model's count (`model_counts`, the lines of `cost.evaluate`: "
            "an all-gather per forward upload and backward re-fetch of an offloaded chunk, a "
            "reduce-scatter per gradient offload, an all-reduce per persistent chunk). Predicted "
            "comm: (AG + RS + 2 × AR) × (W-1)/W × padded chunk bytes / "
            "`collective_bandwidth(spec, chunk bytes)` — the collective part of `t_up`, `t_down` "
            "and `allreduce_us_per_chunk`, without the own-shard copies; ÷ net is against the net "
            "time of those chunk collectives (the scalar loss all-reduce left out, as the model "
            "leaves it out). Measured bus bw: the same with `allgather_bytes_per_s` set to the "
            "micro-benchmark's all-gather bus bandwidth at the chunk's size and W (the model uses "
            "that one figure for all three collectives). Predicted step: `cost.predict` for the "
            "plan's configuration.",
            "",
            *e2e_text,
            reading(spec, sizes, mres, figures, load),
            "",
        ]
    )
    return harness.emit(name, section, args.write)
