"""Measuring a Profile: train the model for a few steps under the executor with a profiling
plan (``profiling_plan``, emitted like any plan) and observe every segment boundary.

It lives with the commands because it runs the engine, as ``train`` does: it needs the
search's ``emit`` for its plan and the executor for its steps, so it sits above both (the
Profile type it fills is ``profiling/profile.py``'s, torch-free, below the search).
"""

from __future__ import annotations

import math

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
    bootstrap: bool | None = None,
    seed: int = 0,
    progress=None,
) -> Profile:
    """Measure a Profile by training ``model`` (real weights, any device) for a few steps
    under the executor with a profiling plan, observing every segment boundary.

    Times: CUDA events on GPU, ``perf_counter`` on CPU; the median of ``iterations``
    measured steps after ``warmup``. Saved activations: the executor's own counting
    (forced on, also on CUDA), so profile and ledger agree by construction. Transient
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
    try:
        for i in range(warmup + iterations):
            if i == warmup:
                spans.clear()
                peaks.clear()
            x, y = next(data)
            inputs["<pre>"] = x.to(dev).untyped_storage().nbytes()
            saved.clear()
            swap_bytes.clear()
            engine.step((x, y))
            if progress is not None:
                progress(i + 1, warmup + iterations)
    finally:
        for h in handles:
            h.remove()
        engine.close()

    def median_us(phase: str, seg: str) -> int:
        return round(statistics.median(spans[(phase, seg)]) * 1e6)

    seg_profiles = [
        SegmentProfile(
            segment=s,
            fwd_us=median_us("forward", s),
            bwd_us=median_us("backward", s),
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
        iterations=iterations,
        segments=seg_profiles,
        params=params,
        hardware=spec,
    )
