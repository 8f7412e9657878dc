"""chunks.py [Note: device homes]: an offloaded chunk whose fp32 master and moments stay on
the device (``placement.device_homed``) keeps nothing on the host and steps on the device
as its gradients complete. It must train as plain PyTorch, bit for bit on CPU fp32, and as
the host layout it replaces, bit for bit in bf16; the ledger must count its 12 B per
element on the device and none on the host."""

from __future__ import annotations

import msgspec
import pytest
import torch
from harness import (
    assert_same_state,
    assert_same_training,
    lockstep,
    make_model,
    make_plan,
    stop_and_resume,
    train_engine,
)

from protrain import plans
from protrain.executor import AdamWConfig, optim, wrap
from protrain.planner.models.data import batches, load_tokens
from protrain.planner.search import memory_walk
from protrain.plans import accounting, homes
from protrain.plans import plan as P
from protrain.plans.errors import PlanError
from tools.emulation import emulate

CONFIG = AdamWConfig(lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize(
    "model,persistent,policies",
    [
        ("gpt2-4", [0], "keep"),
        ("llama-4", [], "swap checkpoint keep swap"),
        ("gpt2-tiny", [1], "checkpoint keep"),
    ],
)
def test_device_homed_chunks_train_exactly_as_plain_pytorch(model, persistent, policies):
    plan = make_plan(
        model, persistent=persistent, n_buffer=2, policies=policies, device_homed="all"
    )
    assert plan.placement.device_homed == plan.placement.offloaded
    run = lockstep(model, plan, steps=8)
    assert run.losses == run.ref_losses
    assert_same_state(run)
    # nothing on the host; master and moments (12 B per element) and one scratch on the device
    assert run.engine.ledger.host_bytes == 0 == memory_walk.walk(plan).host_bytes


def test_some_device_homed_beside_host_homes_under_async_copies():
    """Device-homed and host-homed chunks in one plan, with the copy engine emulated
    asynchronous (copies land late, out of step with compute): still exact."""
    plan = make_plan(
        "gpt2-4",
        persistent=[],
        n_buffer=2,
        policies="keep swap checkpoint keep",
        device_homed=[1, 3],
    )
    with emulate(5):
        run = lockstep("gpt2-4", plan, steps=6)
    assert run.losses == run.ref_losses
    assert_same_state(run)


STEPS = 4


def _train(model, plan, steps=None, data=None, nvme_dir=None, config=CONFIG):
    return train_engine(model, plan, steps or STEPS, data, nvme_dir, config)


def test_bf16_device_homes_step_as_host_homes(monkeypatch):
    """16-bit: the device step reads the gradients through the fp32 scratch in pieces, as the
    host step reads a home's; so a device-homed chunk's arithmetic is the host layout's."""
    monkeypatch.setattr(homes, "STEP_PIECE", 192)  # the scratch the accounting reads
    monkeypatch.setattr(optim, "STEP_PIECE", 192)
    kept = make_plan(
        "gpt2-4", persistent=[0], n_buffer=2, policies="keep", compute_dtype="bfloat16"
    )
    homed = make_plan(
        "gpt2-4",
        persistent=[0],
        n_buffer=2,
        policies="keep",
        compute_dtype="bfloat16",
        device_homed=[1, 2, 4],
    )
    a, b = _train(make_model("gpt2-4"), kept), _train(make_model("gpt2-4"), homed)
    assert_same_training(a, b)
    # what moved: 14 host bytes per element of the homed chunks, 12 device bytes, one scratch
    moved = sum(accounting.host_numel(homed, c) for c in homed.placement.device_homed)
    assert a[2] - b[2] == 14 * moved
    assert (
        memory_walk.walk(homed).states_bytes - memory_walk.walk(kept).states_bytes
        == 12 * moved + 4 * 192
    )


@pytest.mark.parametrize("n_buffer", [2, 6])
def test_in_place_write_in_forward_reaches_the_device_master(n_buffer):
    """fp32: a device-homed chunk's master is not its buffer, so a forward's in-place write
    (nn.Embedding max_norm) must reach it before the release, and before the step: with
    every chunk buffered, the embedding's chunk stays resident from forward to its last
    backward segment, where it is offloaded (stepped) and then released. Against plain
    PyTorch, and the host layout alike."""

    def model():
        m = make_model("gpt2-4")
        m.transformer.wte.max_norm = 0.1  # below the rows' norms at init (~0.16): renormalised
        return m

    host = make_plan("gpt2-4", persistent=[], n_buffer=n_buffer, policies="keep")
    homed = make_plan(
        "gpt2-4", persistent=[], n_buffer=n_buffer, policies="keep", device_homed="all"
    )
    torch.manual_seed(1234)
    ref = model()
    opt = torch.optim.AdamW(
        ref.parameters(), lr=CONFIG.lr, weight_decay=CONFIG.weight_decay, fused=True
    )
    data = batches(load_tokens(), 4, 32, 0)
    want = []
    for _ in range(4):
        loss = ref(*next(data))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(loss.item())
    plain = _train(make_model("gpt2-4"), host)
    assert plain[0] != want  # the writes matter
    for plan in (host, homed):
        got = _train(model(), plan)
        assert got[0] == want
        for name, p in ref.named_parameters():
            assert torch.equal(got[1]["model"][name], p.detach()), name


def test_plan_rules_for_device_homed_chunks():
    # One home per chunk makes "device-homed and homeless" or "device-homed and persistent"
    # unwritable; what is left are the home's preconditions (plans/homes.py), checked per chunk.
    clip = make_plan(
        "gpt2-4", persistent=[0], n_buffer=2, policies="keep", cpu_adam="after_backward"
    )
    d = msgspec.json.decode(P.dump(clip))
    d["placement"]["homes"][1] = "device_homed"
    with pytest.raises(PlanError, match="during_backward") as e:
        plans.load(msgspec.json.encode(d))
    assert "$.placement.homes[1]" in str(e.value)


def test_a_frozen_device_homed_chunk_keeps_its_values_on_the_device():
    """Fine-tuning freezes the embeddings, which the planner may have homed on the device
    (it plans every parameter trainable): the chunk then has no master, so its values'
    shard stays on the device in the compute dtype, and training is plain PyTorch's."""
    plan = make_plan("gpt2-4", persistent=[], n_buffer=2, policies="keep", device_homed=[0, 1])

    def frozen():
        m = make_model("gpt2-4")
        for p in (*m.transformer.wte.parameters(), *m.transformer.wpe.parameters()):
            p.requires_grad_(False)
        return m

    host = make_plan("gpt2-4", persistent=[], n_buffer=2, policies="keep")
    a, b = _train(frozen(), host), _train(frozen(), plan)
    assert a[0] == b[0]
    for name, t in a[1]["model"].items():
        assert torch.equal(t, b[1]["model"][name]), name
    assert "transformer.wte.weight" not in b[1]["optim"]
    engine = wrap(
        frozen(), plan, CONFIG, device="cpu"
    )  # the ledger checked wrap against accounting.py
    home = engine.store.chunks[0].home
    assert home is not None and home.device.type == "cpu" and engine.store.chunks[0].homed
    engine.close()


def test_v4_plan_migrates_with_no_device_homes():
    from pathlib import Path

    v4 = Path(__file__).parent / "fixtures" / "plans" / "v4" / "gpt2-tiny-homeless.json"
    plan = plans.load(v4)
    assert plan.schema_version == P.SCHEMA_VERSION and plan.placement.device_homed == []


def test_a_checkpoint_moves_between_device_homes_and_host_homes(tmp_path):
    """Save under a device-homed plan, resume under the host layout (and back): the same
    training as never stopping (state is saved in the model's names, from the masters)."""
    homed = make_plan(
        "gpt2-4",
        persistent=[0],
        n_buffer=2,
        policies="keep checkpoint keep swap",
        device_homed="all",
    )
    host = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep checkpoint keep swap")
    straight = _train(make_model("gpt2-4"), host)
    for first, second in ((homed, host), (host, homed)):
        losses, sd = stop_and_resume(first, second, tmp_path / "ck", CONFIG)
        assert losses == straight[0]
        for name, t in straight[1]["model"].items():
            assert torch.equal(sd["model"][name], t), name


def test_show_says_which_chunks_are_device_homed():
    from protrain.planner.views.show import render_show

    plan = make_plan(
        "gpt2-4",
        persistent=[0],
        n_buffer=2,
        policies="keep",
        compute_dtype="bfloat16",
        homeless=[4],
        device_homed=[1, 2],
    )
    text = render_show(plan)
    assert (
        "; 1 homeless (no home on the host); 2 device-homed (master and moments on the device)"
        in text
    )
