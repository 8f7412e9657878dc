"""Models the zoo never shows, trained in lock step with plain ``AdamW(fused=True)``.

Issue #15, executor side. Each model here is within the README's contract (forward
``(idx, targets) -> loss``, blocks in an ``nn.ModuleList``) and has one property the
zoo's models lack:

- odd parameter sizes (36-wide layers, a 37-element vector): the fused CPU kernel
  steps each tensor's last ``numel % vector width`` elements in a scalar loop, so the
  engine must step per parameter (optim.py [Note: optimizer placement]);
- parameters that get no gradient (never used, or a MoE expert routed on some steps
  only): not updated, not decayed, no step count (optim.py [Note: which parameters step]);
- frozen parameters (``requires_grad=False``), including a frozen embedding whose
  output does not require grad at block 0's boundary;
- a parameter written in place in forward (``nn.Embedding(max_norm=...)``,
  chunks.py [Note: in-place writes in forward]).

Every comparison is exact (rtol=0, atol=0, CPU fp32): a plan moves tensors, it must
not change arithmetic. Plans are built with ``emit`` directly, from a copy of the model
(planning a live model runs a forward; the planner side of #15 makes that side-effect
free, and these tests must not depend on it).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from protrain import plans
from protrain.executor import AdamWConfig, wrap
from protrain.planner.search.emit import emit
from protrain.plans import plan as P
from protrain.plans.errors import ConfigError
from tools.emulation import emulate

V, B, T = 40, 2, 8  # vocab, micro-batch, sequence length
CONFIG = AdamWConfig(lr=3e-2, weight_decay=0.1)  # a large lr: drift shows within steps


class Block(nn.Module):
    def __init__(self, w: int, *, frozen: bool = False, spare: bool = False, experts: int = 0):
        super().__init__()
        self.ln = nn.LayerNorm(w)
        self.fc = nn.Linear(w, w)  # (w, w) and a w-wide bias: odd tails for w = 36
        self.fc.weight.requires_grad_(not frozen)
        # A parameter the block holds and never uses (left over from a refactor).
        self.spare = nn.Parameter(torch.randn(w + 1)) if spare else None
        # Data-routed experts: each call uses one, picked by the sign of the input's sum,
        # so an expert gets a gradient on some steps and not on others.
        self.experts = nn.ModuleList(nn.Linear(w, w) for _ in range(experts))

    def forward(self, x):  # (B, T, w) -> (B, T, w)
        h = self.fc(self.ln(x))
        if len(self.experts):
            h = h + self.experts[int(x.detach().sum() > 0) % len(self.experts)](h)
        return x + torch.tanh(h)


class Model(nn.Module):
    def __init__(
        self,
        w: int = 36,
        n_block: int = 3,
        *,
        frozen_emb: bool = False,
        max_norm=None,
        frozen_block: int | None = None,
        spare: bool = False,
        experts: int = 0,
        unused_numel: int = 37,
    ):
        super().__init__()
        self.emb = nn.Embedding(V, w, max_norm=max_norm)
        self.emb.weight.requires_grad_(not frozen_emb)
        self.blocks = nn.ModuleList(
            Block(
                w,
                frozen=i == frozen_block,
                spare=spare and i == 1,
                experts=experts if i == 1 else 0,
            )
            for i in range(n_block)
        )
        self.head = nn.Linear(w, V)
        # Top-level parameter no op uses.
        self.unused = nn.Parameter(torch.randn(unused_numel)) if spare else None

    def forward(self, idx, targets):  # (B, T), (B, T) -> ()
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def build(seed: int = 0, **kw) -> Model:
    """A model; 64 wide unless asked (odd sizes are item 1's; the other items' tests are
    aligned, so each fails before its own fix, not for the odd tails)."""
    torch.manual_seed(seed)
    return Model(**{"w": 64, **kw})


PLANS = {  # name: (persistent: "all" | list of chunk ids, n_buffer, policy per block)
    "persist": ("all", 1, ["keep"] * 3),
    "offload": ([], 2, ["keep"] * 3),
    "mixed": ([0], 2, ["swap", "checkpoint", "keep"]),
    "ckpt": ([], 3, ["checkpoint", "swap", "checkpoint"]),
}


def plan_for(
    model: nn.Module,
    name: str,
    grad_accum: int = 1,
    chunk_numel: int | None = None,
    n_buffer: int | None = None,
) -> P.Plan:
    persistent, nb, policies = PLANS[name]
    n_buffer = n_buffer or nb
    # About one block per chunk (block 1's experts triple it), so n_buffer 2 suffices.
    w = model.head.in_features
    chunk_numel = chunk_numel or (w * w + 8 * w) * (3 if len(model.blocks[1].experts) else 1)
    blocks = [f"blocks.{i}" for i in range(len(model.blocks))]
    training = P.Training(
        micro_batch=B,
        seq_len=T,
        compute_dtype="float32",
        master_dtype="float32",
        world_size=1,
        grad_accum=grad_accum,
    )
    m = copy.deepcopy(model)  # planning must not touch the model we train

    def make(persist, nb):
        return emit(
            m,
            name="custom",
            blocks=blocks,
            training=training,
            chunk_numel=chunk_numel,
            persistent=persist,
            n_buffer=nb,
            policies=policies,
        )

    if persistent == "all":
        persistent = list(range(len(make([], 64).chunks.items)))
    return make(persistent, n_buffer)


def data(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g))
        for _ in range(n)
    ]


def lockstep(
    model: Model,
    plan: P.Plan,
    steps: int = 5,
    seed: int = 0,
    emulated: int | None = None,
    batches=None,
):
    """Train ``model`` under ``plan`` and a deepcopy with plain AdamW(fused=True); compare
    losses every step and the final state. Returns the engine (closed)."""
    k = plan.training.grad_accum
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(
        ref.parameters(),
        lr=CONFIG.lr,
        betas=CONFIG.betas,
        eps=CONFIG.eps,
        weight_decay=CONFIG.weight_decay,
        fused=True,
    )
    batches = batches or data(seed, steps * k)
    ctx = emulate(emulated) if emulated is not None else _null()
    with ctx:
        engine = wrap(model, plan, CONFIG, device="cpu")
        try:
            for s in range(steps):
                micro = batches[s * k : (s + 1) * k]
                res = engine.step(micro)
                opt.zero_grad(set_to_none=True)
                losses = []
                for x, y in micro:
                    loss = ref(x, y)
                    (loss if k == 1 else loss / k).backward()
                    losses.append(loss.detach())
                opt.step()
                want = losses[0].item() if k == 1 else torch.stack(losses).mean().item()
                assert res.loss == want, f"step {s}: loss {res.loss} != {want}"
            assert_same(engine.state_dict(), ref, opt)
        finally:
            engine.close()
    return engine


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def assert_same(sd: dict, ref: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Parameters equal; optimizer state equal, and present exactly where PyTorch has it."""
    for name, p in ref.named_parameters():
        torch.testing.assert_close(sd["model"][name], p.detach(), rtol=0, atol=0, msg=name)
        st = opt.state.get(p)
        if not st:
            assert name not in sd["optim"], f"{name}: state for a parameter that never stepped"
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                sd["optim"][name][key], st[key], rtol=0, atol=0, msg=f"{name} {key}"
            )
        assert float(sd["optim"][name]["step"]) == float(st["step"]), name


# -- 1. odd sizes


@pytest.mark.parametrize("plan", list(PLANS))
def test_odd_sizes_match_per_parameter_adamw(plan):
    model = build(w=36)
    lockstep(model, plan_for(model, plan), steps=6)


def test_odd_sizes_under_emulation():
    model = build(1, w=36)
    lockstep(model, plan_for(model, "mixed"), steps=4, emulated=1)


def test_flat_fast_path_kept_for_aligned_chunks():
    """64-wide layers in 8192-element chunks: each chunk steps as one flat tensor, and that
    still equals the per-parameter reference (the argument in [Note: optimizer placement])."""
    model = build(w=64)
    plan = plan_for(model, "offload", chunk_numel=8192, n_buffer=3)
    engine = lockstep(model, plan, steps=4)
    aligned = [c.id for c in engine.store.chunks if all(n % 64 == 0 for _, _, n in c.params)]
    assert aligned and set(aligned) <= engine.optim.flat_ok


# -- 2. unused parameters


@pytest.mark.parametrize("plan", list(PLANS))
def test_unused_and_routed_parameters(plan):
    model = build(spare=True, experts=2)
    lockstep(model, plan_for(model, plan), steps=6)


@pytest.mark.parametrize("plan", ["offload", "mixed"])
def test_routed_experts_with_grad_accumulation(plan):
    """An expert counts as having a gradient if any micro-batch routed to it."""
    model = build(spare=True, experts=2)
    lockstep(model, plan_for(model, plan, grad_accum=3), steps=4)


def test_unused_parameters_under_emulation():
    model = build(spare=True, experts=2)
    lockstep(model, plan_for(model, "offload", grad_accum=2), steps=4, emulated=2)


def test_offload_of_a_chunk_never_fetched_in_backward_copies_nothing():
    """A chunk whose parameters all got no gradient may be offloaded with no gradient
    buffer (emit.py once wrote such plans: an offload and no backward fetch for a chunk
    of unused parameters). Its device gradient has zero bytes; the offload must not copy
    from it (it was a SIGSEGV) and the accumulator must read zero, not stale values."""
    model = build(spare=True, unused_numel=4500)  # too big to share the head's chunk
    plan = plan_for(model, "offload")
    lonely = [c.id for c in plan.chunks.items if [p.name for p in c.params] == ["unused"]]
    assert lonely, [[p.name for p in c.params] for c in plan.chunks.items]
    engine = wrap(model, plan, CONFIG, device="cpu")
    try:
        cid = lonely[0]
        assert not engine.store.chunks[cid].grad_live
        engine.optim.cpu_grad[cid].fill_(7.0)  # stale values from an earlier step
        engine.optim.offload_grad(cid, first_micro_batch=True)
        engine.optim.submit_cpu_step(cid)
        engine.optim.wait_all()
        assert engine.optim.cpu_grad[cid].abs().sum() == 0
        assert engine.optim.counts[cid] == [0]  # no gradient: no step
    finally:
        engine.close()
    # And through training: the lonely chunk never steps, as `unused` in plain PyTorch.
    lockstep(build(spare=True, unused_numel=4500), plan, steps=3)


def test_state_dict_round_trip_with_partial_state(tmp_path):
    """Parameters without state stay without state through save/load, under another plan;
    training on matches the uninterrupted reference."""
    model = build(spare=True, experts=2, frozen_block=0)
    batches = data(5, 6)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(
        ref.parameters(),
        lr=CONFIG.lr,
        betas=CONFIG.betas,
        eps=CONFIG.eps,
        weight_decay=CONFIG.weight_decay,
        fused=True,
    )
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        ref(x, y).backward()
        opt.step()
    first = copy.deepcopy(model)
    a = wrap(first, plan_for(model, "offload"), CONFIG, device="cpu")
    for xy in batches[:3]:
        a.step(xy)
    a.save(tmp_path)
    a.close()
    second = build(7, spare=True, experts=2, frozen_block=0)  # other values: load must set them all
    b = wrap(second, plan_for(model, "mixed"), CONFIG, device="cpu")
    b.load(tmp_path)
    for xy in batches[3:]:
        b.step(xy)
    assert_same(b.state_dict(), ref, opt)
    b.close()


# -- 3. frozen parameters


@pytest.mark.parametrize("plan", list(PLANS))
def test_frozen_embedding_and_weight(plan):
    model = build(frozen_emb=True, frozen_block=1)
    lockstep(model, plan_for(model, plan), steps=5)


def test_frozen_under_emulation():
    model = build(frozen_emb=True, frozen_block=2, spare=True)
    lockstep(model, plan_for(model, "ckpt"), steps=4, emulated=3)


# -- 4. parameters written in place in forward


@pytest.mark.parametrize("plan", list(PLANS))
def test_embedding_max_norm_renormalisation_is_kept(plan):
    model = build(max_norm=1.0)
    lockstep(model, plan_for(model, plan), steps=5)


def test_max_norm_under_emulation():
    model = build(max_norm=1.0, experts=2)
    lockstep(model, plan_for(model, "offload"), steps=4, emulated=4)


@pytest.mark.parametrize("plan", ["persist", "offload"])
def test_max_norm_write_reaches_the_bf16_master(plan):
    """Under 16-bit compute the renormalisation is done on the bf16 copy; it must reach the
    fp32 master (else the next step overwrites it). lr=0 and no decay: the master then holds
    exactly the written-back rows, which equal the bf16 rounding of a plain renorm up to
    bf16 arithmetic (embedding_renorm_ computes the norm in bf16: atol 1 bf16 ulp near 1)."""
    model = build(max_norm=0.5)
    ref = copy.deepcopy(model)
    persistent, n_buffer, policies = PLANS[plan]
    blocks = [f"blocks.{i}" for i in range(3)]
    training = P.Training(
        micro_batch=B,
        seq_len=T,
        compute_dtype="bfloat16",
        master_dtype="float32",
        world_size=1,
        grad_accum=1,
    )
    n = len(
        emit(
            copy.deepcopy(model),
            name="c",
            blocks=blocks,
            training=training,
            chunk_numel=4608,
            persistent=[],
            n_buffer=64,
            policies=policies,
        ).chunks.items
    )
    p = emit(
        copy.deepcopy(model),
        name="c",
        blocks=blocks,
        training=training,
        chunk_numel=4608,
        persistent=list(range(n)) if persistent == "all" else persistent,
        n_buffer=n_buffer,
        policies=policies,
    )
    engine = wrap(model, p, AdamWConfig(lr=0.0, weight_decay=0.0), device="cpu")
    ((x, y),) = data(3, 1)
    engine.step((x, y))
    got = engine.state_dict()["model"]["emb.weight"]
    engine.close()
    with torch.no_grad():
        ref.emb(x)  # the renormalisation plain PyTorch applies
    rows = x.unique()
    assert not torch.equal(
        ref.emb.weight[rows], build(max_norm=0.5).emb.weight[rows]
    )  # it did renorm
    torch.testing.assert_close(got[rows], ref.emb.weight[rows].detach(), rtol=0, atol=8e-3)
    assert got[rows].norm(dim=1).max() <= 0.5 + 8e-3


def test_requires_grad_changed_after_wrap_is_refused():
    """Unfreezing after wrap would train a parameter with no hook, silently never stepped."""
    model = build(frozen_emb=True)
    engine = wrap(model, plan_for(model, "offload"), CONFIG, device="cpu")
    try:
        (xy,) = data(0, 1)
        engine.step(xy)
        model.emb.weight.requires_grad_(True)
        with pytest.raises(
            ConfigError, match="'emb.weight' was frozen at wrap and is trainable now"
        ):
            engine.step(xy)
    finally:
        engine.close()


@pytest.mark.parametrize("plan", ["persist", "offload"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_frozen_chunk_holds_no_optimizer_or_gradient_memory(plan, dtype):
    """A chunk of frozen parameters only (the embedding here) gets no gradient buffer, no
    moments, no fp32 master and no host gradient accumulator (chunks.py [Note: frozen chunks])."""
    model = build(frozen_emb=True)
    p = plan_for(model, plan)
    if dtype != "float32":
        p = plans.load(
            P.dump(p).replace(b'"compute_dtype": "float32"', b'"compute_dtype": "bfloat16"')
        )
    frozen = [c.id for c in p.chunks.items if [x.name for x in c.params] == ["emb.weight"]]
    assert frozen, [[x.name for x in c.params] for c in p.chunks.items]
    engine = wrap(model, p, CONFIG, device="cpu")
    try:
        (xy,) = data(0, 1)
        engine.step(xy)
        c, o = engine.store.chunks[frozen[0]], engine.optim
        assert not c.trainable and not c.grad_live and c.dev_grad.untyped_storage().nbytes() == 0
        assert o.exp_avg[c.id].numel() == 0 and frozen[0] not in o.cpu_grad
        assert o.master[c.id] is (c.dev if c.persistent else c.home)
        assert model.emb.weight.grad is None
        sd = engine.state_dict()
        assert "emb.weight" not in sd["optim"] and sd["model"]["emb.weight"].dtype == torch.float32
    finally:
        engine.close()
