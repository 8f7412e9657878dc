"""Cost-model terms against what the executor does: transfer counts bound the emitted
schedule, and on CPU the predicted peak is the ledger's measured peak."""

from __future__ import annotations

import random

import pytest
from harness import make_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planfactory import gpu_spec, random_facts, synthetic_profile

from protrain.executor import AdamWConfig, wrap
from protrain.executor import plan as P
from protrain.planner.cost import (
    block_policies,
    choose_chunk_numel,
    facts_from_profile,
    make_terms,
    min_buffers,
)
from protrain.planner.data import batches, load_tokens
from protrain.planner.emit import assemble
from protrain.planner.models import block_paths
from protrain.planner.profile import measure
from protrain.planner.search import policy_pairs, space


def test_block_policies_layout():
    assert block_policies(8, 2, 4) == ["swap", "checkpoint", "checkpoint", "swap", "checkpoint",
                                       "checkpoint", "keep", "keep"]
    assert block_policies(4, 0, 0) == ["keep"] * 4
    assert block_policies(3, 3, 0) == ["swap"] * 3
    assert block_policies(5, 1, 2) == ["swap", "checkpoint", "checkpoint", "keep", "keep"]


def _uploads(plan: P.Plan) -> tuple[int, int]:
    """Chunks uploaded in forward and in backward when replaying ``plan``."""
    resident: set[int] = set()
    counts = []
    for steps in (plan.schedule.forward, plan.schedule.backward):
        n = 0
        for s in steps:
            n += len(set(s.fetch) - resident) + len(s.prefetch)
            resident |= set(s.fetch) | set(s.prefetch)
            resident -= set(s.release)
        counts.append(n)
    return counts[0], counts[1]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_facts(), st.integers(0, 2**31))
def test_transfer_counts_bound_the_schedule(facts, seed):
    rng = random.Random(seed)
    prof = synthetic_profile(facts, gpu_spec(), block_us=100, act_bytes=1000, rng=rng)
    size, _ = choose_chunk_numel(facts_from_profile(prof))
    t = make_terms(prof, size)
    training = P.Training(micro_batch=1, seq_len=1024, compute_dtype="bfloat16", master_dtype="float32",
                          world_size=1, grad_accum=1)
    for n_persist, n_buffer in rng.sample(space(t), min(6, len(space(t)))):
        sw, ck = rng.choice(policy_pairs(t))
        plan = assemble(facts_from_profile(prof), training=training, chunk_numel=size,
                        persistent=list(range(n_persist)), n_buffer=n_buffer,
                        policies=block_policies(t.n_blocks, sw, ck))
        fwd, bwd = _uploads(plan)
        import numpy as np

        off = (np.arange(t.n_chunks) >= n_persist).astype(int)
        order = sorted(np.nonzero(off)[0], key=lambda c: (-t.last_fwd_use[c], -c))
        cached = np.zeros(t.n_chunks, dtype=int)
        cached[order[:n_buffer]] = 1
        model_fwd = int((t.up_fwd @ off).sum())
        later = t.up_bwd * (np.cumsum(t.up_bwd[::-1], axis=0)[::-1] > 1)
        model_bwd = int((t.up_bwd @ (off * (1 - cached))).sum() + (later @ (off * cached)).sum())
        assert fwd <= model_fwd and bwd <= model_bwd, (n_persist, n_buffer, fwd, model_fwd, bwd, model_bwd)
        assert n_buffer >= min_buffers(t, n_persist)


CPU_SPEC = gpu_spec().__class__(**{**{f: getattr(gpu_spec(), f) for f in gpu_spec().__struct_fields__},
                                   "kind": "cpu", "name": "cpu-test"})


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_cpu_predicted_peak_is_the_ledger_peak(name, capsys):
    model = make_model(name)  # the same model (dropout on) the engine trains below
    prof = measure(model, name=name, blocks=block_paths(model), micro_batch=4, seq_len=64,
                   compute_dtype="float32", device="cpu", spec=CPU_SPEC, warmup=1, iterations=1)
    facts = facts_from_profile(prof)
    size, _ = choose_chunk_numel(facts)
    t = make_terms(prof, size)
    from protrain.planner.cost import predict

    rows = []
    configs = [(t.n_chunks, 0, 0, 0), (1, min_buffers(t, 1), 0, 0), (0, min_buffers(t, 0), 0, 0),
               (0, min_buffers(t, 0) + 1, 1, 1), (0, min_buffers(t, 0), 0, t.n_blocks),
               (0, min_buffers(t, 0), t.n_blocks, 0), (1, min_buffers(t, 1), 1, 0)]
    training = P.Training(micro_batch=4, seq_len=64, compute_dtype="float32", master_dtype="float32",
                          world_size=1, grad_accum=1)
    for cfg in configs:
        plan = assemble(facts, training=training, chunk_numel=size, persistent=list(range(cfg[0])),
                        n_buffer=cfg[1], policies=block_policies(t.n_blocks, cfg[2], cfg[3]))
        engine = wrap(make_model(name), plan, AdamWConfig(), device="cpu")
        data = batches(load_tokens(), 4, 64, 0)
        measured = max(engine.step(next(data)).peak_bytes for _ in range(2))
        predicted = predict(t, *cfg).peak_bytes
        rows.append((cfg, predicted, measured))
        assert abs(predicted - measured) <= 0.10 * measured, (cfg, predicted, measured)
        assert predicted >= measured, (cfg, predicted, measured)  # never under-predict
    with capsys.disabled():
        print(f"\n{name} CPU ledger peak, predicted / measured:",
              ", ".join(f"{c} {p / m:.3f}" for c, p, m in rows))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_facts(), st.integers(0, 2**31))
def test_any_placement_evaluates_the_paper_space_bit_for_bit(facts, seed):
    # The general evaluator (persistent ids, strips) is the paper-space one: a prefix given
    # as ids and the paper's strips give the same floats, to the last bit.
    import numpy as np

    from protrain.planner.cost import evaluate, policy_grid, strips_grid

    rng = random.Random(seed)
    prof = synthetic_profile(facts, gpu_spec(), block_us=rng.uniform(10, 5000), act_bytes=rng.randint(10**3, 10**7),
                             rng=rng)
    t = make_terms(prof, choose_chunk_numel(facts_from_profile(prof))[0])
    pairs = policy_pairs(t)
    n_persist, n_buffer = rng.choice(space(t))
    by_count = evaluate(t, n_persist, n_buffer, policy_grid(t.n_blocks, pairs))
    by_ids = evaluate(t, list(range(n_persist)), n_buffer,
                      strips_grid([block_policies(t.n_blocks, s, c) for s, c in pairs]))
    assert np.array_equal(by_count[0], by_ids[0]) and np.array_equal(by_count[1], by_ids[1])
    assert all(np.array_equal(by_count[2][k], by_ids[2][k]) for k in by_count[2])
    # A swapped block's saved tensors are host bytes at the forward→backward turn; nothing else is.
    swapped = policy_grid(t.n_blocks, pairs).swap
    assert np.allclose(by_count[2]["host_swap_bytes"], swapped @ t.saved_tensor)
