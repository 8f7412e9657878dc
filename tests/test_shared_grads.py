"""A parameter two segments use (a tied embedding and LM head) holds a gradient on the
device between their backward steps (plans/accounting.py ``shared_grads``).

The rule's premise is autograd's, measured here with the profiler's allocation events
in plain PyTorch and inside ``engine.step``; the rule itself is checked on a plan and
in the CPU ledger here, and against the cost model by tests/test_accounting.py's
property test (tied models included)."""

from __future__ import annotations

from itertools import accumulate

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from protrain.planner.search import memory_walk
from protrain.plans import accounting


class Tied(nn.Module):
    def __init__(self, vocab: int = 1000, d: int = 48):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.blocks(self.emb(idx)))


def _held_across(run, n: int) -> None:
    """Run ``run()`` under the profiler: from backward's first allocation of ``n`` bytes (the
    later use's gradient) to the start of the embedding's backward, tensors of ``n`` bytes are
    never all freed (other tensors of that size may come and go in between)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    starts = [
        e.start_ns() for e in events if e.name().startswith("autograd::engine::evaluate_function")
    ]
    emb_bwd = next(
        e.start_ns() for e in events if e.name().endswith("evaluate_function: EmbeddingBackward0")
    )
    mem = [
        e.nbytes()
        for e in events
        if e.name() == "[memory]" and abs(e.nbytes()) == n and starts[0] < e.start_ns() < emb_bwd
    ]
    live = list(accumulate(b // n for b in mem))
    assert mem and mem[0] == n and min(live) >= 1, mem


@pytest.mark.parametrize("tied", [True, False])
def test_autograd_holds_the_later_use_gradient_until_the_earlier_backward(tied):
    torch.manual_seed(0)
    model = Tied()
    if not tied:  # the control: the head's own weight, its gradient added in place and freed
        model.head.weight = nn.Parameter(model.emb.weight.detach().clone())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # as the executor's gradient views: accumulated in place
    idx = torch.randint(0, 1000, (2, 16))
    run = lambda: model(idx).float().logsumexp(-1).sum().backward()  # noqa: E731
    if tied:
        _held_across(run, model.emb.weight.numel() * 4)
    else:
        with pytest.raises(AssertionError):
            _held_across(run, model.emb.weight.numel() * 4)


def test_the_executor_leaves_the_hold_as_autograd_makes_it():
    from protrain.executor import wrap
    from protrain.planner.models.zoo import build

    meta, plan = _plan("float32")
    model = build("gpt2-tiny", device="cpu")
    engine = wrap(model, plan, device="cpu")
    n = meta.transformer.wte.weight.numel() * 4
    idx = torch.randint(0, 100, (1, 9))
    seen = []  # the CPU ledger's count of it at each backward segment's begin and end
    engine.on_event(
        lambda e: (
            seen.append((e.segment, e.edge, engine.ledger.bytes["shared_grads"]))
            if e.kind == "segment" and e.phase == "backward"
            else None
        )
    )
    _held_across(lambda: engine.step((idx[:, :-1], idx[:, 1:])), n)
    assert engine.ledger.bytes["shared_grads"] == 0  # closed when <pre>'s backward ended
    engine.close()
    blocks = plan.model.blocks
    want = [("<post>", "begin", 0), ("<post>", "end", 0)]
    want += [(b, edge, n) for b in reversed(blocks) for edge in ("begin", "end")]
    assert seen == want + [("<pre>", "begin", n), ("<pre>", "end", n)]


def _plan(dtype: str = "bfloat16"):
    from protrain.planner.models.zoo import block_paths, build
    from protrain.planner.search.emit import emit
    from protrain.plans import plan as P

    meta = build("gpt2-tiny", device="meta")
    blocks = block_paths(meta)
    t = P.Training(
        micro_batch=1,
        seq_len=8,
        compute_dtype=dtype,
        master_dtype="float32",
        world_size=1,
        grad_accum=1,
    )
    return meta, emit(
        meta,
        name="gpt2-tiny",
        blocks=blocks,
        training=t,
        chunk_numel=50_176,
        persistent=[],
        n_buffer=3,
        policies=["keep"] * len(blocks),
    )


def test_shared_grads_rule_on_a_tied_plan():
    meta, plan = _plan()
    wte = meta.transformer.wte.weight
    n = wte.numel() * 2
    assert accounting.shared_grads(plan) == {(plan.model.blocks[-1], 1): n, ("<pre>", -1): n}
    owner = next(
        c.id for c in plan.chunks.items for p in c.params if p.name == "transformer.wte.weight"
    )
    trainable = [c.id != owner for c in plan.chunks.items]  # the tied weight's chunk frozen
    assert not accounting.shared_grads(plan, trainable)
    # in the stream: opened at the backward step after <post>, closed at the end of <pre>'s
    held = [
        (e.phase, e.segment, e.nbytes) for e in memory_walk.events(plan) if e.kind == "shared_grads"
    ]
    assert held == [
        ("backward", plan.model.blocks[-1], wte.numel() * 2),
        ("backward", "<pre>", -wte.numel() * 2),
    ]


def _ledger_trace(engine, run):
    """The CPU ledger's shared-gradient count at each backward segment's begin, while ``run()``."""
    seen = []
    engine.on_event(
        lambda e: (
            seen.append(engine.ledger.bytes["shared_grads"])
            if e.kind == "segment" and e.phase == "backward" and e.edge == "begin"
            else None
        )
    )
    run()
    return seen


def test_a_frozen_tied_weight_holds_nothing():
    # a model we did not design for it: GPT-2 with its tied embedding frozen (its chunk
    # stays trainable: wpe and the first block's parameters share it): autograd computes no
    # gradient for it, and the ledger, which knows each parameter, counts none
    from protrain.executor import wrap
    from protrain.planner.models.zoo import build

    meta, plan = _plan("float32")
    model = build("gpt2-tiny", device="cpu")
    model.transformer.wte.weight.requires_grad_(False)
    engine = wrap(model, plan, device="cpu")
    owner = next(
        c for c in plan.chunks.items if any(p.name == "transformer.wte.weight" for p in c.params)
    )
    assert engine.store.chunks[owner.id].trainable
    idx = torch.randint(0, 100, (1, 9))
    step = lambda: engine.step((idx[:, :-1], idx[:, 1:]))  # noqa: E731
    assert set(_ledger_trace(engine, step)) == {0}
    with pytest.raises(AssertionError):
        _held_across(step, meta.transformer.wte.weight.numel() * 4)
    engine.close()


@pytest.mark.parametrize("family", ["gemma", "gpt2"])
def test_transformers_tied_families_hold_it_as_counted(family, tmp_path):
    # transformers' own tied families (embed_tokens / wte and lm_head), offloaded and
    # checkpointed with two micro-batches: the hold is there in each, and the ledger counts
    # it through every block's backward
    pytest.importorskip("transformers")
    from test_hf_families import MICRO, SEQ, make_plan, write_family

    from protrain.executor import wrap
    from protrain.planner.models import hf
    from protrain.planner.models.data import batches, load_tokens
    from protrain.planner.models.zoo import build

    name = write_family(tmp_path / family, family, hf)
    plan = make_plan(name, "offloaded-checkpoint-accum2")
    ((tied, _),) = plan.model.tied
    n = next(p.numel for c in plan.chunks.items for p in c.params if p.name == tied) * 4
    engine = wrap(build(name, seed=1), plan, device="cpu")
    data = batches(load_tokens(), MICRO, SEQ, 0)
    step = lambda: engine.step([next(data), next(data)])  # noqa: E731
    blocks = len(plan.model.blocks)
    assert (
        _ledger_trace(engine, step) == ([0] + [n] * (blocks + 1)) * 2
    )  # <post>, blocks, <pre>; twice
    _held_across(step, n)
    assert engine.ledger.bytes["shared_grads"] == 0
    engine.close()
