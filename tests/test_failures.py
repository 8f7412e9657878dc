"""Failure behaviour: a NaN/inf loss stops before the update (fp32/bf16) or skips the
step (fp16 loss scaling); a NaN/inf gradient with a finite loss stops before its chunk
steps, and a partly updated state is never saved; running out of device memory names the phase,
the block and the predicted vs actual memory, and suggests a budget with a margin."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from harness import make_model, make_plan

from protrain.executor import AdamWConfig, wrap
from protrain.planner.models.data import batches, load_tokens
from protrain.plans.errors import BudgetError, NonFiniteGradientError, NonFiniteLossError

PLAN = dict(persistent=[0], n_buffer=2, policies="keep checkpoint swap keep")


def _poison(model, block: int, when):
    """Make block ``block``'s output non-finite while ``when()`` is true."""

    def hook(module, args, output):
        if when():
            h = output[0] if isinstance(output, tuple) else output
            return (
                h * float("nan")
                if not isinstance(output, tuple)
                else (h * float("nan"), *output[1:])
            )
        return output

    return model.transformer.h[block].register_forward_hook(hook)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nan_loss_stops_before_the_update(dtype, tmp_path):
    model = make_model("gpt2-4")
    engine = wrap(
        model, make_plan("gpt2-4", compute_dtype=dtype, **PLAN), AdamWConfig(lr=1e-3), device="cpu"
    )
    data = batches(load_tokens(), 4, 32, 0)
    for _ in range(2):
        engine.step(next(data))
    good = engine.save(tmp_path)
    before = engine.state_dict()
    _poison(model, 2, lambda: True)
    with pytest.raises(NonFiniteLossError, match="at step 3") as e:
        engine.step(next(data))
    assert f"HINT: resume from the last checkpoint ({good}, the newest" in str(e.value)
    after = engine.state_dict()  # nothing changed: the check runs before backward
    for n, t in before["model"].items():
        assert torch.equal(t, after["model"][n]), n
    for n, st in before["optim"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[k], after["optim"][n][k]), (n, k)
    engine.close()


def test_fp16_nan_loss_skips_the_step_and_goes_on():
    model = make_model("gpt2-4")
    engine = wrap(
        model,
        make_plan("gpt2-4", compute_dtype="float16", **PLAN),
        AdamWConfig(lr=1e-3, loss_scale=2.0**10),
        device="cpu",
    )
    data = batches(load_tokens(), 4, 32, 0)
    poisoned = [False]
    _poison(model, 1, lambda: poisoned[0])
    engine.step(next(data))
    before = engine.state_dict()["model"]
    poisoned[0] = True
    res = engine.step(next(data))
    assert res.skipped and not math.isfinite(res.loss) and engine.scaler.scale == 2.0**9
    assert all(torch.equal(t, engine.state_dict()["model"][n]) for n, t in before.items())
    poisoned[0] = False
    assert not engine.step(next(data)).skipped
    engine.close()


OFFLOADED, PERSISTENT = "transformer.h.3.mlp.c_fc.weight", "transformer.wte.weight"


@pytest.mark.parametrize(
    ("dtype", "cpu_adam", "param"),
    [
        ("float32", "during_backward", OFFLOADED),  # the CPU-Adam worker's check
        ("bfloat16", "during_backward", OFFLOADED),  # 16-bit gradients landed in the home
        ("float32", "during_backward", PERSISTENT),  # the persistent chunks' check
        ("bfloat16", "after_backward", PERSISTENT),  # the global norm's
    ],
)
def test_nonfinite_gradient_stops_before_its_chunk_steps(tmp_path, dtype, cpu_adam, param):
    """The loss stays finite; one parameter's gradient is inf (an offloaded chunk's, or the
    persistent chunk's). Its chunk never steps, nothing non-finite is saved, and the error names
    the last finite checkpoint (during backward it may come from the step or from the save)."""
    model = make_model("gpt2-4")
    engine = wrap(
        model,
        make_plan("gpt2-4", compute_dtype=dtype, cpu_adam=cpu_adam, **PLAN),
        AdamWConfig(lr=1e-3),
        device="cpu",
    )
    cid = next(
        c.id for c in engine.store.chunks for p, _, _ in c.params if engine.names[id(p)] == param
    )
    data = batches(load_tokens(), 4, 32, 0)
    for _ in range(2):
        engine.step(next(data))
    good = engine.save(tmp_path)
    masters = [engine.optim.master[c.id].clone() for c in engine.store.chunks]
    dict(model.named_parameters())[param].register_hook(lambda g: g * float("inf"))
    with pytest.raises(NonFiniteGradientError, match=f"at step 3: chunk {cid} ") as e:
        engine.step(next(data))
        engine.save(tmp_path)  # the periodic / end-of-run / Ctrl-C save of the train loop
    assert f"the last finite checkpoint is {good}" in str(e.value) and f"--resume {good}" in str(
        e.value
    )
    assert torch.equal(engine.optim.master[cid], masters[cid])  # the chunk never stepped
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "latest", good.name]
    with pytest.raises(NonFiniteGradientError):  # and it never will, nor anything else
        engine.step(next(data))
    if cpu_adam == "after_backward":  # nothing stepped: the state is step 2's
        assert not e.value.partial
        assert all(
            torch.equal(engine.optim.master[c.id], masters[c.id]) for c in engine.store.chunks
        )
    with contextlib.suppress(NonFiniteGradientError):  # (a CPU step's error comes back once more)
        engine.close()


def test_nonfinite_gradient_before_any_update_leaves_the_state_of_the_step_before():
    model = make_model("gpt2-4")
    engine = wrap(
        model,
        make_plan("gpt2-4", cpu_adam="after_backward", **PLAN),
        AdamWConfig(lr=1e-3),
        device="cpu",
    )
    data = batches(load_tokens(), 4, 32, 0)
    engine.step(next(data))
    before = engine.state_dict()
    model.transformer.h[1].attn.c_attn.weight.register_hook(lambda g: g * float("nan"))
    with pytest.raises(
        NonFiniteGradientError, match="no checkpoint was saved or loaded in this run"
    ):
        engine.step(next(data))
    after = engine.state_dict()  # saveable: no chunk stepped
    for part in ("model", "optim"):
        for n, t in before[part].items():
            same = (
                torch.equal(t, after[part][n])
                if part == "model"
                else all(torch.equal(v, after[part][n][k]) for k, v in t.items())
            )
            assert same, (part, n)
    engine.close()


def test_finite_gradients_whose_norm_overflows_still_step():
    """The global norm is inf, every gradient finite: the guard looks chunk by chunk and lets the
    step run (clipped to zero), as plain PyTorch does."""
    model = make_model("gpt2-4")
    engine = wrap(
        model,
        make_plan("gpt2-4", cpu_adam="after_backward", **PLAN),
        AdamWConfig(lr=1e-3, max_grad_norm=1.0),
        device="cpu",
    )
    model.transformer.h[1].attn.c_attn.weight.register_hook(lambda g: torch.full_like(g, 3e38))
    result = engine.step(next(batches(load_tokens(), 4, 32, 0)))
    assert result.grad_norm == float("inf") and engine.steps_done == 1
    engine.close()


@pytest.mark.parametrize(
    ("dtype", "cpu_adam", "param"),
    [
        ("float32", "during_backward", OFFLOADED),  # the CPU-Adam worker, one call per chunk
        ("bfloat16", "during_backward", OFFLOADED),  # the worker, landed 16-bit gradients in pieces
        ("float32", "after_backward", OFFLOADED),  # the worker, gradients proved finite by the norm
        ("float32", "during_backward", PERSISTENT),  # the device step
    ],
)
def test_finite_gradients_whose_squares_overflow_are_refused_at_their_step(
    tmp_path, dtype, cpu_adam, param
):
    """Issue 39 item 7: a gradient of 1e38 is finite, its square is not: Adam's exp_avg_sq
    becomes inf. The step that does it is refused like a non-finite gradient (naming the moment),
    nothing non-finite is saved, and no later step runs."""
    model = make_model("gpt2-4")
    engine = wrap(
        model,
        make_plan("gpt2-4", compute_dtype=dtype, cpu_adam=cpu_adam, **PLAN),
        AdamWConfig(lr=1e-3),
        device="cpu",
    )
    cid = next(
        c.id for c in engine.store.chunks for p, _, _ in c.params if engine.names[id(p)] == param
    )
    data = batches(load_tokens(), 4, 32, 0)
    engine.step(next(data))
    good = engine.save(tmp_path)
    dict(model.named_parameters())[param].register_hook(lambda g: torch.full_like(g, 1e38))
    with pytest.raises(NonFiniteGradientError, match=f"exp_avg_sq .*at step 2: chunk {cid} ") as e:
        engine.step(next(data))
        engine.optim.wait_all()  # (the worker's step: its error comes back here)
    assert e.value.partial and f"the last finite checkpoint is {good}" in str(e.value)
    with pytest.raises(NonFiniteGradientError, match="exp_avg_sq"):  # never saved …
        engine.save(tmp_path)
    with pytest.raises(NonFiniteGradientError, match="exp_avg_sq"):  # … nor stepped again
        engine.step(next(data))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "latest", good.name]
    with contextlib.suppress(NonFiniteGradientError):
        engine.close()


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_out_of_memory_names_phase_block_and_budget(where):
    model = make_model("gpt2-4")
    plan = make_plan("gpt2-4", **PLAN)
    engine = wrap(model, plan, AdamWConfig(), device="cpu")
    block = model.transformer.h[1]

    def oom(*_):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    if where == "forward":
        block.register_forward_pre_hook(oom)
    else:
        block.mlp.register_full_backward_pre_hook(oom)
    data = batches(load_tokens(), 4, 32, 0)
    with pytest.raises(BudgetError) as e:
        engine.step(next(data))
    msg = str(e.value)
    assert f"out of device memory in the {where} of transformer.h.1 at step 1" in msg
    assert "the plan predicted a peak of" in msg and "Tried to allocate 2.00 GiB" in msg
    assert "--budget" in msg
