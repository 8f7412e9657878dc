"""The CPU ledger against per-phase formulas.

Each expected value is a sum of named terms. On CPU the ledger counts bytes
deterministically, so equality is exact; what it counts is listed in
executor/memory.py.
"""

from __future__ import annotations

import pytest
import torch
from harness import make_model, make_plan

from protrain.executor import AdamWConfig, wrap
from protrain.executor.schedule import Phase
from protrain.planner.models.data import batches, load_tokens

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def states_after_wrap(plan) -> int:
    numel = plan.chunks.chunk_numel
    cb = DTYPE_BYTES[plan.training.compute_dtype]
    n = plan.placement.n_persist
    return (
        n * numel * cb  # persistent chunks' parameters (compute dtype)
        + n * numel * cb  # their gradient buffers (compute dtype)
        + n * numel * 8  # their AdamW moments, fp32
        + (n * numel * 4 if cb != 4 else 0)  # fp32 masters, unless the chunk itself is fp32
    )


def run_step(plan, model="gpt2-4"):
    engine = wrap(make_model(model), plan, AdamWConfig(), device="cpu")
    after_wrap = engine.ledger.current_bytes
    fwd_end = {}
    original_end = engine.replayer.end

    def end(phase, segment):
        original_end(phase, segment)
        if phase is Phase.FORWARD and segment == "<post>":
            fwd_end.update(engine.ledger.bytes)

    engine.replayer.end = end
    res = engine.step(next(batches(load_tokens(), 4, 32, 0)))
    return engine, after_wrap, fwd_end, res


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "persistent,n_buffer,policies",
    [
        ("all", 0, "keep"),
        ([0, 2], 2, "swap checkpoint keep keep"),
        ([], 2, "checkpoint"),
    ],
)
def test_after_wrap_and_after_step(dtype, persistent, n_buffer, policies):
    plan = make_plan(
        "gpt2-4", persistent=persistent, n_buffer=n_buffer, policies=policies, compute_dtype=dtype
    )
    engine, after_wrap, fwd_end, res = run_step(plan)
    assert after_wrap == states_after_wrap(plan)
    # After the step: every offloaded chunk released, every activation freed.
    assert engine.ledger.current_bytes == after_wrap
    assert engine.ledger.bytes["activations"] == 0
    assert fwd_end["activations"] > 0
    assert res.peak_bytes >= after_wrap + fwd_end["activations"]


def test_all_persistent_keep_peaks_at_the_end_of_forward():
    plan = make_plan("gpt2-4", persistent="all", n_buffer=0, policies="keep")
    engine, after_wrap, fwd_end, res = run_step(plan)
    # Nothing is allocated after forward in this plan; backward only frees.
    assert res.peak_bytes == after_wrap + fwd_end["activations"]


def test_offloaded_peak_is_bounded_by_buffers_and_activations():
    plan = make_plan("gpt2-4", persistent=[], n_buffer=2, policies="keep")
    engine, after_wrap, fwd_end, res = run_step(plan)
    chunk_bytes = plan.chunks.chunk_numel * 4
    assert after_wrap == 0
    # n_buffer chunks, each with its gradient buffer, plus forward's activations.
    assert res.peak_bytes <= 2 * 2 * chunk_bytes + fwd_end["activations"]


def test_peak_falls_as_plans_offload_more(capsys):
    peaks = {}
    for label, persistent, n_buffer, policies in [
        ("all-persistent keep", "all", 0, "keep"),
        ("mixed", [0, 2], 2, "swap checkpoint keep keep"),
        ("all-offloaded keep", [], 2, "keep"),
        ("all-offloaded checkpoint", [], 2, "checkpoint"),
    ]:
        plan = make_plan("gpt2-4", persistent=persistent, n_buffer=n_buffer, policies=policies)
        peaks[label] = run_step(plan)[3].peak_bytes
    with capsys.disabled():
        print(
            "\nCPU ledger peak per plan (gpt2-4, B=4, T=32, fp32):",
            ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in peaks.items()),
        )
    values = list(peaks.values())
    assert values == sorted(values, reverse=True) and len(set(values)) == len(values)
    # The all-persistent plan holds every chunk with gradients and moments; the offloaded
    # one holds at most n_buffer chunks: the difference is at least what left the device.
    plan = make_plan("gpt2-4", persistent="all", n_buffer=0, policies="keep")
    moved = states_after_wrap(plan) - 2 * 2 * plan.chunks.chunk_numel * 4
    assert peaks["all-persistent keep"] - peaks["all-offloaded keep"] >= moved


@pytest.mark.parametrize(
    "dtype,grad_accum", [("float32", 1), ("float32", 2), ("bfloat16", 1), ("bfloat16", 2)]
)
def test_pinned_host_memory_is_one_arena_sized_by_the_plan(dtype, grad_accum):
    """[Note: pinned arena]: every offloaded chunk's home and, unless its gradients land in
    the home (bf16 without accumulation), its fp32 gradient accumulator (the download's
    target) and with accumulation a staging buffer, is a slice of one allocation made at
    wrap, exactly as large as the plan's chunks need."""
    from protrain.executor.transfer import HostArena

    plan = make_plan(
        "gpt2-4",
        persistent=[0],
        n_buffer=2,
        policies="keep",
        compute_dtype=dtype,
        grad_accum=grad_accum,
    )
    engine = wrap(make_model("gpt2-4"), plan, device="cpu")
    store, arena = engine.store, engine.store.arena
    off = [c for c in store.chunks if not c.persistent]
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    in_home = dtype == "bfloat16" and grad_accum == 1

    def per_chunk(n: int) -> int:  # n: the chunk's host elements (accounting.host_numel)
        return HostArena.span(n, torch_dtype) + (
            0
            if in_home
            else (
                HostArena.span(n, torch.float32) + HostArena.span(n, torch_dtype) * (grad_accum > 1)
            )
        )

    assert (
        len(off) >= 2
        and arena.buffer.numel() == sum(per_chunk(c.home.numel()) for c in off) == arena.offset
    )
    base = arena.buffer.untyped_storage().data_ptr()
    buffers = (
        [c.home for c in off]
        + list(engine.optim.staging.values())
        + list(engine.optim.cpu_grad.values())
    )
    assert len(buffers) == len(off) * (1 if in_home else 2 + (grad_accum > 1))
    assert all(b.untyped_storage().data_ptr() == base for b in buffers)
    data = batches(load_tokens(), 4, 32, 0)
    engine.step([next(data) for _ in range(grad_accum)])  # and it trains
    engine.close()
