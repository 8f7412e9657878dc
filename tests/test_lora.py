"""LoRA through peft, planned (issue 30): trainability in the plan, exact training.

A peft-injected model (``planner.lora.inject``: peft's LoRA layers, every other parameter
frozen) is planned with its frozen parameters marked (``Param.frozen``, schema 8): the
adapters are laid out in chunks of their own, and a chunk of frozen parameters is charged
its values only by the cost model and the accounting (plans/homes.py). Under every plan
kind it trains exactly as plain PyTorch + peft + ``AdamW(fused=True)`` does (CPU fp32, zero
tolerance): zoo llama, the Hugging Face families llama, qwen3, gemma2, phi3 and mixtral, and
the planner's own plans.
"""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

import torch  # noqa: E402
from harness import PARITY_MATRIX, assert_same_state, lockstep, make_model, make_plan  # noqa: E402

from protrain import plans
from protrain.planner.models.lora import LoraSpec, attention_projections  # noqa: E402
from protrain.planner.search import memory_walk  # noqa: E402
from protrain.plans import accounting as A  # noqa: E402
from protrain.plans import plan as P  # noqa: E402
from protrain.plans.errors import ConfigError, PlanError  # noqa: E402

SPEC = LoraSpec(r=4, alpha=8)
CASES = {
    **{
        k: PARITY_MATRIX[k]
        for k in ("all-persistent", "offloaded-buf2", "all-swap", "all-checkpoint", "interleaved")
    }
}


def _frozen_chunks(plan: P.Plan) -> list[int]:
    return [i for i, t in enumerate(A.plan_trainable(plan)) if not t]


@pytest.mark.parametrize("case", list(CASES))
def test_zoo_lora_trains_exactly_under_every_plan(case):
    persistent, n_buffer, policies = CASES[case]
    plan = make_plan(
        "llama-4", persistent=persistent, n_buffer=n_buffer, policies=policies, lora=SPEC
    )
    run = lockstep("llama-4", plan, steps=3, lora=SPEC)
    assert run.losses == run.ref_losses
    assert_same_state(run)


def test_lora_grad_accum_2_is_exact():
    plan = make_plan(
        "llama-4",
        persistent=[],
        n_buffer=2,
        policies="swap checkpoint keep swap",
        grad_accum=2,
        lora=SPEC,
    )
    run = lockstep("llama-4", plan, steps=3, lora=SPEC)
    assert run.losses == run.ref_losses
    assert_same_state(run)


def test_adapters_share_their_own_chunks_and_frozen_chunks_keep_values_only():
    plan = make_plan("llama-4", persistent=[0], n_buffer=2, policies="keep", lora=SPEC)
    model = make_model("llama-4", device="meta", lora=SPEC)
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trains and all("lora_" in n for n in trains)
    marked = {p.name for c in plan.chunks.items for p in c.params if not p.frozen}
    assert marked == trains
    # every chunk is all adapters or all frozen; the adapters come first, in one chunk here
    for c in plan.chunks.items:
        assert len({p.frozen for p in c.params}) == 1, c.id
    assert A.plan_trainable(plan) == [True] + [False] * (len(plan.chunks.items) - 1)
    # frozen chunks: values only (homes table); the walk charges them so
    walk = memory_walk.walk(plan)
    numel = plan.chunks.chunk_numel
    assert walk.host_bytes == sum(4 * A.host_numel(plan, c) for c in plan.placement.offloaded)
    full = memory_walk.walk(plan, trainable=[True] * len(plan.chunks.items))
    assert full.host_bytes > 3 * walk.host_bytes and full.states_bytes == walk.states_bytes
    assert (
        walk.states_bytes == 16 * numel
    )  # the persistent adapter chunk: values, grads, moments (fp32)


def test_the_plan_records_frozen_parameters_and_reads_as_schema_7_without_them():
    lora = make_plan("llama-4", persistent=[0], n_buffer=2, policies="keep", lora=SPEC)
    text = P.dump(lora).decode()
    assert (
        text.count('"frozen": true')
        == sum(p.frozen for c in lora.chunks.items for p in c.params)
        > 0
    )
    assert '"frozen": false' not in text
    full = make_plan("llama-4", persistent=[0], n_buffer=2, policies="keep")
    assert '"frozen"' not in P.dump(full).decode()
    assert P.SCHEMA_VERSION == 8


def test_a_plan_refuses_a_model_training_what_it_froze():
    plan = make_plan("llama-4", persistent=[0], n_buffer=2, policies="keep", lora=SPEC)
    model = make_model("llama-4", lora=SPEC)
    next(p for n, p in model.named_parameters() if "embed" in n).requires_grad_(True)
    from protrain.executor import AdamWConfig, wrap

    with pytest.raises(ConfigError, match="frozen that this model trains"):
        wrap(model, plan, AdamWConfig(), device="cpu")


def test_a_frozen_chunk_cannot_be_homeless():
    plan = make_plan(
        "llama-4",
        persistent=[0],
        n_buffer=2,
        policies="keep",
        lora=SPEC,
        compute_dtype="bfloat16",
        cpu_adam="during_backward",
    )
    frozen = _frozen_chunks(plan)
    doc = (
        P.dump(plan)
        .decode()
        .replace('"homes": ["persistent", "host"', '"homes": ["persistent", "homeless"', 1)
    )
    doc = doc.replace('"n_host_slots": 0', '"n_host_slots": 1')
    assert frozen[0] == 1
    with pytest.raises(PlanError, match="frozen"):
        plans.load(doc.encode())


def test_the_v8_fixture_trains_exactly():
    """tests/fixtures/plans/v8/llama-4-lora-r4.json: ``SPEC`` on the harness's llama-4."""
    from pathlib import Path

    plan = plans.load(Path(__file__).parent / "fixtures" / "plans" / "v8" / "llama-4-lora-r4.json")
    assert _frozen_chunks(plan)
    run = lockstep(plan.model.name, plan, steps=3, lora=SPEC)
    assert run.losses == run.ref_losses
    assert_same_state(run)


def test_attention_projections_are_the_familys():
    assert attention_projections(make_model("llama-4", device="meta")) == (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    )
    # GPT-2's MLP has a c_proj too: the attention's is named by its parent, as peft matches paths'
    # ends
    from protrain.planner.models.lora import inject, injected

    gpt2 = make_model("gpt2-4", device="meta")
    assert attention_projections(gpt2) == ("c_attn", "attn.c_proj")
    adapted = {
        n.rsplit(".lora_", 1)[0]
        for n, p in inject(gpt2, SPEC).named_parameters()
        if p.requires_grad
    }
    assert adapted and all(".attn." in n for n in adapted)
    assert injected(gpt2) == ("c_attn", "attn.c_proj")


# ------------------------------------------------------------------ the planner's own plans


def _planned(name: str, budget_frac: float, grad_accum: int = 1, model=None):
    """The planner's plan (analytic profile of the LoRA model on meta, a GPU spec, a budget of
    ``budget_frac`` of what keeping everything needs): chunks offloaded where it binds."""
    from planfactory import gpu_spec

    from protrain.planner.models.zoo import block_paths
    from protrain.planner.profiling.analytic import analytic_profile
    from protrain.planner.search.planning import make_plan as plan_from_profile

    meta = model if model is not None else make_model(name, device="meta", lora=SPEC)
    prof = analytic_profile(
        meta,
        name=name,
        blocks=block_paths(meta),
        micro_batch=4,
        seq_len=32,
        compute_dtype="float32",
        spec=gpu_spec(),
    )
    roomy, _ = plan_from_profile(prof, 2**40, grad_accum=grad_accum, host_budget_bytes=2**40)
    budget = int(roomy.prediction.peak_memory_bytes * budget_frac)
    plan, _ = plan_from_profile(prof, budget, grad_accum=grad_accum, host_budget_bytes=2**40)
    return prof, plan


@pytest.mark.parametrize("frac", [1.0, 0.5])
def test_the_planners_lora_plans_train_exactly_and_predict_the_accounting(frac):
    from protrain.planner.search.cost import segment_bytes

    prof, plan = _planned("llama-4", frac)
    assert any(p.frozen for c in plan.chunks.items for p in c.params)
    walk = memory_walk.walk(plan, segment_bytes(prof))
    assert (
        abs(walk.peak_bytes - plan.prediction.peak_memory_bytes) < 1
    )  # (the file holds an integer)
    assert walk.host_bytes == plan.prediction.breakdown["host_bytes"]
    run = lockstep("llama-4", plan, steps=3, lora=SPEC)
    assert run.losses == run.ref_losses
    assert_same_state(run)


def test_lora_plans_charge_frozen_parameters_their_values_only():
    """The issue's case: LoRA r=4 on q/v was planned at the host cost of full training before
    the planner knew trainability; now a frozen offloaded chunk costs its values (4 B per
    element in fp32) and nothing else, and the plan's host figure is the accounting's."""
    spec = LoraSpec(r=4, alpha=8, targets=("q_proj", "v_proj"))
    meta = make_model("llama-4", device="meta", lora=spec)
    _, plan = _planned("llama-4", 0.5, model=meta)
    train = A.plan_trainable(plan)
    off = plan.placement.offloaded
    assert any(not train[c] for c in off)
    walk = memory_walk.walk(plan)
    assert walk.host_bytes == plan.prediction.breakdown["host_bytes"]
    frozen_host = sum(4 * A.host_numel(plan, c) for c in off if not train[c])
    full = memory_walk.walk(plan, trainable=[True] * len(train))
    assert walk.host_bytes - frozen_host == sum(
        16 * A.host_numel(plan, c) for c in off if train[c]
    ) + (full.host_bytes - sum(16 * A.host_numel(plan, c) for c in off)) * any(
        train[c] for c in off
    )
    assert full.host_bytes >= 4 * frozen_host


# ------------------------------------------------------------------ Hugging Face families


FAMILIES = ["llama", "qwen3", "gemma2", "phi3", "mixtral"]


@pytest.fixture(scope="module")
def hf_names(tmp_path_factory):
    pytest.importorskip("transformers")
    from test_hf_families import write_family

    from protrain.planner.models import hf

    root = tmp_path_factory.mktemp("lora-families")
    return {f: write_family(root / f, f, hf) for f in FAMILIES}


@pytest.mark.parametrize(
    "family",
    [f if f in ("llama", "mixtral") else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES],
)
@pytest.mark.parametrize("kind", ["persistent", "offloaded-swap-accum2"])
def test_hf_family_lora_trains_exactly(hf_names, family, kind):
    name = hf_names[family]
    if kind == "persistent":
        plan = make_plan(name, persistent="all", n_buffer=0, policies="keep", lora=SPEC)
    else:
        plan = make_plan(
            name, persistent=[], n_buffer=8, policies="swap checkpoint", grad_accum=2, lora=SPEC
        )
    assert _frozen_chunks(plan)
    run = lockstep(name, plan, steps=3, lora=SPEC)
    assert run.losses == run.ref_losses, family
    assert_same_state(run)


def test_from_model_accepts_a_peft_model(hf_names):
    import peft

    from protrain.planner.models import hf
    from protrain.planner.models.zoo import build

    inner = build(hf_names["llama"], seed=1).hf
    pm = peft.get_peft_model(
        inner, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    wrapped = hf.from_model(pm)
    names = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    x = torch.randint(0, 256, (2, 8))
    assert torch.isfinite(wrapped(x, x))


# ------------------------------------------------------------------ world size 2 (gloo)


@pytest.mark.dist
@pytest.mark.slow
def test_lora_zero3_on_two_ranks_matches_single_process(tmp_path):
    """ZeRO-3 at world size 2 (the adapters' chunk persistent with sharded states, the frozen
    base offloaded and sharded) against plain PyTorch + peft on the global batch, to the
    reduce-scatter's rounding as tests/test_dist.py allows."""
    from distworker import LR, MICRO, SEQ, train
    from test_dist import _read, spawn

    from protrain.planner.models.data import batches, load_tokens
    from protrain.planner.models.lora import build_model

    spec, world, steps = LoraSpec(r=4, alpha=8), 2, 10
    spawn(
        train,
        world,
        str(tmp_path),
        "llama-tiny",
        [0],
        2,
        ["checkpoint", "swap"],
        steps,
        None,
        None,
        0,
        MICRO,
        65536,
        spec,
    )
    ranks = _read(tmp_path, world)
    ref = build_model("llama-tiny", spec, seed=1)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1, fused=True)
    data = batches(load_tokens(), MICRO * world, SEQ, 0)
    ref_losses = []
    for _ in range(steps):
        x, y = next(data)
        loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_losses.append(loss.item())
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)
    for a, b in zip(ranks[0]["losses"], ref_losses):
        assert abs(a - b) <= 1e-5 * abs(b)
    sd = torch.load(tmp_path / "state.pt", weights_only=True)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(sd["model"][n], p.detach(), rtol=0, atol=1e-4, msg=n)
        assert (n in sd["optim"]) == p.requires_grad, n


# ------------------------------------------------------------------ adapter checkpoints


def test_checkpoints_hold_the_adapters_only_and_resume_exactly(tmp_path):
    """[Note: adapter checkpoints]: trainable masters and moments and the base's fingerprint;
    resuming equals the uninterrupted run bit for bit; another base is refused."""
    import json

    from safetensors.torch import load_file

    from protrain.executor import AdamWConfig, wrap
    from protrain.planner.models.data import batches, load_tokens
    from protrain.plans.errors import CheckpointError

    plan = make_plan(
        "llama-4", persistent=[0], n_buffer=2, policies="swap checkpoint keep swap", lora=SPEC
    )
    config = AdamWConfig(lr=1e-2, weight_decay=0.1)

    def run(model, steps, save=None, load=None, skip=0):
        torch.manual_seed(7)
        engine = wrap(model, plan, config, device="cpu")
        try:
            if load:
                engine.load(load)
            data = batches(load_tokens(), 4, 32, 0)
            for _ in range(skip):
                next(data)
            losses = [engine.step(next(data)).loss for _ in range(steps)]
            if save:
                engine.save(save)
            return losses, engine.state_dict()
        finally:
            engine.close()

    whole, sd = run(make_model("llama-4", lora=SPEC), 4)
    first, _ = run(make_model("llama-4", lora=SPEC), 2, save=tmp_path / "ck")
    step = tmp_path / "ck" / (tmp_path / "ck" / "latest").read_text().strip()
    saved = load_file(step / "model.safetensors")
    manifest = json.loads((step / "manifest.json").read_text())
    assert saved and all("lora_" in k for k in saved)
    assert manifest["base_fingerprint"].startswith("sha256:")
    trainable = sum(p.numel for c in plan.chunks.items for p in c.params if not p.frozen)
    assert sum(t.numel() for t in saved.values()) == trainable
    rest, sd2 = run(make_model("llama-4", lora=SPEC), 2, load=tmp_path / "ck", skip=2)
    assert first + rest == whole
    for name, t in sd["model"].items():
        assert torch.equal(t, sd2["model"][name]), name
    other = make_model("llama-4", seed=2, lora=SPEC)  # another base, the same shapes
    with pytest.raises(CheckpointError, match="another base"):
        run(other, 1, load=tmp_path / "ck")


# ------------------------------------------------------------------ fit --lora


@pytest.mark.slow
def test_fit_lora_climbs_past_full_training_where_the_host_binds():
    """`fit --lora`: the base keeps its values only, so where the host binds full training
    a larger model LoRA-trains; the winner's plan marks its base frozen."""
    from test_fit import SEQ, SMALL

    from protrain.planner.commands.fit import largest_fitting

    kw = dict(budget_bytes=2**29, seq_len=SEQ, micro_batches=(1,), host_memory_bytes=4 * 2**30)
    full = largest_fitting("gpt2", SMALL, **kw)
    lora = largest_fitting("gpt2", SMALL, **kw, lora=LoraSpec(r=8, alpha=16))
    assert full.next_binds == "host memory"
    assert lora.n_params > 1.5 * full.n_params
    assert any(p.frozen for c in lora.plan.chunks.items for p in c.params)
    assert lora.host_bytes <= lora.host_budget_bytes


def test_fit_a_model_with_lora():
    from planfactory import gpu_spec

    from protrain.planner.commands.fit_config import fit_model

    model = make_model("llama-4", device="meta", lora=LoraSpec(r=4, alpha=8))
    r = fit_model(model, name="llama-4", spec=gpu_spec(), seq_len=32, micro_batches=(1, 2))
    assert r.fits and any(p.frozen for c in r.best.plan.chunks.items for p in c.params)


def test_bench_host_lora_section_reads_its_rows():
    from tools.bench import host as bh

    row = {
        "model": "gpt2-large",
        "params": 778e6,
        "frozen": 774e6,
        "dtype": "bfloat16",
        "predicted_per_param": 2.085,
        "wrapped_per_param": 2.1,
        "measured_per_param": 4.05,
        "train_peak_per_param": 1.98,
        "train_peak_mmap_per_param": 1.9,
        "full_predicted_per_param": 14.01,
    }
    text = bh.render_lora([row], "python -m tools.bench host-lora --write")
    assert text.startswith("## host-lora: Host bytes per frozen parameter, LoRA")
    assert "| gpt2-large | 778M | 4.00M | bfloat16 | 2.085 |" in text and "14.01" in text
