"""Planning models the zoo never shows: unused parameters, a block called twice, and
planning without side effects on the live model (issue 15 items 2, 5, 6).

The training side of these models (and many more) is in ``tests/test_any_model.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from protrain.planner.profiling.graph import trace
from protrain.planner.search.emit import emit
from protrain.plans import plan as P
from protrain.plans.errors import ConfigError

V, D = 19, 6


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D)
        self.drop = nn.Dropout(0.5)
        self.spare = nn.Linear(D, D)  # an expert no token is routed to in the trace

    def forward(self, x):  # (B, T, D)
        y = self.drop(self.fc(x))
        return x + self.bn(y.reshape(-1, D)).reshape(x.shape)


class Net(nn.Module):
    def __init__(self, repeat: int = 1, max_norm: float | None = None):
        super().__init__()
        self.wte = nn.Embedding(V, D, max_norm=max_norm)
        self.blocks = nn.ModuleList([Expert(), Expert()])
        self.head = nn.Linear(D, V, bias=False)
        self.lonely = nn.Parameter(torch.randn(5))  # nothing uses it
        self.repeat = repeat

    def forward(self, idx, targets):
        x = self.wte(idx)
        for _ in range(self.repeat):
            x = self.blocks[0](x)
        x = self.blocks[1](x)
        return F.cross_entropy(self.head(x).view(-1, V), targets.view(-1))


def _training() -> P.Training:
    return P.Training(
        micro_batch=2,
        seq_len=4,
        compute_dtype="float32",
        master_dtype="float32",
        world_size=1,
        grad_accum=1,
    )


def _offloaded(model: nn.Module) -> P.Plan:
    return emit(
        model,
        name="net",
        blocks=["blocks.0", "blocks.1"],
        training=_training(),
        chunk_numel=128,
        persistent=[],
        n_buffer=8,
        policies=["keep", "checkpoint"],
    )


def test_unused_parameters_are_planned_with_their_block_or_post():
    """The validator counts a block's whole subtree as the block's: the planner agrees,
    and a top-level parameter nothing uses is fetched in <post> (never offloaded unfetched)."""
    g = trace(Net(), ["blocks.0", "blocks.1"])
    assert "blocks.0.spare.weight" in g.uses["blocks.0"]
    assert "lonely" in g.uses[P.POST]
    plan = _offloaded(Net())  # load() ran the validator: the plan is accepted
    assert "lonely" in plan.model.post_block_params
    owner = {p.name: c.id for c in plan.chunks.items for p in c.params}
    post = next(s for s in plan.schedule.forward if s.segment == P.POST)
    assert owner["lonely"] in post.fetch


def test_a_block_called_twice_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"block 'blocks\.0' is called 2 times in one forward"):
        trace(Net(repeat=2), ["blocks.0", "blocks.1"])


def test_the_profiler_refuses_a_block_called_twice_cleanly():
    from protrain.planner.commands.measure import measure
    from protrain.planner.hardware.spec import find_spec

    with pytest.raises(ConfigError, match="called 2 times"):
        measure(
            Net(repeat=2),
            name="net",
            blocks=["blocks.0", "blocks.1"],
            micro_batch=1,
            seq_len=4,
            compute_dtype="float32",
            device="cpu",
            spec=find_spec("cpu"),
            warmup=0,
            iterations=1,
        )


def test_blocks_listed_out_of_order_are_refused():
    with pytest.raises(ConfigError, match="not in the listed order"):
        trace(Net(), ["blocks.1", "blocks.0"])


class DataDependent(Net):
    """A forward that cannot run on meta (it reads a value): traced live, then restored."""

    def forward(self, idx, targets):
        if self.wte.weight.sum().item() > 1e9:
            raise AssertionError("unreachable")
        return super().forward(idx, targets)


@pytest.mark.parametrize("cls", [Net, DataDependent])
def test_planning_a_live_model_changes_nothing(cls):
    torch.manual_seed(0)
    model = cls(max_norm=0.5)  # Embedding renormalises rows in place in forward
    model.blocks[1].eval()  # a mixed train/eval model keeps its flags
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [m.training for m in model.modules()]
    rng = torch.get_rng_state()
    _offloaded(model)
    after = model.state_dict()
    for k, v in before.items():
        assert torch.equal(v, after[k]), k
    assert [m.training for m in model.modules()] == flags
    assert torch.equal(torch.get_rng_state(), rng)


def test_batchnorm_under_checkpoint_updates_twice_as_plain_checkpoint_does():
    """Item 7: a checkpointed block's forward runs again in backward, so BatchNorm's
    running statistics are updated twice per step, exactly as ``torch.utils.checkpoint``
    (non-reentrant) does on the plain model; protrain matches that, bit for bit."""
    import anyworker as W

    spec = {
        "seed": 5,
        "vocab": 17,
        "d": 7,
        "pos": False,
        "tie_head": True,
        "tie_blocks": False,
        "repeat": False,
        "top_unused": 0,
        "frozen_frac": 0.0,
        "micro": 2,
        "seq": 4,
        "accum": 2,
        "steps": 4,
        "blocks": [{"h": 5, "bias": True, "dropout": 0.2, "bn": True, "spare": 0, "buffer": False}]
        * 2,
        "plans": [],
    }
    model = W.build(spec)
    plan = emit(
        model,
        name="any",
        blocks=["blocks.0", "blocks.1"],
        training=P.Training(
            micro_batch=2,
            seq_len=4,
            compute_dtype="float32",
            master_dtype="float32",
            world_size=1,
            grad_accum=2,
        ),
        chunk_numel=512,
        persistent=[0],
        n_buffer=2,
        policies=["checkpoint", "keep"],
    )
    assert W.train(spec, plan) == {"status": "ok"}  # losses, parameters and buffers equal

    # What plain PyTorch does, which the line above matched: two updates per micro-batch.
    from torch.utils.checkpoint import checkpoint

    bn = model.blocks[0]
    x = torch.randn(2, 4, 7, requires_grad=True)
    checkpoint(bn, x, use_reentrant=False).sum().backward()
    assert int(bn.bn.num_batches_tracked) == 2
