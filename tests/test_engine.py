"""The engine's contract beyond parity: refusals before any state changes, dtypes,
fp16 loss scaling, state dicts in plain names and resuming under another plan."""

from __future__ import annotations

import copy
import itertools
import math

import msgspec
import pytest
import torch
from harness import lockstep, make_model, make_plan

from protrain import plans
from protrain.executor import AdamWConfig, wrap
from protrain.planner.models.data import batches, load_tokens
from protrain.plans import plan as P
from protrain.plans.errors import ConfigError, FingerprintError, PlanError


def _data():
    return batches(load_tokens(), 4, 32, 0)


def _snapshot(model):
    return {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}


def test_plan_for_another_model_is_refused_before_anything_changes():
    model = make_model("llama-4")
    before = _snapshot(model)
    with pytest.raises(FingerprintError, match="made for another model"):
        wrap(model, make_plan("gpt2-4", persistent=[], n_buffer=2, policies="keep"))
    after = _snapshot(model)
    assert all(
        before[n][0] == after[n][0] and torch.equal(before[n][1], after[n][1]) for n in before
    )


def test_schedule_exceeding_its_buffers_is_refused():
    plan = make_plan("gpt2-4", persistent=[], n_buffer=2, policies="keep")
    squeezed = msgspec.structs.replace(
        plan, placement=msgspec.structs.replace(plan.placement, n_buffer=1)
    )
    model = make_model("gpt2-4")
    before = _snapshot(model)
    with pytest.raises(PlanError, match="n_buffer is 1"):
        wrap(model, squeezed)
    assert all(before[n][0] == p.data_ptr() for n, p in model.named_parameters())


def test_wrong_batch_shape_is_refused_before_the_step():
    plan = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep")
    engine = wrap(make_model("gpt2-4"), plan, device="cpu")
    x, y = next(_data())
    sd = engine.state_dict()
    with pytest.raises(ConfigError, match=r"shape \(4, 16\).*\(4, 32\)"):
        engine.step((x[:, :16], y[:, :16]))
    with pytest.raises(ConfigError, match="1 micro-batches; the plan accumulates 2"):
        wrap(
            make_model("gpt2-4"),
            make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep", grad_accum=2),
        ).step((x, y))
    assert engine.steps_done == 0
    after = engine.state_dict()
    assert all(torch.equal(sd["model"][n], after["model"][n]) for n in sd["model"])
    engine.step((x, y))  # and the engine is still usable


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_trains_close_to_fp32(dtype):
    # Reference: the fp32 lock-step run. Tolerance: the compute dtype's rounding
    # (bf16 has 8 mantissa bits, fp16 11) over 10 steps of a 4-block model; the
    # losses agree to about 1e-2 relative in practice, we allow 3e-2.
    fp32 = lockstep(
        "gpt2-4", make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="checkpoint"), steps=10
    )
    half = lockstep(
        "gpt2-4",
        make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="checkpoint", compute_dtype=dtype),
        steps=10,
    )
    assert all(math.isfinite(x) for x in half.losses)
    assert not any(r.skipped for r in half.results)
    for a, b in zip(half.losses, fp32.losses):
        assert abs(a - b) <= 3e-2 * abs(b)
    assert sum(half.losses[-3:]) < sum(half.losses[:3])


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    plan = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep", compute_dtype="float16")
    engine = wrap(make_model("gpt2-4"), plan, AdamWConfig(loss_scale=2.0**60), device="cpu")
    before = engine.state_dict()["model"]
    data = _data()
    res = engine.step(next(data))
    assert res.skipped and not math.isfinite(res.grad_norm)
    assert engine.scaler.scale == 2.0**59
    after = engine.state_dict()["model"]
    assert all(torch.equal(before[n], after[n]) for n in before)
    for _ in range(60):  # the scale keeps halving until a step goes through
        if not engine.step(next(data)).skipped:
            break
    else:
        pytest.fail("the loss scale never came down to a usable value")
    assert any(not torch.equal(before[n], engine.state_dict()["model"][n]) for n in before)


def test_state_dict_uses_plain_names_and_resumes_under_another_plan():
    plan_a = make_plan("llama-4", persistent=[0], n_buffer=2, policies="swap checkpoint keep keep")
    plan_b = make_plan(
        "llama-4", persistent="all", n_buffer=0, policies="keep", chunk_numel=200_000
    )
    model = make_model("llama-4")
    ref = copy.deepcopy(model)
    a = wrap(model, plan_a, device="cpu")
    data = _data()
    for _ in range(3):
        a.step(next(data))
    sd = a.state_dict()
    assert set(sd["model"]) == set(dict(ref.named_parameters()))
    assert all(sd["model"][n].shape == p.shape for n, p in ref.named_parameters())
    b = wrap(ref, plan_b, device="cpu")
    b.load_state_dict(sd)
    x = next(data)
    torch.manual_seed(7)
    loss_a = a.step(x).loss
    torch.manual_seed(7)
    loss_b = b.step(x).loss
    assert loss_a == loss_b  # same math, other layout: exact on CPU fp32
    sa, sb = a.state_dict(), b.state_dict()
    for n in sa["model"]:
        torch.testing.assert_close(sa["model"][n], sb["model"][n], rtol=0, atol=0)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(sa["optim"][n][k], sb["optim"][n][k], rtol=0, atol=0)


def test_gpt2_state_dict_has_the_tied_alias():
    engine = wrap(
        make_model("gpt2-4"), make_plan("gpt2-4", persistent=[], n_buffer=2, policies="keep")
    )
    sd = engine.state_dict()["model"]
    assert torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"])


def test_close_removes_hooks_and_wrappers():
    model = make_model("gpt2-4")
    engine = wrap(
        model,
        make_plan("gpt2-4", persistent="all", n_buffer=0, policies="checkpoint swap keep keep"),
    )
    engine.close()
    assert "forward" not in vars(model.transformer.h[0])
    assert (
        not model.transformer.h[0]._forward_pre_hooks and not model.transformer.h[0]._forward_hooks
    )
    x, y = next(_data())
    model(x, y).backward()  # plain PyTorch again


def test_plan_object_must_be_valid():
    plan = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep")
    bad = msgspec.structs.replace(plan, activations=plan.activations[:2])
    with pytest.raises(PlanError, match="activations"):
        wrap(make_model("gpt2-4"), bad)
    assert plans.load(P.dump(plan)) == plan


def test_accumulation_draws_micro_batches_one_at_a_time():
    # An iterator is drawn as the engine needs each micro-batch (issue 31: train built all
    # grad_accum micro-batches of a step at once); the losses are those of a list of them.
    plan = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep", grad_accum=3)
    data = list(itertools.islice(_data(), 6))
    eager = wrap(make_model("gpt2-4"), plan, device="cpu")
    torch.manual_seed(0)  # dropout
    want = [eager.step(data[:3]).loss, eager.step(data[3:]).loss]
    engine = wrap(make_model("gpt2-4"), plan, device="cpu")
    torch.manual_seed(0)
    forwards = []
    engine.model.register_forward_hook(lambda *_: forwards.append(1))
    drawn_after = []

    def stream():
        for pair in data:
            drawn_after.append(len(forwards))  # forwards run when this micro-batch is drawn
            yield pair

    it = stream()
    got = [engine.step(it).loss, engine.step(it).loss]
    assert drawn_after == [0, 1, 2, 3, 4, 5]
    assert got == want  # bit for bit
    with pytest.raises(ConfigError, match="2 micro-batches; the plan accumulates 3"):
        engine.step(iter(data[:2]))


def test_a_chunk_refuses_transitions_from_the_wrong_state():
    # Chunk.to_resident/to_released/grad_opened/grad_closed assert the state they start from:
    # a release of a released chunk, a fetch-state change of a persistent one, a second
    # opening of gradients are internal errors, not silent double frees.
    engine = wrap(
        make_model("gpt2-4"),
        make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep"),
        device="cpu",
    )
    try:
        persistent, offloaded = engine.store.chunks[0], engine.store.chunks[1]
        with pytest.raises(AssertionError, match="expected one of"):
            offloaded.to_released()  # released after wrap
        with pytest.raises(AssertionError, match="never fetched"):
            persistent.to_resident()
        with pytest.raises(AssertionError, match="grad_live"):
            persistent.grad_opened()  # a trainable persistent chunk's gradients are always open
        with pytest.raises(AssertionError, match="grad_live"):
            offloaded.grad_closed()  # closed after wrap
    finally:
        engine.close()


def test_the_shift_idiom_non_contiguous_batches_train_as_contiguous_ones():
    # engine.step((x[:, :-1], x[:, 1:])): strided slices, which a model's .view(-1) refuses
    # ("view size is not compatible"); the engine makes them contiguous on their way in.
    plan = make_plan("gpt2-tiny", persistent=[0], n_buffer=2, policies="keep")
    t = plan.training
    x = torch.randint(
        0, 256, (t.micro_batch, t.seq_len + 1), generator=torch.Generator().manual_seed(3)
    )
    losses = []
    for batch in ((x[:, :-1], x[:, 1:]), (x[:, :-1].contiguous(), x[:, 1:].contiguous())):
        torch.manual_seed(0)
        engine = wrap(make_model("gpt2-tiny"), plan, device="cpu")
        losses.append([engine.step(batch).loss for _ in range(2)] + [engine.evaluate(batch)])
        engine.close()
    assert losses[0] == losses[1]
