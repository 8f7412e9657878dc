"""The planner on CPU and its search time: does the cost model count as the executor does, predict
wall time, and search fast? (CPU peaks are a consistency check, not fidelity.)

Two questions, two benchmarks (``planner`` and ``search``), two sections of BENCHMARKS.md:

1. **Fidelity.** For a few models we measure a Profile on this machine
   (``planner/profiling/profile.py::measure``, with the hardware spec from
   ``probe("cpu", quick=True)``, so the link and Adam rates are this box's), then
   write ~8 configurations spanning the space (all persistent and kept … all
   offloaded and checkpointed, swap, mixed, and the one ``make_plan`` picks for a
   budget) as plans with ``emit.assemble``, train each with ``wrap`` and compare
   what the cost model predicted (``cost.predict``) with what the executor reports:
   ``StepResult.peak_bytes`` (the ledger's count on CPU, which the model walks in
   the same terms, so it should match to the byte) and the median of
   ``StepResult.timings_s["total"]``. The baseline of every ratio is the measured
   value from the same run.
2. **Search time.** ``make_plan(profile, budget)`` on analytic profiles of big
   models (llama-70b, gpt2-xl) for datasheet GPUs, at the spec's usable memory and
   at a tight budget, timed over several calls; the analytic profiling that
   precedes it is timed separately and is the baseline of the ratio.

Measurement rules (as tools/bench/executor.py): one intra-op thread (the second
core runs the executor's CPU-Adam worker), a fresh model from the same seed for
every run, the same batches for every configuration, configurations interleaved
and rotated across repeats so drift lands on all of them alike.

    python -m tools.bench planner                  # print the first section
    python -m tools.bench planner --write          # and replace it in BENCHMARKS.md
    python -m tools.bench search --write           # the second
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from protrain.executor import AdamWConfig, wrap
from protrain.planner.models.data import batches, load_tokens
from protrain.planner.profiling.profile import Profile
from protrain.planner.search.cost import (
    Terms,
    block_policies,
    choose_chunk_numel,
    facts_from_profile,
    make_terms,
    min_buffers,
    predict,
)
from protrain.planner.search.emit import ModelFacts, assemble
from protrain.planner.search.exhaustive import policy_pairs, space
from protrain.planner.search.planning import make_plan
from protrain.plans import plan as P
from protrain.plans.errors import BudgetError
from tools.bench import harness
from tools.bench.executor import BENCH_MODELS, build_model

FIDELITY_MODELS = ("gpt2-tiny", "llama-tiny", "gpt2-6l-256")
SEARCH_SPECS = ("rtx3090", "a100-80g", "h200")
SEARCH_HOST_BYTES = 64 * 2**40
"""Host budget of the search-time rows: unlimited (64 TiB), so every row times a search
that finds a plan; the datasheet specs' host RAM does not hold llama-70b's offloaded states."""
# (model, micro-batch, seq len): llama-70b at the paper's long-context shape; gpt2-xl
# at a shape where its 1.5B params neither trivially fit nor trivially fail a 24 GB card.
SEARCH_MODELS = (("llama-70b", 1, 4096), ("gpt2-xl", 4, 1024))
TIGHT = 1.10  # the tight budget: this much above the smallest predicted peak of any configuration
LR = 1e-3
MiB, GiB = 2**20, 2**30


# ---------------------------------------------------------------------------
# Fidelity: configurations


def describe(cfg: tuple[int, int, int, int], t: Terms) -> str:
    """A configuration in words: ``offload + 2 swap, 2 ckpt, 2 keep``, ``persist + keep``."""
    n_persist, n_buffer, n_swap, n_ckpt = cfg
    C, N = t.n_chunks, t.n_blocks
    place = (
        "persist" if n_persist == C else "offload" if n_persist == 0 else f"{n_persist}/{C} persist"
    )
    counts = [(n_swap, "swap"), (n_ckpt, "checkpoint"), (N - n_swap - n_ckpt, "keep")]
    whole = [w for n, w in counts if n == N]
    policies = whole[0] if whole else ", ".join(f"{n} {w}" for n, w in counts if n)
    extra = n_buffer - min_buffers(t, n_persist) if n_persist < C else 0
    return f"{place} + {policies}" + (f", +{extra} buffer{'s' * (extra > 1)}" if extra else "")


@dataclass(frozen=True)
class Config:
    label: str
    cfg: tuple[int, int, int, int]  # (n_persist, n_buffer, n_swap, n_checkpoint)
    plan: P.Plan
    pred_peak_bytes: float
    pred_time_us: float
    pred_fwd_us: float
    pred_bwd_us: float
    in_space: bool  # whether the search could have chosen it (buffer range, swap limit)


def make_configs(prof: Profile, facts: ModelFacts, t: Terms, tr: P.Training) -> list[Config]:
    """~8 configurations from all-persistent-keep to all-offloaded-checkpoint, plus
    ``make_plan``'s own choice at half the all-persistent-keep peak."""
    C, N = t.n_chunks, t.n_blocks

    def nb(n_persist: int, extra: int = 0) -> int:
        # The fewest buffers that run, plus ``extra``, never more than the offloaded chunks.
        need = min_buffers(t, n_persist)
        return min(need + extra, C - n_persist) if n_persist < C else 0

    wanted = [
        (C, 0, 0, 0),  # all persistent, all kept: the profiling plan's configuration
        (C, 0, 0, N),
        (C, 0, N, 0),
        (C // 2, nb(C // 2), 0, 0),
        (0, nb(0), 0, 0),
        (0, nb(0, 2), 0, 0),  # spare buffers: prefetch room and forward→backward caching
        (0, nb(0, 1), max(1, N // 3), N // 3),
        (0, nb(0), 0, N),  # the least memory
        (1, nb(1), max(1, N // 3), N // 3),
    ]
    outer, pairs = set(space(t)), set(policy_pairs(t))
    out, seen = [], set()
    for cfg in wanted:
        if cfg in seen:  # small models collapse some of these onto each other
            continue
        seen.add(cfg)
        n_persist, n_buffer, n_swap, n_ckpt = cfg
        plan = assemble(
            facts,
            training=tr,
            chunk_numel=t.chunk_numel,
            persistent=list(range(n_persist)),
            n_buffer=n_buffer,
            policies=block_policies(N, n_swap, n_ckpt),
        )
        p = predict(t, *cfg)
        out.append(
            Config(
                describe(cfg, t),
                cfg,
                plan,
                p.peak_bytes,
                p.time_us,
                p.breakdown["t_fwd_us"],
                p.breakdown["t_bwd_us"],
                (n_persist, n_buffer) in outer and (n_swap, n_ckpt) in pairs,
            )
        )
    # The planner end to end: make_plan picks for a budget between the extremes.
    budget = int(out[0].pred_peak_bytes * 0.5)
    plan, _ = make_plan(prof, budget)
    ch = plan.provenance.search.chosen
    cfg = (ch.n_persist, ch.n_buffer, ch.n_swap, ch.n_checkpoint)
    p = predict(t, *cfg)
    assert plan.chunks.chunk_numel == t.chunk_numel, (plan.chunks.chunk_numel, t.chunk_numel)
    out.append(
        Config(
            f"make_plan @ {budget / MiB:.1f} MiB",
            cfg,
            plan,
            plan.prediction.peak_memory_bytes,
            plan.prediction.iter_time_us,
            p.breakdown["t_fwd_us"],
            p.breakdown["t_bwd_us"],
            True,
        )
    )
    return out


# ---------------------------------------------------------------------------
# Fidelity: running


@dataclass
class Run:
    total_s: list[float] = field(
        default_factory=list
    )  # StepResult.timings_s["total"], measured steps
    fwd_s: list[float] = field(default_factory=list)
    bwd_s: list[float] = field(default_factory=list)
    peak_bytes: int = 0  # max StepResult.peak_bytes over measured steps
    losses: list[float] = field(default_factory=list)  # every step, warmup included


def run_config(name: str, plan: P.Plan, data: list, warmup: int, seed: int) -> Run:
    eng = wrap(build_model(name, "cpu", seed), plan, AdamWConfig(lr=LR), device="cpu")
    run = Run()
    try:
        for i, batch in enumerate(data):
            res = eng.step(batch)
            run.losses.append(res.loss)
            if i >= warmup:
                run.total_s.append(res.timings_s["total"])
                run.fwd_s.append(res.timings_s["forward"])
                run.bwd_s.append(res.timings_s["backward"])
                run.peak_bytes = max(run.peak_bytes, res.peak_bytes)
    finally:
        eng.close()
    return run


@dataclass
class ModelResult:
    name: str
    n_params: int
    t: Terms
    profile_s: float
    configs: list[Config]
    runs: dict[str, list[Run]]


def bench_model(name: str, spec, args) -> ModelResult:
    from protrain.planner.commands.measure import measure
    from protrain.planner.models.zoo import block_paths

    B, T = args.batch, args.seq
    model = build_model(name, "cpu", args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    prof = measure(
        model,
        name=name,
        blocks=block_paths(model),
        micro_batch=B,
        seq_len=T,
        compute_dtype="float32",
        device="cpu",
        spec=spec,
        warmup=args.warmup,
        iterations=args.profile_iterations,
        seed=args.seed,
    )
    profile_s = time.perf_counter() - t0
    del model
    facts = facts_from_profile(prof)
    chunk_numel, _ = choose_chunk_numel(facts)
    t = make_terms(prof, chunk_numel)
    tr = P.Training(
        micro_batch=B,
        seq_len=T,
        compute_dtype="float32",
        master_dtype="float32",
        world_size=1,
        grad_accum=1,
    )
    configs = make_configs(prof, facts, t, tr)
    it = batches(load_tokens(), B, T, seed=args.seed)
    data = [next(it) for _ in range(args.warmup + args.steps)]  # the same batches for every run
    runs: dict[str, list[Run]] = {c.label: [] for c in configs}
    for rep in range(args.repeats):
        order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
        for c in order:
            gc.collect()
            run = run_config(name, c.plan, data, args.warmup, args.seed)
            runs[c.label].append(run)
            print(
                f"{name} repeat {rep + 1}/{args.repeats} {c.label:28s} "
                f"median {statistics.median(run.total_s) * 1e3:.1f} ms",
                file=sys.stderr,
            )
    return ModelResult(name, n_params, t, profile_s, configs, runs)


# ---------------------------------------------------------------------------
# Fidelity: report


def cfg_text(cfg: tuple[int, int, int, int], t: Terms) -> str:
    n_persist, n_buffer, n_swap, n_ckpt = cfg
    return f"{n_persist}/{t.n_chunks}, {n_buffer}, {n_swap}, {n_ckpt}"


@dataclass(frozen=True)
class Measured:
    """One configuration's runs, reduced: medians over all measured steps of all repeats."""

    total_ms: float
    fwd_ms: float
    bwd_ms: float
    peak_bytes: int
    spread: float  # (max - min) of the per-repeat medians, relative to total_ms


def reduce(runs: list[Run]) -> Measured:
    def med(key: str) -> float:
        return statistics.median(s for x in runs for s in getattr(x, key)) * 1e3

    per_repeat = [statistics.median(x.total_s) * 1e3 for x in runs]
    total = med("total_s")
    return Measured(
        total,
        med("fwd_s"),
        med("bwd_s"),
        max(x.peak_bytes for x in runs),
        (max(per_repeat) - min(per_repeat)) / total,
    )


@dataclass
class Summary:
    name: str
    max_peak_err_bytes: int
    rho: float
    p_value: float
    n: int
    mean_abs_time_err: float  # mean |pred/meas - 1|
    base_ratio: float  # pred/meas time of the all-persistent keep configuration (the profiled one)
    other_ratio: float  # median pred/meas time of the other configurations
    recompute_share: float | None  # measured extra backward of all-checkpoint / predicted recompute
    spread: float  # the largest per-repeat spread of any configuration
    span: tuple[float, float]  # fastest and slowest measured median ms


def model_section(r: ModelResult) -> tuple[str, Summary]:
    from scipy.stats import spearmanr

    rows = [
        "| configuration | n_persist, n_buffer, n_swap, n_checkpoint | predicted peak MiB "
        "| ledger peak MiB | peak ratio (consistency) | predicted ms | measured ms | time ratio "
        "| fwd / bwd ms, predicted → measured |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    meas = {c.label: reduce(r.runs[c.label]) for c in r.configs}
    ratios = []
    for c in r.configs:
        m = meas[c.label]
        p_ms = c.pred_time_us / 1e3
        ratios.append(p_ms / m.total_ms)
        label = c.label + ("" if c.in_space else " †")
        rows.append(
            f"| {label} | {cfg_text(c.cfg, r.t)} | {c.pred_peak_bytes / MiB:.3f} "
            f"| {m.peak_bytes / MiB:.3f} | {c.pred_peak_bytes / m.peak_bytes:.4f} "
            f"| {p_ms:.1f} | {m.total_ms:.1f} | {p_ms / m.total_ms:.2f} "
            f"| {c.pred_fwd_us / 1e3:.1f} / {c.pred_bwd_us / 1e3:.1f} → "
            f"{m.fwd_ms:.1f} / {m.bwd_ms:.1f} |"
        )
    rho, p_value = spearmanr(
        [c.pred_time_us for c in r.configs], [meas[c.label].total_ms for c in r.configs]
    )
    # Recompute: all-checkpoint against all-keep, both all-persistent (no copies differ).
    C, N = r.t.n_chunks, r.t.n_blocks
    by_cfg = {c.cfg: c for c in r.configs}
    keep, ckpt = by_cfg.get((C, 0, 0, 0)), by_cfg.get((C, 0, 0, N))
    share = None
    if keep and ckpt and ckpt.pred_bwd_us > keep.pred_bwd_us:
        share = (meas[ckpt.label].bwd_ms - meas[keep.label].bwd_ms) / (
            (ckpt.pred_bwd_us - keep.pred_bwd_us) / 1e3
        )
    base = r.configs[0]
    totals = [m.total_ms for m in meas.values()]
    s = Summary(
        name=r.name,
        max_peak_err_bytes=max(
            abs(round(c.pred_peak_bytes) - meas[c.label].peak_bytes) for c in r.configs
        ),
        rho=float(rho),
        p_value=float(p_value),
        n=len(r.configs),
        mean_abs_time_err=statistics.fmean(abs(x - 1) for x in ratios),
        base_ratio=ratios[0],
        other_ratio=statistics.median(ratios[1:]),
        recompute_share=share,
        spread=max(m.spread for m in meas.values()),
        span=(min(totals), max(totals)),
    )
    ref = r.runs[base.label][0].losses
    max_dloss = max(
        abs(a - b) for c in r.configs for x in r.runs[c.label] for a, b in zip(x.losses, ref)
    )
    worst = max(range(len(ratios)), key=lambda i: abs(ratios[i] - 1))
    t = r.t
    lines = [
        f"### {r.name} ({r.n_params / 1e6:.2f}M params; {t.n_blocks} blocks; "
        f"{t.n_chunks} chunks of {t.chunk_numel:,} elements)",
        "",
        "\n".join(rows),
        "",
    ]
    if any(not c.in_space for c in r.configs):
        lines += [
            "† outside the search's space (more swaps than its swap interval allows, or "
            "more buffers than it tries); predicted by the same model all the same.",
            "",
        ]
    lines.append(
        (
            f"Peak consistency: predicted and ledger differ by at most {s.max_peak_err_bytes:,} "
            "bytes. Spearman rank correlation of predicted and measured step time: ρ = "
            f"{s.rho:.2f} (p = {s.p_value:.2g}, n = {s.n}). Mean |time ratio − 1| = "
            f"{s.mean_abs_time_err:.1%}; farthest: {r.configs[worst].label} at "
            f"{ratios[worst]:.2f}×. Repeats of one configuration differ by up to {s.spread:.0%}. "
            f"Profile measured in {r.profile_s:.1f} s. Losses across configurations: max |Δloss| = "
            f"{max_dloss:.1e} against {base.label}."
        ).replace("= 0.0e+00", "= 0")
    )
    return "\n".join(lines), s


def fidelity_reading(sums: list[Summary]) -> str:
    exact = all(s.max_peak_err_bytes == 0 for s in sums)
    peak = (
        "**Peaks (consistency, not fidelity):** predicted equals the ledger's count to the byte "
        "for every configuration of every model, as the CPU memory model is written to (it walks "
        "the ledger's own terms): this shows the planner and the executor count alike, not that "
        "either matches what an allocator would hold, so peak-memory fidelity waits for a real "
        "allocator (a GPU run)."
        if exact
        else "**Peaks: NOT exact** — "
        + ", ".join(
            f"{s.name} off by up to {s.max_peak_err_bytes:,} bytes"
            for s in sums
            if s.max_peak_err_bytes
        )
        + "; on CPU they should match to the byte, so this is a cost-model or ledger bug."
    )
    per_model = []
    for s in sums:
        rc = (
            ""
            if s.recompute_share is None
            else f"; checkpoint's recompute measured at {s.recompute_share:.0%} of the predicted "
            "one (a block's profiled forward)"
        )
        per_model.append(
            f"{s.name}: ρ = {s.rho:.2f}, steps {s.span[0]:.1f}–{s.span[1]:.1f} ms, the profiled "
            f"configuration (persist + keep) at {s.base_ratio:.2f}× and the others at a median "
            f"{s.other_ratio:.2f}×{rc}"
        )
    # Judge recompute on the model with the longest steps: on the tiny ones a block's
    # forward is ~1 ms and the share is mostly noise.
    big = max(sums, key=lambda s: s.span[0])
    early = (
        ""
        if big.recompute_share is None or big.recompute_share >= 0.9
        else f" On {big.name}, whose steps are long enough to tell, the recompute of a "
        f"checkpointed block costs {big.recompute_share:.0%} of the predicted full "
        "forward; the likely reason is "
        "`torch.utils.checkpoint`'s early stop (non-reentrant, on by default), which "
        "ends the recompute at the last tensor backward needs and so skips the block's "
        "trailing ops, such as the MLP's output projection."
    )
    return (
        f"{peak}\n\n**Time:** {'; '.join(per_model)}.{early} "
        "The CPU time model is coarse on purpose: it sums the profiled per-segment compute, "
        "one more forward per checkpointed block, and every copy at the probed memcpy "
        "bandwidth (on a CPU device copies are synchronous, nothing overlaps), and runs CPU "
        "Adam on a timeline beside backward (each offloaded chunk steps on the worker thread "
        "once its gradients are down; `[CPU Adam timeline]` in cost.py). It has no fixed "
        "cost per event: hooks, chunk "
        "bookkeeping, swap pack/unpack (`SWAP_OVERHEAD_US` is 0 on CPU) and the worker "
        "thread's contention with backward for the interpreter. The profile carries them "
        "only as far as the profiled plan (all persistent, all kept) pays them, so on a step "
        "of a few ms, where they are a large share, configurations that add events should "
        "come out predicted too fast (compare the others' median ratio with the profiled "
        "one's above), and on a step of a few hundred ms they sink into the noise. What the "
        "model can rank is the cost classes: keep and offload (copies within RAM are nearly "
        "free) < swap (a copy of the saved tensors) < checkpoint (a recomputed forward); "
        "within a class the measured differences are the executor's bookkeeping and "
        "run-to-run noise, which it does not try to resolve, so ρ below 1 is expected. Read "
        'ρ as "ranks configurations that differ by more than the noise", not as a '
        "calibration of the GPU time model, which overlaps copies and compute and is "
        "untested here."
    )


# ---------------------------------------------------------------------------
# Search time


@dataclass
class SearchRow:
    model: str
    spec: str
    shape: str
    budget_label: str
    budget_bytes: int
    calls_s: list[float]  # make_plan wall seconds per call
    search_s: list[float]  # SearchResult.seconds per call (the solver alone)
    evaluated: int
    space_size: int
    chosen: str
    pred_time_s: float
    pred_peak_bytes: float
    n_chunks: int
    error: str = ""


def bench_search(args) -> tuple[list[SearchRow], list[tuple[str, str, float, float]]]:
    """(rows, [(model, spec, build_s, analytic_s)])."""
    from protrain.planner.hardware.spec import find_spec
    from protrain.planner.models.zoo import block_paths, build
    from protrain.planner.profiling.analytic import analytic_profile

    rows, prof_times = [], []
    for model_name, B, T in SEARCH_MODELS:
        for spec_name in SEARCH_SPECS:
            spec = find_spec(spec_name)
            t0 = time.perf_counter()
            meta = build(model_name, device="meta")
            t1 = time.perf_counter()
            prof = analytic_profile(
                meta,
                name=model_name,
                blocks=block_paths(meta),
                micro_batch=B,
                seq_len=T,
                compute_dtype="bfloat16",
                spec=spec,
            )
            t2 = time.perf_counter()
            prof_times.append((model_name, spec_name, t1 - t0, t2 - t1))
            usable = spec.usable_memory_bytes
            tight = None
            for label in ("usable", "tight"):
                budget = usable if label == "usable" else tight
                calls, searches, res, plan, err = [], [], None, None, ""
                for _ in range(args.search_repeats):
                    a = time.perf_counter()
                    try:
                        # host RAM unlimited: this measures the search, not what fits the host
                        plan, res = make_plan(prof, budget, host_budget_bytes=SEARCH_HOST_BYTES)
                    except BudgetError as e:
                        err = str(e).split("\n")[0]
                    calls.append(time.perf_counter() - a)
                    if res is not None:
                        searches.append(res.seconds)
                if tight is None:
                    # The smallest predicted peak of any configuration: it is at n_persist 0,
                    # which every search evaluates before pruning, so any budget reports it.
                    assert res is not None, f"{model_name} on {spec_name} fits no budget: {err}"
                    tight = int(res.min_peak_bytes * TIGHT)
                row = SearchRow(
                    model_name,
                    spec_name,
                    f"{B}×{T}",
                    "usable" if label == "usable" else f"tight ({TIGHT:.2f}× min peak)",
                    budget,
                    calls,
                    searches,
                    0,
                    0,
                    "—",
                    0.0,
                    0.0,
                    0,
                    err,
                )
                if plan is not None and res is not None:
                    ch = plan.provenance.search.chosen
                    row.evaluated, row.space_size = res.evaluated, res.space_size
                    row.n_chunks = len(plan.chunks.items)
                    row.chosen = (
                        f"{ch.n_persist}/{row.n_chunks}, {ch.n_buffer}, {ch.n_swap}, "
                        f"{ch.n_checkpoint}"
                    )
                    row.pred_time_s = plan.prediction.iter_time_us / 1e6
                    row.pred_peak_bytes = plan.prediction.peak_memory_bytes
                rows.append(row)
                print(
                    f"{model_name} {spec_name} {label}: make_plan median "
                    f"{statistics.median(calls) * 1e3:.0f} ms",
                    file=sys.stderr,
                )
    return rows, prof_times


def search_section(rows: list[SearchRow], prof_times) -> tuple[str, str]:
    """(tables, reading)."""
    analytic = {(m, s): a for m, s, _, a in prof_times}
    t1 = [
        "| model | spec | B×T | budget | budget GiB | make_plan ms, median (min–max) "
        "| search alone ms, median | evaluated / space | chosen n_persist, n_buffer, n_swap, "
        "n_checkpoint | predicted iter s | predicted peak GiB | × analytic profile |",
        "|---|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        med = statistics.median(r.calls_s)
        search = f"{statistics.median(r.search_s) * 1e3:.0f}" if r.search_s else "—"
        ev = (
            f"{r.evaluated:,} / {r.space_size:,} ({r.evaluated / r.space_size:.0%})"
            if r.space_size
            else "—"
        )
        chosen = r.chosen if not r.error else f"no fit: {r.error}"
        t1.append(
            f"| {r.model} | {r.spec} | {r.shape} | {r.budget_label} | "
            f"{r.budget_bytes / GiB:.2f} | {med * 1e3:.0f} ({min(r.calls_s) * 1e3:.0f}–"
            f"{max(r.calls_s) * 1e3:.0f}) | {search} | {ev} | {chosen} | "
            f"{r.pred_time_s:.2f} | {r.pred_peak_bytes / GiB:.2f} | "
            f"{med / analytic[(r.model, r.spec)]:.2f} |"
        )
    t2 = ["| model | spec | build on meta s | analytic_profile s |", "|---|---|---:|---:|"]
    for m, s, b, a in prof_times:
        t2.append(f"| {m} | {s} | {b:.2f} | {a:.2f} |")
    llama = [r for r in rows if r.model == "llama-70b"]
    worst = max(max(r.calls_s) for r in llama) if llama else math.nan
    worst_med = max(statistics.median(r.calls_s) for r in llama) if llama else math.nan
    verdict = (
        "meets"
        if worst < 1.0
        else ("meets at the median but not on every call" if worst_med < 1.0 else "misses")
    )
    share = [
        statistics.median(r.search_s) / statistics.median(r.calls_s) for r in rows if r.search_s
    ]
    skipped = {
        (r.model, r.spec, r.budget_label): 1 - r.evaluated / r.space_size
        for r in rows
        if r.space_size
    }
    most = max(skipped, key=skipped.get)
    full = [f"{m} on {s}" for (m, s, b), x in skipped.items() if x == 0]
    spaces = {(r.model, r.spec): r.space_size for r in rows if r.space_size}
    llama_spaces = ", ".join(f"{s} {n:,}" for (m, s), n in spaces.items() if m == "llama-70b")
    reading = (
        f"llama-70b: the slowest make_plan call took {worst * 1e3:.0f} ms (slowest median "
        f"{worst_med * 1e3:.0f} ms), which {verdict} the < 1 s target on this machine. "
        f"The exhaustive search is {min(share):.0%}–{max(share):.0%} of a make_plan call (the "
        "rest is choosing the chunk size, building the cost terms and emitting the plan). "
        "Pruning stops the outer loop after the first n_persist at which nothing fits, so "
        f"it skips the most when few chunks can persist (up to {skipped[most]:.0%}, "
        f"{most[0]} on {most[1]} at the {most[2].split(' ')[0]} budget)"
        + (
            f" and nothing when everything fits ({', '.join(full)} at the usable budget)"
            if full
            else ""
        )
        + f". The space itself depends on the card (llama-70b: {llama_spaces} configurations) "
        "because the search tries only as many swaps as the swap interval allows: on a card "
        "that computes a block's forward faster than it can swap the block's activations out, "
        "swaps must be spaced further apart. Planning is a fraction of the analytic profiling "
        "that precedes it (the × analytic profile column), which runs the model's training "
        "step under a counting dispatch mode on meta tensors: profile once, plan many budgets."
    )
    return "\n".join(t1) + "\n\nAnalytic profiling, timed once per spec:\n\n" + "\n".join(
        t2
    ), reading


# ---------------------------------------------------------------------------
# Writing


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None, name: str = "planner") -> int:
    search = name == "search"
    ap = harness.parser(
        name,
        __doc__,
        rounds=5 if search else 3,
        what="make_plan calls per (model, spec, budget)"
        if search
        else "runs of every configuration",
    )
    ap.add_argument("--only", choices=("fidelity", "search"), required=True, help=argparse.SUPPRESS)
    ap.add_argument(
        "--models",
        default=",".join(FIDELITY_MODELS),
        help=f"fidelity models, comma-separated (default {','.join(FIDELITY_MODELS)}; "
        f"bench models: {', '.join(BENCH_MODELS)})",
    )
    ap.add_argument("--batch", type=int, default=4, help="fidelity micro-batch (default 4)")
    ap.add_argument("--seq", type=int, default=128, help="fidelity sequence length (default 128)")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per run (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per run (default 3)")
    ap.add_argument(
        "--profile-iterations",
        type=int,
        default=10,
        help="measured iterations of the profile (default 10)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--seed", type=int, default=1, help="model init and data seed")
    args = ap.parse_args(argv)
    harness.no_baseline(ap, args)
    args.repeats = args.search_repeats = args.rounds

    torch.set_num_threads(args.threads)
    command = harness.command(name, argv)

    if args.only == "fidelity":
        from protrain.planner.hardware.probe import probe

        load_before = os.getloadavg()[0]
        t_start = time.perf_counter()
        spec = probe("cpu", quick=True)
        probe_s = time.perf_counter() - t_start
        results = [bench_model(name, spec, args) for name in args.models.split(",")]
        elapsed_s = time.perf_counter() - t_start
        load = (load_before, os.getloadavg()[0])
        parts, sums = zip(*(model_section(r) for r in results))
        text = "\n".join(
            [
                harness.heading(name),
                "",
                f"Command: `{command}`",
                "",
                f"Machine: {harness.machine()}.",
                "",
                f'Date: {now_utc()}. Spec: `probe("cpu", quick=True)` in {probe_s:.1f} s (memcpy '
                f"link {spec.link[-1].h2d_bytes_per_s / 1e9:.1f} GB/s at "
                f"{spec.link[-1].size_bytes // MiB} MiB, CPU fused AdamW "
                f"{spec.cpu_adam_params_per_s / 1e9:.2f} G params/s). Each model: a profile from "
                f"`measure(...)` ({args.warmup} warmup + {args.profile_iterations} measured "
                f"iterations, fp32, micro-batch {args.batch} × {args.seq} tokens, dropout off), "
                "the chunk size `choose_chunk_numel` picks, then every configuration emitted with "
                f"`assemble` and trained with `wrap` for {args.repeats} repeats × ({args.warmup} "
                f"warmup + {args.steps} measured) steps, configurations interleaved; "
                f"{elapsed_s:.0f} s in all. Predicted: `cost.predict` (for the make_plan row, the "
                "plan's own `prediction`). Measured peak: max `StepResult.peak_bytes` (the "
                "ledger); "
                'measured time: median of `StepResult.timings_s["total"]` over all measured steps. '
                "Ratios are predicted / measured. Load average "
                f"{load[0]:.2f} before, {load[1]:.2f} after, on {os.cpu_count()} cores. The peak "
                "columns are a consistency check, not fidelity: the CPU memory model walks the "
                "ledger's own terms, so predicted and ledger peaks agree by construction (a "
                "difference would be a bug in one of the two); fidelity waits for a real "
                "allocator's "
                "peak, on a GPU. The time columns are a real measurement: the prediction against "
                "measured wall time.",
                "",
                *[p + "\n" for p in parts],
                fidelity_reading(list(sums)),
                "",
            ]
        )

    if args.only == "search":
        load_before = os.getloadavg()[0]
        t_start = time.perf_counter()
        rows, prof_times = bench_search(args)
        elapsed_s = time.perf_counter() - t_start
        load = (load_before, os.getloadavg()[0])
        tables, reading = search_section(rows, prof_times)
        shapes = "; ".join(f"{m} B={b}, T={t}" for m, b, t in SEARCH_MODELS)
        text = "\n".join(
            [
                harness.heading(name),
                "",
                f"Command: `{command}`",
                "",
                f"Machine: {harness.machine()}.",
                "",
                f"Date: {now_utc()}. Analytic profiles (`analytic_profile(build(name, "
                f'device="meta"), ...)`, bf16; {shapes}) for the datasheet specs '
                f"{', '.join(SEARCH_SPECS)} (`find_spec`); `make_plan(profile, budget, "
                "host_budget_bytes=64 TiB)` (host RAM unlimited: this times the search, not what "
                "fits "
                f"the host) called {args.search_repeats} times per row at the spec's "
                "`usable_memory_bytes` and at a "
                f"tight budget, {TIGHT:.2f}× the smallest predicted peak of any configuration "
                "(`SearchResult.min_peak_bytes`). make_plan ms is the whole call (chunk size, "
                "terms, "
                "search, emit); search alone is `SearchResult.seconds`. evaluated / space from the "
                "returned SearchResult. The baseline of the ratio is the analytic profiling of the "
                f"same (model, spec), timed in the same run. {elapsed_s:.0f} s in all; load "
                "average "
                f"{load[0]:.2f} before, {load[1]:.2f} after, on {os.cpu_count()} cores.",
                "",
                tables,
                "",
                reading,
                "",
            ]
        )

    return harness.emit(name, text, args.write)
