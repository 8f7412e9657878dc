"""CUDA-only checks of issue #14's fixes in bf16: swap on a GPU, fp32 masters, evaluate.

Skipped without CUDA (tests/conftest.py), like the rest of tests/gpu; run by
tools/gpu_check.sh on a lent GPU. Each test names what it would catch there that
the CPU suite cannot:

- swap with dropout on: flash / efficient SDPA save their philox seed and offset as
  CPU scalars, which a swap must leave where they are (a crash on CUDA otherwise);
- masters: the fp32 master weights are the user's fp32 parameters, not their bf16
  rounding, right after ``wrap``;
- ``evaluate`` between steps: a no-grad forward that must restore chunk residency on
  a real device (an illegal address on CUDA otherwise) and leave training unchanged.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from harness import MICRO_BATCH, SEQ_LEN, make_model, make_plan

from protrain.executor import AdamWConfig, wrap
from protrain.planner.models.data import batches, load_tokens

pytestmark = pytest.mark.gpu

MODELS = [
    "gpt2-tiny",
    "llama-tiny",
]  # the zoo's tiny models (two blocks; dropout 0.1 from make_model)
STEPS = 8


def _train(model, plan, steps: int = STEPS, seed: int = 1234) -> list[float]:
    """``steps`` bf16 steps of ``plan`` on CUDA from a fixed RNG state; the losses."""
    engine = wrap(model, plan, AdamWConfig(lr=1e-3), device="cuda")
    data = batches(load_tokens(), MICRO_BATCH, SEQ_LEN, 0)
    torch.manual_seed(seed)  # CPU and CUDA generators: the same dropout masks on both sides
    try:
        return [engine.step(next(data)).loss for _ in range(steps)]
    finally:
        engine.close()


def _close(a: list[float], b: list[float], rtol: float) -> bool:
    return all(math.isfinite(x) and abs(x - y) <= rtol * abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("offloaded", [False, True], ids=["persistent+swap", "offloaded+swap"])
@pytest.mark.parametrize("model_name", MODELS)
def test_bf16_swap_matches_all_persistent_keep(model_name, offloaded):
    # Dropout stays on (train mode): SDPA's dropout is what makes flash / efficient
    # attention save CPU philox scalars, the tensors a swap must not move.
    # Tolerance: swap copies saved tensors to pinned host memory and back bit for bit,
    # and both sides draw the same dropout masks (same seed, same op order), so with
    # every chunk persistent the losses differ only by non-deterministic bf16 backward
    # kernels (atomic adds in SDPA's and the embedding's backward): 2e-3 relative.
    # With chunks offloaded, their masters also step on the CPU (fused AdamW there vs
    # on the GPU: fp32 last-bit differences that can flip a bf16 rounding of a weight),
    # which over 8 steps of a tiny model stays within 1e-2 relative.
    ref_plan = make_plan(
        model_name, persistent="all", n_buffer=0, policies="keep", compute_dtype="bfloat16"
    )
    plan = (
        make_plan(model_name, persistent=[], n_buffer=2, policies="swap", compute_dtype="bfloat16")
        if offloaded
        else make_plan(
            model_name, persistent="all", n_buffer=0, policies="swap", compute_dtype="bfloat16"
        )
    )
    base = make_model(model_name)
    ref = _train(copy.deepcopy(base), ref_plan)
    ours = _train(base, plan)
    assert _close(ours, ref, 1e-2 if offloaded else 2e-3), (ours, ref)


@pytest.mark.parametrize("persistent", ["all", [0], []], ids=["persistent", "mixed", "offloaded"])
@pytest.mark.parametrize("model_name", MODELS)
def test_bf16_masters_are_the_users_fp32_parameters(model_name, persistent):
    # Right after wrap, before any step: the fp32 masters (on the GPU for persistent
    # chunks, on the host for offloaded ones) must be the parameters the user handed
    # over, bit for bit, not the bf16 copy in the chunks cast back up.
    n_buffer = 0 if persistent == "all" else 2
    plan = make_plan(
        model_name,
        persistent=persistent,
        n_buffer=n_buffer,
        policies="keep",
        compute_dtype="bfloat16",
    )
    model = make_model(model_name)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert any(
        (p.to(torch.bfloat16).float() != p).any() for p in original.values()
    )  # not all bf16-exact
    engine = wrap(model, plan, AdamWConfig(), device="cuda")
    try:
        sd = engine.state_dict()["model"]
    finally:
        engine.close()
    for name, p in original.items():
        got = sd[name]
        assert got.dtype == torch.float32 and got.shape == p.shape, name
        assert torch.equal(got.cpu(), p), f"{name}: max |diff| {(got.cpu() - p).abs().max().item()}"
    for name, alias in plan.model.tied:  # tied aliases report the same master
        assert torch.equal(sd[alias].cpu(), original[name]), alias


@pytest.mark.parametrize("model_name", MODELS)
def test_bf16_evaluate_between_steps_leaves_training_unchanged(model_name):
    # The plan that segfaulted on CPU and would read freed device memory on CUDA: every
    # chunk offloaded (storage resized to 0 between steps) and every block swapped.
    # Dropout off, so the comparison is about state, not about RNG draws.
    # Tolerances: evaluate's loss is the same weights on the same batch as the next
    # step's forward; only the no-grad path may pick another SDPA kernel (1e-3
    # relative). The run with evaluate against the run without: non-deterministic
    # bf16 backward kernels only, as above (2e-3 relative over 4 steps).
    plan = make_plan(
        model_name, persistent=[], n_buffer=2, policies="swap", compute_dtype="bfloat16"
    )
    base = make_model(model_name)
    base.eval()
    plain_model = copy.deepcopy(base)

    def run(model, with_eval: bool):
        engine = wrap(model, plan, AdamWConfig(lr=1e-3), device="cuda")
        data = batches(load_tokens(), MICRO_BATCH, SEQ_LEN, 0)
        held_out = next(batches(load_tokens(), MICRO_BATCH, SEQ_LEN, 99))
        losses, evals = [], []
        try:
            for i in range(4):
                batch = next(data)
                if with_eval and i > 0:
                    evals.append(engine.evaluate(held_out))
                    evals.append(engine.evaluate(batch))  # the batch this step trains on next
                losses.append(engine.step(batch).loss)
            torch.cuda.synchronize()
        finally:
            engine.close()
        return losses, evals

    ours, evals = run(base, True)
    plain, _ = run(plain_model, False)
    assert all(isinstance(v, float) and math.isfinite(v) for v in evals), evals
    for i, step_loss in enumerate(ours[1:]):
        assert abs(evals[2 * i + 1] - step_loss) <= 1e-3 * abs(step_loss), (i, evals, ours)
    assert _close(ours, plain, 2e-3), (ours, plain)
