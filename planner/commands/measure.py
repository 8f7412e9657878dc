"""Measuring a Profile: train the model for a few steps under the executor with a profiling
plan (``profiling_plan``, emitted like any plan) and observe every segment boundary.

It lives with the commands because it runs the engine, as ``train`` does: it needs the
search's ``emit`` for its plan and the executor for its steps, so it sits above both (the
Profile type it fills is ``profiling/profile.py``'s, torch-free, below the search).

[Note: robust timing]
A profile times the work, not one-off costs or the neighbours. On a busy 2-core CPU the
medians of 5 steps of one tiny llama went from 3.9 ms to 772 ms between runs: torch's
intra-op threads wait for each other at every op, and a thread the scheduler has
parked stalls a segment for a time slice or more, in most of the steps. So ``measure``
discards ``warmup`` steps (first-touch allocation, lazy initialisation), times at
least ``iterations`` more, and on the CPU keeps each segment's *fastest* forward and
backward (the least is the work, as the CPU benchmarks take it; a neighbour can only
add time). Until those least times are confirmed it measures more steps, up to
``max_iterations`` in all and for at most ``max_seconds`` or as long again as the
first ``iterations`` took, whichever is longer (a loaded machine slows those too, and
a fixed time cut its profiles short): confirmed when each is matched by a second
time within ``CONFIRM`` of it, and one whole step took within ``CONFIRM`` of their
sum (stalls come in time slices of similar length, so two stalled times can agree
with each other; a step without a stall cannot agree with them). Where the work is
long against a time slice (a large model) the first steps confirm it and nothing is
added. On CUDA, where kernels are not preempted, the median stays. The measured
steps' totals (their spread) go to ``on_timing``: ``plan`` and ``profile`` print
them, and warn when the median step took more than ``WIDE_SPREAD`` times the
fastest, or the least times were never confirmed (``Timing.wide``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protrain.plans.homes import KEEP

from ..hardware.spec import HardwareSpec
from ..profiling.profile import (
    PROFILE_VERSION,
    ParamInfo,
    Profile,
    ProfileModel,
    ProfileTraining,
    SegmentProfile,
    generator,
)
from ..search.emit import assemble, model_facts

CONFIRM = 1.25
"""A segment's fastest time counts once a second measured time is within this factor of it."""
WIDE_SPREAD = 1.5
"""``Timing.wide``: the measured steps' median total over their least above this factor."""


@dataclass(frozen=True)
class Timing:
    """How the measured steps of a profile spread ([Note: robust timing])."""

    step_s: tuple[float, ...]
    """Each measured step's total segment time, forward and backward, in seconds."""
    warmup: int
    statistic: str
    """``least`` (CPU) or ``median`` (CUDA): what each segment's time is."""
    confirmed: bool
    """Every segment's least time was matched by a second measured time (CPU)."""

    @property
    def spread(self) -> float:
        """The median step over the fastest (1.0: every step alike)."""
        import statistics

        return statistics.median(self.step_s) / min(self.step_s) if min(self.step_s) > 0 else 1.0

    @property
    def wide(self) -> bool:
        return self.spread > WIDE_SPREAD or not self.confirmed

    def describe(self) -> str:
        import statistics

        ms = [t * 1e3 for t in self.step_s]
        return (
            f"{len(ms)} measured steps after {self.warmup} warm-up: {min(ms):.3g} ms fastest, "
            f"{statistics.median(ms):.3g} ms median, {max(ms):.3g} ms slowest "
            f"(spread {self.spread:.2f}x); each segment's {self.statistic} time is used"
        )

    def warning(self) -> str | None:
        """One line for a wide spread, else None."""
        if not self.wide:
            return None
        why = (
            f"the median step took {self.spread:.1f}x the fastest"
            if self.spread > WIDE_SPREAD
            else "some segment's fastest time was never measured twice"
        )
        return (
            f"the profile's timings are noisy ({why}): something else is using this "
            "machine's cores. The profile keeps each segment's fastest time, so the "
            "prediction is what an idle machine would do; profile again when it is idle "
            "for a firmer figure"
        )


def profiling_plan(
    model,
    *,
    name: str,
    blocks: list[str],
    micro_batch: int,
    seq_len: int,
    compute_dtype: str,
    bootstrap: bool,
):
    """The plan the profiler runs: every chunk persistent and every block kept, or — for a
    model larger than the device — every chunk offloaded through the fewest buffers
    (the bootstrap plan), so only one segment's parameters are resident at a time.

    Chunks are sized to the largest segment so that each segment lives in one chunk.
    """
    from protrain.plans import plan as P
    from protrain.plans import validation as V

    facts = model_facts(model, name, blocks, seq_len)
    numel = {n: math.prod(s) for n, s, _ in facts.params}
    chunk_numel = max(
        max(sum(numel[n] for n in facts.uses[s]) for s in facts.segments), max(numel.values())
    )
    training = P.Training(
        micro_batch=micro_batch,
        seq_len=seq_len,
        compute_dtype=compute_dtype,
        master_dtype="float32",
        world_size=1,
        grad_accum=1,
    )
    probe = assemble(
        facts,
        training=training,
        chunk_numel=chunk_numel,
        persistent=[],
        n_buffer=len(facts.params) + 1,
        policies=[KEEP.name] * len(blocks),
    )
    n_chunks = len(probe.chunks.items)
    if not bootstrap:
        return assemble(
            facts,
            training=training,
            chunk_numel=chunk_numel,
            persistent=list(range(n_chunks)),
            n_buffer=0,
            policies=[KEEP.name] * len(blocks),
        ), facts
    need = max(len(c) for c in V.segment_chunks(probe).values())
    return assemble(
        facts,
        training=training,
        chunk_numel=chunk_numel,
        persistent=[],
        n_buffer=need,
        policies=[KEEP.name] * len(blocks),
    ), facts


def measure(
    model,
    *,
    name: str,
    blocks: list[str],
    micro_batch: int,
    seq_len: int,
    compute_dtype: str,
    device: str,
    spec: HardwareSpec,
    warmup: int = 2,
    iterations: int = 5,
    max_iterations: int | None = None,
    max_seconds: float = 20.0,
    bootstrap: bool | None = None,
    seed: int = 0,
    progress=None,
    on_timing=None,
) -> Profile:
    """Measure a Profile by training ``model`` (real weights, any device) for a few steps
    under the executor with a profiling plan, observing every segment boundary.

    Times: CUDA events on GPU, ``perf_counter`` on CPU, over at least ``iterations``
    measured steps after ``warmup``: on CPU each segment's least, more steps measured
    (up to ``max_iterations``, default 4 × ``iterations``, for ``max_seconds`` or as
    long as the first ``iterations`` took) while the least is not confirmed; on CUDA
    the median ([Note: robust timing]). ``on_timing(Timing)`` receives the measured
    steps' spread. Saved activations: the executor's own counting (forced on, also on
    CUDA), so profile and ledger agree by construction. Transient
    peaks: the allocator's peak between a segment's begin and end above the larger of
    the allocation at those two moments (CUDA only; 0 on CPU). The model's weights are
    changed by the measured steps (a learning rate of zero keeps them: AdamW with lr=0
    still updates moments, never parameters).
    """
    import statistics
    import time

    import torch

    from protrain.executor import AdamWConfig, wrap
    from protrain.executor.events import Event
    from protrain.executor.schedule import block_input

    from ..models.data import batches, load_tokens

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if bootstrap is None:
        # Profile through the bootstrap plan when parameters, gradients and fp32 Adam
        # state could not all sit on the device next to activations.
        n_params = sum(p.numel() for p in model.parameters())
        free = torch.cuda.mem_get_info(dev)[0] if cuda else spec.usable_memory_bytes
        bootstrap = cuda and n_params * 16 > 0.6 * free
    plan, facts = profiling_plan(
        model,
        name=name,
        blocks=blocks,
        micro_batch=micro_batch,
        seq_len=seq_len,
        compute_dtype=compute_dtype,
        bootstrap=bootstrap,
    )
    engine = wrap(model, plan, AdamWConfig(lr=0.0, weight_decay=0.0), device=dev)

    segments = facts.segments
    spans: dict[tuple[str, str], list[float]] = {}
    saved: dict[str, int] = {}  # segment → saved bytes, counted as the ledger counts them
    swap_bytes: dict[str, int] = {}  # segment → what a swap of it moves
    peaks: dict[tuple[str, str], int] = {}
    inputs: dict[str, int] = {}
    marks: dict[tuple[str, str], object] = {}
    base_alloc: dict[tuple[str, str], int] = {}

    def now():
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def observer(ev: Event) -> None:
        if ev.kind == "saved":
            saved[ev.segment], swap_bytes[ev.segment] = ev.nbytes, ev.swap_bytes
        if ev.kind != "segment":
            return
        key = (ev.phase, ev.segment)
        if ev.edge == "begin":
            if cuda:
                base_alloc[key] = torch.cuda.memory_allocated(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            marks[key] = now()
            return
        end = now()
        start = marks.pop(key)
        if cuda:
            end.synchronize()
            spans.setdefault(key, []).append(start.elapsed_time(end) / 1e3)
            top = torch.cuda.max_memory_allocated(dev)
            peaks[key] = max(
                peaks.get(key, 0), top - max(base_alloc[key], torch.cuda.memory_allocated(dev))
            )
        else:
            spans.setdefault(key, []).append(end - start)

    modules = dict(model.named_modules())

    def record_input(segment):
        def hook(_m, args, kwargs):  # hidden states positional (zoo, HF) or as a keyword (HF)
            t, _ = block_input(args, kwargs)
            inputs[segment] = t.untyped_storage().nbytes()

        return hook

    def record_output(_m, _a, out):
        t = out[0] if isinstance(out, (tuple, list)) else out
        inputs[segments[-1]] = t.untyped_storage().nbytes()

    handles = [
        modules[b].register_forward_pre_hook(record_input(b), with_kwargs=True) for b in blocks
    ]
    handles.append(modules[blocks[-1]].register_forward_hook(record_output))
    data = batches(load_tokens(), micro_batch, seq_len, seed)
    # Exact saved-activation counts on CUDA too: the executor's own counting, from the
    # first step, so that warmup runs the same hooks as the measured steps.
    engine.on_event(observer, count_activations=True)
    cap = max(iterations, max_iterations if max_iterations is not None else 4 * iterations)

    def confirmed() -> bool:  # [Note: robust timing]
        least = sum(min(v) for v in spans.values())
        steps = [sum(v[k] for v in spans.values() if k < len(v)) for k in range(i - warmup)]
        return min(steps) <= CONFIRM * least and all(
            sorted(v)[1] <= CONFIRM * min(v) for v in spans.values() if len(v) > 1
        )

    i = 0
    try:
        while True:
            if i == warmup:
                spans.clear()
                peaks.clear()
                t_measured = time.perf_counter()
            x, y = next(data)
            inputs["<pre>"] = x.to(dev).untyped_storage().nbytes()
            saved.clear()
            swap_bytes.clear()
            engine.step((x, y))
            i += 1
            if progress is not None:
                progress(i, max(i, warmup + iterations))
            if i < warmup + iterations:
                continue
            elapsed = time.perf_counter() - t_measured
            if i == warmup + iterations:
                first_s = elapsed  # the first `iterations`: the extra steps may take as long
            if cuda or i >= warmup + cap or elapsed > max(max_seconds, 2 * first_s):
                break
            if confirmed():
                break
    finally:
        for h in handles:
            h.remove()
        engine.close()

    statistic = statistics.median if cuda else min
    measured = i - warmup
    if on_timing is not None:
        steps = [sum(v[k] for v in spans.values() if k < len(v)) for k in range(measured)]
        on_timing(
            Timing(
                step_s=tuple(steps),
                warmup=warmup,
                statistic="median" if cuda else "least",
                confirmed=cuda or confirmed(),
            )
        )

    def time_us(phase: str, seg: str) -> int:
        return round(statistic(spans[(phase, seg)]) * 1e6)

    seg_profiles = [
        SegmentProfile(
            segment=s,
            fwd_us=time_us("forward", s),
            bwd_us=time_us("backward", s),
            saved_bytes=saved.get(s, 0),
            saved_tensor_bytes=swap_bytes.get(s, 0),
            input_bytes=inputs.get(s, 0),
            fwd_peak_bytes=peaks.get(("forward", s), 0),
            bwd_peak_bytes=peaks.get(("backward", s), 0),
        )
        for s in segments
    ]
    shape = {n: list(sh) for n, sh, _ in facts.params}
    dtype = {n: d for n, _, d in facts.params}
    params = [
        ParamInfo(
            name=n,
            shape=shape[n],
            dtype=dtype[n],
            frozen=n in facts.frozen,
            uses=[s for s in segments if n in facts.uses[s]],
        )
        for n in facts.order
    ]
    attention = "sdpa"
    if cuda:
        flags = [
            k
            for k, on in (
                ("flash", torch.backends.cuda.flash_sdp_enabled()),
                ("mem_efficient", torch.backends.cuda.mem_efficient_sdp_enabled()),
                ("math", torch.backends.cuda.math_sdp_enabled()),
            )
            if on
        ]
        attention = f"sdpa ({', '.join(flags)} enabled)"
    else:
        attention = "sdpa (cpu)"
    return Profile(
        profile_version=PROFILE_VERSION,
        source="measured",
        generator=generator(),
        model=ProfileModel(
            name=name,
            fingerprint=plan.model.fingerprint,
            n_params=plan.model.n_params,
            blocks=list(blocks),
            tied=[list(p) for p in plan.model.tied],
        ),
        training=ProfileTraining(
            micro_batch=micro_batch, seq_len=seq_len, compute_dtype=compute_dtype
        ),
        device=torch.cuda.get_device_name(dev) if cuda else "cpu",
        attention=attention,
        bootstrap=bool(bootstrap),
        iterations=measured,
        segments=seg_profiles,
        params=params,
        hardware=spec,
    )
