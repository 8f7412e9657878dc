"""The search: equal to brute force under the same cost model, fast, deterministic, and
reproducing the paper's configuration trends (Table 4 directions)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planfactory import gpu_spec, random_facts, synthetic_profile

from protrain.executor import plan as P
from protrain.executor.errors import BudgetError
from protrain.planner.cost import choose_chunk_numel, facts_from_profile, make_terms, predict
from protrain.planner.planning import make_plan
from protrain.planner.search import exhaustive, policy_pairs, space


def brute_force(t, budget):
    rows = []
    for n_persist, n_buffer in space(t):
        for sw, ck in policy_pairs(t):
            p = predict(t, n_persist, n_buffer, sw, ck)
            if p.peak_bytes <= budget:
                rows.append((round(p.time_us), p.peak_bytes, ck, n_persist, n_buffer, sw, ck))
    return min(rows) if rows else None


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_facts(), st.integers(0, 2**31), st.floats(0.0, 1.0), st.booleans())
def test_search_equals_brute_force(facts, seed, where, gpu):
    rng = random.Random(seed)
    spec = gpu_spec(link_gbps=rng.choice([2.0, 24.0]))
    if not gpu:
        spec = spec.__class__(**{**{f: getattr(spec, f) for f in spec.__struct_fields__}, "kind": "cpu"})
    prof = synthetic_profile(facts, spec, block_us=rng.uniform(10, 5000), act_bytes=rng.randint(10**3, 10**7),
                             rng=rng)
    size, _ = choose_chunk_numel(facts_from_profile(prof))
    t = make_terms(prof, size)
    peaks = [predict(t, a, b, s, c).peak_bytes for a, b in space(t) for s, c in policy_pairs(t)]
    budget = min(peaks) + where * (max(peaks) - min(peaks))
    result = exhaustive(t, budget)
    expected = brute_force(t, budget)
    got = result.best
    assert (got is None) == (expected is None)
    if got is not None:
        assert (got.n_persist, got.n_buffer, got.n_swap, got.n_checkpoint) == expected[3:]
    assert math.isclose(result.min_peak_bytes, min(peaks))


def _llama_like(n_layers=80, name="llama-70b"):
    from protrain.planner.emit import model_facts
    from protrain.planner.models import block_paths, build

    meta = build(name, device="meta")
    return model_facts(meta, name, block_paths(meta), 8)


@pytest.fixture(scope="module")
def llama70b():
    return _llama_like()


def test_llama70b_search_under_a_second(llama70b, capsys):
    prof = synthetic_profile(llama70b, gpu_spec(mem_gib=80), block_us=40_000, act_bytes=2 * 2**30)
    plan, result = make_plan(prof, 76 * 2**30)
    with capsys.disabled():
        print(f"\nllama-70b search: {result.evaluated} of {result.space_size} configurations, "
              f"{result.seconds:.3f} s")
    assert result.seconds < 1.0
    # Planning twice gives byte-identical plans.
    assert P.dump(plan) == P.dump(make_plan(prof, 76 * 2**30)[0])


def _choice(facts, budget_gib, **kw):
    spec_kw = {k: kw.pop(k) for k in list(kw) if k in ("link_gbps", "mem_gib", "cpu_adam", "dev_adam")}
    prof = synthetic_profile(facts, gpu_spec(**spec_kw), **kw)
    plan, result = make_plan(prof, int(budget_gib * 2**30))
    return result.best


@pytest.fixture(scope="module")
def gpt2xl():
    return _llama_like(name="gpt2-xl")


def test_ample_memory_keeps_everything(gpt2xl):
    best = _choice(gpt2xl, 1000, block_us=5000, act_bytes=50 * 2**20, mem_gib=1000)
    terms_chunks = make_terms(synthetic_profile(gpt2xl, gpu_spec(), block_us=5000, act_bytes=50 * 2**20),
                              choose_chunk_numel(gpt2xl)[0]).n_chunks
    assert best.n_persist == terms_chunks and best.n_swap == 0 and best.n_checkpoint == 0


def test_bigger_batch_means_fewer_persistent_and_more_recompute(gpt2xl):
    # Compute and activations grow with the micro-batch; the budget stays.
    picks = {b: _choice(gpt2xl, 20, block_us=2500 * b, act_bytes=60 * 2**20 * b, micro_batch=b)
             for b in (2, 4, 8, 16)}
    persist = [picks[b].n_persist for b in sorted(picks)]
    assert persist == sorted(persist, reverse=True) and persist[0] > persist[-1]
    non_keep = {b: picks[b].n_swap + picks[b].n_checkpoint for b in picks}
    assert non_keep[16] > non_keep[2]


def test_slow_link_prefers_checkpoint_over_swap(gpt2xl):
    fast = _choice(gpt2xl, 20, block_us=5000, act_bytes=300 * 2**20, link_gbps=64)
    slow = _choice(gpt2xl, 20, block_us=5000, act_bytes=300 * 2**20, link_gbps=2)
    assert slow.n_swap <= fast.n_swap
    assert slow.n_checkpoint >= fast.n_checkpoint
    assert fast.n_swap > 0


def test_nothing_fits_names_the_smallest_budget(gpt2xl):
    prof = synthetic_profile(gpt2xl, gpu_spec(), block_us=5000, act_bytes=2**30, micro_batch=8)
    with pytest.raises(BudgetError) as e:
        make_plan(prof, 5 * 2**30)
    msg = str(e.value)
    assert "smallest predicted peak" in msg and "--budget" in msg and "micro-batch of" in msg
