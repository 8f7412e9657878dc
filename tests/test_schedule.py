"""Residency follows the plan's schedule exactly, and released chunks hold no storage."""

from __future__ import annotations

import pytest
from harness import make_model, make_plan

from protrain.executor import AdamWConfig, wrap
from protrain.planner.models.data import batches, load_tokens
from protrain.plans import validation as V


@pytest.mark.parametrize(
    "model,persistent,n_buffer,policies",
    [
        ("gpt2-4", [], 2, "keep"),
        ("gpt2-4", [0], 3, "swap checkpoint keep swap"),
        ("llama-4", [], 1, "checkpoint"),
        ("llama-4", [1, 3], 2, "keep swap keep checkpoint"),
    ],
)
def test_residency_at_each_segment_begin_matches_the_plan(model, persistent, n_buffer, policies):
    plan = make_plan(model, persistent=persistent, n_buffer=n_buffer, policies=policies)
    engine = wrap(make_model(model), plan, AdamWConfig(), device="cpu")
    expected = V.simulate_residency(plan)
    data = batches(load_tokens(), 4, 32, 0)
    chunk_bytes = plan.chunks.chunk_numel * 4
    got = []  # (phase, segment, resident offloaded ids, bytes of their storage) per segment begin

    def probe(ev):
        if ev.kind == "segment" and ev.edge == "begin":
            store = engine.store
            got.append(
                (
                    ev.phase,
                    ev.segment,
                    store.resident_offloaded(),
                    sum(
                        store.chunks[c.id].dev.untyped_storage().nbytes()
                        for c in store.chunks
                        if not c.persistent
                    ),
                )
            )

    engine.on_event(probe)
    for _ in range(2):  # the second step starts from what the first left behind
        got.clear()
        engine.step(next(data))
        assert [(ph, seg, res) for ph, seg, res, _ in got] == expected
        for _, seg, resident, nbytes in got:
            assert len(resident) <= plan.placement.n_buffer
            assert nbytes == len(resident) * chunk_bytes, seg  # released chunks: 0 bytes
        for c in plan.placement.offloaded:
            assert engine.store.chunks[c].dev.untyped_storage().nbytes() == 0
            assert engine.store.chunks[c].dev_grad.untyped_storage().nbytes() == 0
        for c in plan.placement.persistent:
            assert engine.store.chunks[c].dev.untyped_storage().nbytes() == chunk_bytes


def test_offloads_happen_once_per_chunk_per_micro_batch():
    plan = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep", grad_accum=2)
    engine = wrap(make_model("gpt2-4"), plan, AdamWConfig(), device="cpu")
    seen = []
    original = engine.optim.offload_grad
    engine.optim.offload_grad = lambda cid, first_micro_batch, **kw: (
        seen.append((cid, first_micro_batch)),
        original(cid, first_micro_batch, **kw),
    )
    data = batches(load_tokens(), 4, 32, 0)
    engine.step([next(data), next(data)])
    off = plan.placement.offloaded
    # In the plan's backward order (last chunk first), once per micro-batch.
    order = [c for s in plan.schedule.backward for c in s.offload]
    assert seen == [(c, True) for c in order] + [(c, False) for c in order]
    assert sorted(order) == off
