"""CUDA-only checks of the executor: streams, bf16 parity against autocast, device memory.

Skipped without CUDA (tests/conftest.py). Written for a lent GPU run
(tools/gpu_check.sh); none of this can run on the CPU CI machine.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from harness import MICRO_BATCH, SEQ_LEN, make_model, make_plan, sleeper

from protrain.executor import AdamWConfig, wrap
from protrain.executor.schedule import Phase
from protrain.planner.models.data import batches, load_tokens
from protrain.planner.search import memory_walk

pytestmark = pytest.mark.gpu

MATRIX = [
    ("all", 0, "keep"),
    ([], 2, "keep"),
    ([0, 2], 2, "swap checkpoint keep keep"),
    ([], 2, "checkpoint"),
    ([], 2, "swap"),
]


def _reference_losses(model, steps, config, dtype):
    """Plain PyTorch: fp32 parameters, autocast compute, fused AdamW on the GPU."""
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=True,
    )
    data = batches(load_tokens(), MICRO_BATCH, SEQ_LEN, 0)
    torch.manual_seed(1234)
    losses = []
    for _ in range(steps):
        x, y = (t.cuda() for t in next(data))
        with torch.autocast("cuda", dtype=dtype):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("persistent,n_buffer,policies", MATRIX)
@pytest.mark.parametrize("model_name", ["gpt2-4", "llama-4"])
def test_bf16_matches_autocast(model_name, persistent, n_buffer, policies):
    # Tolerance: our chunks hold bf16 parameters (pure bf16 compute, fp32 masters)
    # while autocast keeps fp32 parameters and runs norms/softmax in fp32; the two
    # differ by bf16 rounding (8 mantissa bits, ~4e-3 relative per op). Over 10
    # steps of a 4-block model the losses stay within 2e-2 relative.
    config = AdamWConfig(lr=1e-3)
    plan = make_plan(
        model_name,
        persistent=persistent,
        n_buffer=n_buffer,
        policies=policies,
        compute_dtype="bfloat16",
    )
    base = make_model(model_name)
    base.eval()  # dropout off: the two sides draw CUDA RNG in different orders
    ref = copy.deepcopy(base).cuda()
    ref_losses = _reference_losses(ref, 10, config, torch.bfloat16)
    engine = wrap(base, plan, config, device="cuda")
    data = batches(load_tokens(), MICRO_BATCH, SEQ_LEN, 0)
    losses = [engine.step(next(data)).loss for _ in range(10)]
    assert all(math.isfinite(v) for v in losses)
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 2e-2 * abs(b), (losses, ref_losses)


def _fp32_against_plain(model_name, plan, rel: float, nvme_dir=None):
    """10 steps of ``plan`` on CUDA in lock step with plain fp32 PyTorch and fused AdamW on
    the GPU: each loss within ``rel`` relative."""
    config = AdamWConfig(lr=1e-3)
    base = make_model(model_name)
    base.eval()
    ref = copy.deepcopy(base).cuda()
    opt = torch.optim.AdamW(
        ref.parameters(),
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=True,
    )
    engine = wrap(base, plan, config, device="cuda", nvme_dir=nvme_dir)
    d1 = batches(load_tokens(), MICRO_BATCH, SEQ_LEN, 0)
    d2 = batches(load_tokens(), MICRO_BATCH, SEQ_LEN, 0)
    for _ in range(10):
        ours = engine.step(next(d1)).loss
        x, y = (t.cuda() for t in next(d2))
        loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert abs(ours - loss.item()) <= rel * abs(loss.item())
    return engine


@pytest.mark.parametrize("model_name", ["gpt2-4", "llama-4"])
def test_fp32_offloaded_matches_plain(model_name):
    # fp32 on CUDA: the only kernel that differs from plain PyTorch is AdamW on the
    # CPU (offloaded chunks) vs AdamW on the GPU (reference): fused kernels on two
    # devices round differently in the last bits; 1e-5 relative over 10 steps.
    plan = make_plan(model_name, persistent=[0], n_buffer=2, policies="swap checkpoint keep swap")
    _fp32_against_plain(model_name, plan, 1e-5)


@pytest.mark.parametrize("model_name", ["gpt2-4", "llama-4"])
def test_device_homed_chunks_match_plain_on_cuda(model_name):
    # chunks.py [Note: device homes] on CUDA: the fetch's device-to-device rounding copy on
    # the copy stream, the step on compute right after the gradients complete. fp32 AdamW
    # runs on the GPU on both sides (our pieces and the reference's per-parameter lists of
    # one elementwise fused kernel): 1e-6 relative over 10 steps; nothing on the host.
    plan = make_plan(
        model_name,
        persistent=[],
        n_buffer=2,
        policies="swap checkpoint keep swap",
        device_homed="all",
    )
    engine = _fp32_against_plain(model_name, plan, 1e-6)
    assert engine.ledger.host_bytes == 0


@pytest.mark.parametrize("model_name", ["gpt2-4", "llama-4"])
def test_nvme_chunks_match_plain_on_cuda(model_name, tmp_path):
    # executor/nvme.py on CUDA: fp32 homes in the mapped file (pageable memory) uploaded on the
    # copy stream, dropped after the upload is issued; the CPU step on the file's pieces.
    # AdamW of offloaded chunks runs on the CPU as in test_fp32_offloaded_matches_plain: 1e-5.
    plan = make_plan(
        model_name, persistent=[], n_buffer=2, policies="swap checkpoint keep swap", nvme="all"
    )
    engine = _fp32_against_plain(model_name, plan, 1e-5, nvme_dir=tmp_path)
    assert engine.ledger.host_bytes == memory_walk.walk(plan).host_bytes


def test_offloaded_plan_holds_device_memory_to_its_states_plus_activations():
    plan = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="checkpoint")
    engine = wrap(make_model("gpt2-4"), plan, AdamWConfig(), device="cuda")
    data = batches(load_tokens(), MICRO_BATCH, SEQ_LEN, 0)
    engine.step(next(data))  # warm-up: CUDA context, AdamW state, allocator pools
    marks = {}
    original_end = engine.replayer.end

    def end(phase, segment):
        if phase is Phase.FORWARD and segment == "<post>":
            marks["fwd_end"] = torch.cuda.memory_allocated()
        original_end(phase, segment)

    engine.replayer.end = end
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine.step(next(data))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    walk = memory_walk.walk(plan)
    states = (
        walk.states_bytes
        + walk.buffers_bytes
        + max(  # + the offloaded gradients open at once
            k.get("grads", 0) for _, _, k in memory_walk.step_highs(walk.events)
        )
    )
    activations = marks["fwd_end"] - before  # measured: what forward left on the device
    # Slack for the logits' gradient and kernel workspaces during backward.
    assert peak <= states + max(activations, 0) + 64 * 2**20, (peak, states, activations)


def test_streams_overlap_without_races_under_delays():
    slow = sleeper(before_weights_return=0.01)  # a slow CPU AdamW worker, on both engines
    plan = make_plan("llama-4", persistent=[], n_buffer=2, policies="swap")
    base = make_model("llama-4")
    base.eval()
    ref_engine = wrap(copy.deepcopy(base), plan, AdamWConfig(), device="cpu")
    engine = wrap(base, plan, AdamWConfig(), device="cuda")
    ref_engine.on_event(slow)
    engine.on_event(slow)
    data1 = batches(load_tokens(), MICRO_BATCH, SEQ_LEN, 0)
    data2 = batches(load_tokens(), MICRO_BATCH, SEQ_LEN, 0)
    for _ in range(5):
        a, b = engine.step(next(data1)).loss, ref_engine.step(next(data2)).loss
        assert abs(a - b) <= 1e-4 * abs(b)


def test_chunks_come_from_a_pool_sized_by_the_plan():
    """[Note: chunk memory pool]: chunk and gradient storage is reserved up front in a private
    pool, so fetches reuse its blocks; the step reports the allocator's reserved peak."""
    from protrain.executor.chunks import pool_slots

    plan = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="swap checkpoint keep keep")
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    engine = wrap(make_model("gpt2-4"), plan, AdamWConfig(), device="cuda")
    if engine.copies.pool is None:
        pytest.skip("this torch has no torch.cuda.MemPool")
    chunk_bytes = plan.chunks.chunk_numel * 4
    assert torch.cuda.memory_reserved() - before >= pool_slots(plan) * chunk_bytes
    data = batches(load_tokens(), MICRO_BATCH, SEQ_LEN, 0)
    results = [engine.step(next(data)) for _ in range(3)]
    assert all(r.reserved_peak_bytes >= r.peak_bytes > 0 for r in results)
    assert results[-1].alloc_retries == 0
    engine.close()
