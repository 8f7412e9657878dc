"""Every policy against plain PyTorch in lock step, exact on CPU fp32.

A plan moves tensors; it must not change arithmetic. Each plan trains 20 steps with
dropout on, and the per-step losses, final parameters and AdamW moments must equal
plain ``torch.optim.AdamW(fused=True)`` training with rtol=0, atol=0. Flat chunk
AdamW equals per-parameter AdamW bit for bit (the update is elementwise; see
executor/optim.py [Note: optimizer placement]).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import PARITY_MATRIX, assert_same_state, lockstep, make_plan

from protrain import plans
from protrain.executor import AdamWConfig

MATRIX = PARITY_MATRIX


def _plan(model: str, case: str, **kw):
    persistent, n_buffer, policies = MATRIX[case]
    if model == "gpt2-4" and n_buffer == 1:
        n_buffer = 2  # GPT-2's tied head uses the embedding chunk and ln_f's at once
    return make_plan(model, persistent=persistent, n_buffer=n_buffer, policies=policies, **kw)


@pytest.mark.parametrize("case", list(MATRIX))
@pytest.mark.parametrize("model", ["gpt2-4", "llama-4"])
def test_matrix_is_exact(model, case):
    run = lockstep(model, _plan(model, case))
    assert run.losses == run.ref_losses
    assert_same_state(run)


@pytest.mark.parametrize(
    "persistent,policies", [([0], "swap checkpoint"), ([], "checkpoint swap"), ([1], "keep swap")]
)
@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny"])
def test_zoo_tiny_models_are_exact(model, persistent, policies):
    run = lockstep(
        model, make_plan(model, persistent=persistent, n_buffer=2, policies=policies), steps=8
    )
    assert run.losses == run.ref_losses
    assert_same_state(run)


@pytest.mark.parametrize("model", ["gpt2-4", "llama-4"])
def test_gradient_accumulation_is_exact(model):
    run = lockstep(model, _plan(model, "interleaved", grad_accum=3), steps=6)
    assert run.losses == run.ref_losses
    assert_same_state(run)


@pytest.mark.parametrize("model", ["gpt2-4", "llama-4"])
def test_clipping_is_exact(model):
    # max_grad_norm small enough that every step clips.
    run = lockstep(
        model,
        _plan(model, "mixed", cpu_adam="after_backward"),
        steps=8,
        config=AdamWConfig(lr=2e-3, weight_decay=0.1, max_grad_norm=0.05),
    )
    assert all(r.grad_norm is not None and r.grad_norm > 0.05 for r in run.results)
    assert run.losses == run.ref_losses
    assert_same_state(run)


def test_losses_fall():
    run = lockstep("gpt2-4", _plan("gpt2-4", "interleaved"), steps=40)
    assert sum(run.losses[-5:]) / 5 < sum(run.losses[:5]) / 5 - 0.5


@pytest.mark.parametrize(
    "path",
    sorted((Path(__file__).parent / "fixtures" / "plans").glob("v*/*.json")),
    ids=lambda p: p.name,
)
def test_frozen_fixture_plans_train_exactly(path):
    plan = plans.load(path)
    if plan.training.world_size > 1:
        pytest.skip("a multi-rank plan: tests/test_dist.py trains it")
    if plan.training.compute_dtype != "float32":
        pytest.skip(
            "16-bit (homeless chunks): tests/test_host_layout.py trains it against its homes kept"
        )
    if any(p.frozen for c in plan.chunks.items for p in c.params):
        pytest.skip(
            "a LoRA plan (frozen parameters): tests/test_lora.py trains it with its adapters"
        )
    run = lockstep(plan.model.name, plan, steps=5)
    assert run.losses == run.ref_losses
