"""chunks.py [Note: device homes]: an offloaded chunk whose fp32 master and moments stay on
the device (``placement.device_homed``) keeps nothing on the host and steps on the device
as its gradients complete. It must train as plain PyTorch, bit for bit on CPU fp32, and as
the host layout it replaces, bit for bit in bf16; the ledger must count its 12 B per
element on the device and none on the host."""

from __future__ import annotations

import msgspec
import pytest
import torch
from harness import assert_same_state, lockstep, make_model, make_plan

from protrain.executor import AdamWConfig, accounting, optim, wrap
from protrain.executor import plan as P
from protrain.executor.errors import ConfigError, PlanError
from protrain.planner.data import batches, load_tokens
from protrain.testing.emulation import emulate

CONFIG = AdamWConfig(lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("model,persistent,policies", [
    ("gpt2-4", [0], "keep"),
    ("llama-4", [], "swap checkpoint keep swap"),
    ("gpt2-tiny", [1], "checkpoint keep"),
])
def test_device_homed_chunks_train_exactly_as_plain_pytorch(model, persistent, policies):
    plan = make_plan(model, persistent=persistent, n_buffer=2, policies=policies, device_homed="all")
    assert plan.placement.device_homed == plan.placement.offloaded
    run = lockstep(model, plan, steps=8)
    assert run.losses == run.ref_losses
    assert_same_state(run)
    # nothing on the host; master and moments (12 B per element) and one scratch on the device
    assert run.engine.ledger.host_bytes == 0 == accounting.walk(plan).host_bytes


def test_some_device_homed_beside_host_homes_under_async_copies():
    """Device-homed and host-homed chunks in one plan, with the copy engine emulated
    asynchronous (copies land late, out of step with compute): still exact."""
    plan = make_plan("gpt2-4", persistent=[], n_buffer=2, policies="keep swap checkpoint keep",
                     device_homed=[1, 3])
    with emulate(5):
        run = lockstep("gpt2-4", plan, steps=6)
    assert run.losses == run.ref_losses
    assert_same_state(run)


def _train(model, plan, steps=4, data=None):
    torch.manual_seed(1234)
    engine = wrap(model, plan, CONFIG, device="cpu")
    data = data or batches(load_tokens(), 4, 32, 0)
    losses = [engine.step(next(data)).loss for _ in range(steps)]
    sd, host, dev = engine.state_dict(), engine.ledger.host_bytes, engine.ledger.device_peak_bytes()
    engine.close()
    return losses, sd, host, dev


def test_bf16_device_homes_step_as_host_homes(monkeypatch):
    """16-bit: the device step reads the gradients through the fp32 scratch in pieces, as the
    host step reads a home's; so a device-homed chunk's arithmetic is the host layout's."""
    monkeypatch.setattr(accounting, "STEP_PIECE", 192)
    monkeypatch.setattr(optim, "STEP_PIECE", 192)
    kept = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep", compute_dtype="bfloat16")
    homed = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep", compute_dtype="bfloat16",
                      device_homed=[1, 2, 4])
    a, b = _train(make_model("gpt2-4"), kept), _train(make_model("gpt2-4"), homed)
    assert a[0] == b[0]
    for name, t in a[1]["model"].items():
        assert torch.equal(t, b[1]["model"][name]), name
    for name, st in a[1]["optim"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key], b[1]["optim"][name][key]), (name, key)
    # what moved: 14 host bytes per element of the homed chunks, 12 device bytes, one scratch
    moved = sum(accounting.host_numel(homed, c) for c in homed.placement.device_homed)
    assert a[2] - b[2] == 14 * moved
    assert accounting.walk(homed).states_bytes - accounting.walk(kept).states_bytes == 12 * moved + 4 * 192


def test_in_place_write_in_forward_reaches_the_device_master():
    """fp32: a device-homed chunk's master is not its buffer, so a forward's in-place write
    (nn.Embedding max_norm) must be written back into it before the release."""
    def model():
        m = make_model("gpt2-4")
        m.transformer.wte.max_norm = 0.1  # below the rows' norms at init (~0.16): renormalised
        return m

    ref = make_plan("gpt2-4", persistent=[], n_buffer=2, policies="keep")
    homed = make_plan("gpt2-4", persistent=[], n_buffer=2, policies="keep", device_homed="all")
    a, b = _train(model(), ref), _train(model(), homed)
    plain = _train(make_model("gpt2-4"), ref)
    assert plain[0] != a[0]  # the writes matter
    assert a[0] == b[0]
    for name, t in a[1]["model"].items():
        assert torch.equal(t, b[1]["model"][name]), name


def test_plan_rules_for_device_homed_chunks():
    plan = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep", compute_dtype="bfloat16",
                     homeless=[1, 2])
    doc = msgspec.json.decode(P.dump(plan))

    def bad(**placement):
        d = {**doc, "placement": {**doc["placement"], **placement}}
        with pytest.raises(PlanError) as e:
            P.load(msgspec.json.encode(d))
        return str(e.value)

    assert "$.placement.device_homed" in bad(device_homed=[0])  # persistent, not offloaded
    assert "$.placement.device_homed" in bad(device_homed=[3, 2])
    assert "also homeless" in bad(device_homed=[2, 3])
    clip = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep", cpu_adam="after_backward")
    d = msgspec.json.decode(P.dump(clip))
    d["placement"]["device_homed"] = [1]
    with pytest.raises(PlanError, match="during_backward"):
        P.load(msgspec.json.encode(d))


def test_a_frozen_device_homed_chunk_is_refused():
    plan = make_plan("gpt2-4", persistent=[], n_buffer=2, policies="keep", device_homed=[0])
    model = make_model("gpt2-4")
    for p in model.transformer.wte.parameters():
        p.requires_grad_(False)
    for p in model.transformer.wpe.parameters():
        p.requires_grad_(False)
    with pytest.raises(ConfigError, match="device-homed"):
        wrap(model, plan, CONFIG, device="cpu")


def test_v4_plan_migrates_with_no_device_homes():
    from pathlib import Path

    v4 = Path(__file__).parent / "fixtures" / "plans" / "v4" / "gpt2-tiny-homeless.json"
    plan = P.load(v4)
    assert plan.schema_version == P.SCHEMA_VERSION and plan.placement.device_homed == []
