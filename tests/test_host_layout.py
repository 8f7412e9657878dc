"""optim.py [Note: gradients land in home]: with 16-bit compute and no accumulation an
offloaded chunk keeps 14 host bytes per element (home, master, moments) and its
gradients land in its home. The arithmetic must be the accumulator's: the same steps
as a persistent chunk's, bit for bit."""

from __future__ import annotations

import msgspec
import pytest
import torch
from harness import assert_same_training, make_model, make_plan, train_engine
from torch import nn

from protrain.executor import AdamWConfig, optim
from protrain.planner.models.data import batches, load_tokens
from protrain.planner.search import memory_walk
from protrain.planner.search.emit import emit
from protrain.plans import accounting, homes
from tools.emulation import emulate

CONFIG = AdamWConfig(lr=1e-2, weight_decay=0.1)


STEPS = 3


def _train(model, plan, steps=None, data=None, nvme_dir=None, config=CONFIG):
    return train_engine(model, plan, steps or STEPS, data, nvme_dir, config)


_same = assert_same_training


@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("asynchronous", [False, True])
def test_gradients_in_home_step_like_a_persistent_chunk(clip, asynchronous, monkeypatch):
    # Pieces of 3 vectors: every parameter steps in pieces through the scratch (optim.py
    # _adamw_pieces), unscaled and clipped per piece
    monkeypatch.setattr(homes, "STEP_PIECE", 192)  # the scratch the accounting reads
    monkeypatch.setattr(optim, "STEP_PIECE", 192)
    config = AdamWConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=clip)
    cpu_adam = "after_backward" if clip else None
    offloaded = make_plan(
        "gpt2-4",
        persistent=[],
        n_buffer=2,
        policies="keep",
        compute_dtype="bfloat16",
        cpu_adam=cpu_adam,
    )
    persistent = make_plan(
        "gpt2-4",
        persistent="all",
        n_buffer=0,
        policies="keep",
        compute_dtype="bfloat16",
        cpu_adam=cpu_adam,
    )
    want = _train(make_model("gpt2-4"), persistent, config=config)
    with emulate(7) if asynchronous else _nothing():
        got = _train(make_model("gpt2-4"), offloaded, config=config)
    _same(got, want)
    # 14 host bytes per element of every offloaded chunk and the fp32 scratch of one step
    # piece, as accounting.py says and the ledger counted
    held = sum(
        accounting.host_numel(offloaded, c) for c in offloaded.placement.offloaded
    )  # no padding
    assert held < len(offloaded.placement.offloaded) * offloaded.chunks.chunk_numel
    assert got[2] == memory_walk.walk(offloaded).host_bytes == 14 * held + 4 * 192


class _Gate(nn.Module):
    """A block whose only parameter gets no gradient (used under no_grad): its chunk is
    fetched in backward and its gradient buffer opened, but nothing of it steps."""

    def __init__(self, d: int):
        super().__init__()
        self.gate = nn.Parameter(torch.linspace(-1, 1, d * d).view(d, d))

    def forward(self, x):
        with torch.no_grad():
            g = torch.sigmoid(self.gate)
        return x @ g


class _Tiny(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.h = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.Tanh()), _Gate(d)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for b in self.h:
            x = b(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_a_chunk_with_nothing_to_step_gets_its_home_back():
    # Block h.1's chunk holds only its gate: its (zero) gradient buffer lands in the home
    # and nothing steps; the next forward must still read the weights, as plain PyTorch.
    import copy

    from protrain.plans import plan as P

    torch.manual_seed(0)
    model = _Tiny()
    training = P.Training(
        micro_batch=2,
        seq_len=8,
        compute_dtype="bfloat16",
        master_dtype="float32",
        world_size=1,
        grad_accum=1,
    )

    def plan(persistent):
        return emit(
            model,
            name="tiny",
            blocks=["h.0", "h.1"],
            training=training,
            chunk_numel=2048,
            persistent=persistent,
            n_buffer=2,
            policies=["keep", "keep"],
        )

    off = plan([])
    assert any([p.name for p in c.params] == ["h.1.gate"] for c in off.chunks.items)
    data = [(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))) for _ in range(4)]
    want = _train(copy.deepcopy(model), plan(list(range(len(off.chunks.items)))), data=iter(data))
    got = _train(copy.deepcopy(model), off, data=iter(data))
    _same(got, want)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# -- homeless chunks (placement.homeless; executor/chunks.py [Note: host slots])


def _slots(plan, n):
    return msgspec.structs.replace(
        plan, placement=msgspec.structs.replace(plan.placement, n_host_slots=n)
    )


@pytest.mark.parametrize("policies", ["keep", "checkpoint"])
@pytest.mark.parametrize("asynchronous", [False, True])
def test_homeless_chunks_train_bit_for_bit_as_kept_homes(policies, asynchronous, monkeypatch):
    # The 12 B layout moves bytes, never the math: homeless (every offloaded chunk, then
    # some; one slot, so that every use of it waits for the last) trains bit for bit as the
    # same plan with every home kept (bf16 on CPU), and the host holds what accounting.py
    # says: 12 B per element, the slots and one step piece. Pieces of 3 vectors, so that
    # parameters are stepped in many pieces.
    monkeypatch.setattr(homes, "STEP_PIECE", 192)  # the scratch the accounting reads
    monkeypatch.setattr(optim, "STEP_PIECE", 192)
    kept = make_plan(
        "gpt2-4", persistent=[0], n_buffer=2, policies=policies, compute_dtype="bfloat16"
    )
    want = _train(make_model("gpt2-4"), kept)
    off = kept.placement.offloaded
    for homeless, slots in (("all", 2), ("all", 1), (off[::2], 3)):
        plan = _slots(
            make_plan(
                "gpt2-4",
                persistent=[0],
                n_buffer=2,
                policies=policies,
                compute_dtype="bfloat16",
                homeless=homeless,
            ),
            slots,
        )
        with emulate(11) if asynchronous else _nothing():
            got = _train(make_model("gpt2-4"), plan)
        _same(got, want)
        walk = memory_walk.walk(plan)
        assert got[2] == walk.host_bytes
    shard = kept.chunks.chunk_numel
    plan = make_plan(
        "gpt2-4",
        persistent=[0],
        n_buffer=2,
        policies=policies,
        compute_dtype="bfloat16",
        homeless="all",
    )
    held = sum(accounting.host_numel(kept, c) for c in off)  # up to each chunk's last parameter
    assert (
        memory_walk.walk(plan).host_bytes
        == 12 * held + 2 * shard * plan.placement.n_host_slots + 4 * 192
    )
    assert memory_walk.walk(kept).host_bytes == 14 * held + 4 * 192


def test_homeless_plans_are_refused_where_a_gradient_must_wait():
    from protrain.plans.errors import PlanError

    for kw in (
        dict(compute_dtype="float32"),
        dict(compute_dtype="bfloat16", grad_accum=2),
        dict(compute_dtype="bfloat16", cpu_adam="after_backward"),
        dict(compute_dtype="float16"),
    ):
        with pytest.raises(PlanError, match="homeless"):
            make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep", homeless="all", **kw)


def test_the_v4_fixture_trains_as_with_its_homes_kept():
    from pathlib import Path

    from protrain import plans
    from protrain.planner.models.zoo import build

    plan = plans.load(
        Path(__file__).parent / "fixtures" / "plans" / "v4" / "gpt2-tiny-homeless.json"
    )
    kept = msgspec.structs.replace(
        plan,
        placement=msgspec.structs.replace(
            plan.placement,
            homes=["host" if h == "homeless" else h for h in plan.placement.homes],
            n_host_slots=0,
        ),
    )
    data = [next(batches(load_tokens(), 4, 64, 0)) for _ in range(3)]
    torch.manual_seed(0)
    model = build("gpt2-tiny", device="cpu")
    import copy

    _same(
        _train(copy.deepcopy(model), plan, data=iter(data)),
        _train(copy.deepcopy(model), kept, data=iter(data)),
    )
