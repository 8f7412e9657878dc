"""The MILP solver (planner/search/milp.py): its program is the cost model, configuration by
configuration; held to the paper's space it finds the exhaustive search's optimum;
free, it is never worse; its plans emit, explain and fall back as documented."""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planfactory import gpu_spec, random_facts, synthetic_profile

from protrain.planner.profiling.profile import load_profile
from protrain.planner.search import milp as M
from protrain.planner.search.cost import (
    choose_chunk_numel,
    evaluate,
    facts_from_profile,
    make_terms,
    min_buffers,
    predict,
    predict_plan,
    strips_grid,
)
from protrain.planner.search.departures import is_four_count
from protrain.planner.search.exhaustive import exhaustive, policy_pairs, space
from protrain.planner.search.planning import SOLVERS, default_host_budget, make_plan
from protrain.planner.search.policy_layout import block_policies
from protrain.planner.views.show import render_explain
from protrain.plans import plan as P
from protrain.plans.errors import BudgetError

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("keep", "swap", "checkpoint")
CPU_ADAM = ("during_backward", "after_backward")  # Schedule.cpu_adam: the program models both


def _terms(
    facts,
    seed: int,
    gpu: bool,
    world_size: int = 1,
    cpu_adam: str = "during_backward",
    shard: bool | None = None,
):
    rng = random.Random(seed)
    spec = gpu_spec(link_gbps=rng.choice([2.0, 24.0]), cpu_adam=rng.choice([2e8, 1e9]))
    if not gpu:
        spec = msgspec.structs.replace(spec, kind="cpu")
    prof = synthetic_profile(
        facts, spec, block_us=rng.uniform(10, 5000), act_bytes=rng.randint(10**3, 10**7), rng=rng
    )
    size, _ = choose_chunk_numel(facts_from_profile(prof))
    return make_terms(prof, size, world_size, cpu_adam, shard_persistent=shard), rng


def _budget(t, where: float) -> float:
    peaks = [predict(t, a, b, s, c).peak_bytes for a, b in space(t) for s, c in policy_pairs(t)]
    return min(peaks) + where * (max(peaks) - min(peaks))


def _fix(m: M.Program, idx, value: float) -> None:
    m.lb[idx] = m.ub[idx] = float(value)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    random_facts(),
    st.integers(0, 2**31),
    st.booleans(),
    st.sampled_from([1, 2]),
    st.sampled_from(CPU_ADAM),
    st.booleans(),
)
def test_program_is_the_cost_model_on_any_configuration(
    facts, seed, gpu, world_size, cpu_adam, shard
):
    # Fix every decision of the program to a random configuration (any persistent set,
    # any strip, any workable buffer count): its optimum is then the cost model's time,
    # and it is feasible exactly when the cost model says the configuration fits. At two
    # ranks, persistent optimizer states sharded or replicated.
    t, rng = _terms(facts, seed, gpu, world_size, cpu_adam, shard)
    persistent = sorted(rng.sample(range(t.n_chunks), rng.randint(0, t.n_chunks)))
    n_off = t.n_chunks - len(persistent)
    least = min_buffers(t, persistent)
    nb = rng.randint(least, n_off) if n_off else 0
    strip = [rng.choice(POLICIES) for _ in range(t.n_blocks)]
    time, peak, parts = evaluate(t, persistent, nb, strips_grid([strip]))
    host = float(parts["host_bytes"][0] + parts["host_swap_bytes"][0])
    for slack in (1.0 + 1e-6, 1.0 - 1e-3):  # just above, then below the configuration's peak
        budget = float(peak[0]) * slack
        m, h = M.formulate(t, budget, host * 2 + 1)
        for c in range(t.n_chunks):
            _fix(m, h.off[c], c not in persistent)
        _fix(m, h.n_buffer, nb)
        for b, pol in enumerate(strip):
            _fix(m, h.swap[b], pol == "swap")
            _fix(m, h.ckpt[b], pol == "checkpoint")
        res = m.solve(h.objective, 30, rel_gap=0.0)
        if slack > 1:
            assert res.status == 0, res.message
            got_us = (res.fun + h.objective.const) / M.MS
            assert math.isclose(got_us, float(time[0]), rel_tol=1e-7, abs_tol=1e-3), (
                got_us,
                float(time[0]),
            )
        else:
            assert res.status == 2, (res.status, res.message)  # infeasible: over the budget


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    random_facts(),
    st.integers(0, 2**31),
    st.floats(0.0, 1.0),
    st.booleans(),
    st.sampled_from(CPU_ADAM),
)
def test_paper_space_program_finds_the_exhaustive_optimum(facts, seed, where, gpu, cpu_adam):
    t, _ = _terms(facts, seed, gpu, cpu_adam=cpu_adam)
    budget = _budget(t, where)
    best = exhaustive(t, budget).best
    solved = M.solve_program(t, budget, paper_space=True, rel_gap=0.0, time_limit_s=60)
    assert (best is None) == (solved.choice is None), (best, solved)
    if best is not None:
        got = solved.choice
        assert solved.status == "optimal"
        assert round(got.time_us) == round(best.time_us), (got, best)
        assert got.four_count and got.peak_bytes <= budget
        # The program's own objective at its solution is the cost model's time.
        assert math.isclose(solved.objective_us, got.time_us, rel_tol=1e-7, abs_tol=1e-3)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    random_facts(),
    st.integers(0, 2**31),
    st.floats(0.0, 1.0),
    st.booleans(),
    st.floats(0.3, 1.5),
    st.sampled_from(CPU_ADAM),
)
def test_free_program_is_never_worse(facts, seed, where, gpu, host_share, cpu_adam):
    t, _ = _terms(facts, seed, gpu, cpu_adam=cpu_adam)
    budget = _budget(t, where)
    # A host budget that binds sometimes: a share of the all-offloaded host need.
    host_budget = host_share * M.host_bytes_per_chunk(t).sum()
    base = exhaustive(t, budget, host_budget)
    result = M.solve(t, budget, host_budget, time_limit_s=60)
    assert (base.best is None) == (result.best is None)
    if base.best is None:
        return
    got = result.best
    assert got.key() <= base.best.key()
    again = predict_plan(
        t,
        got.persistent_ids(),
        got.n_buffer,
        got.strip(t.n_blocks),
        got.homeless_ids(t.n_chunks),
        got.homed_ids(t.n_chunks),
    )
    assert again.time_us == got.time_us and again.peak_bytes <= budget
    assert again.breakdown["host_bytes"] + again.breakdown["host_swap_bytes"] <= host_budget
    assert result.baseline == base.best


def test_fallback_when_highs_finds_nothing(monkeypatch):
    prof = load_profile(ROOT / "plans/profiles/gpt2-xl/gpt2-xl-rtx3090-b8-s1024.json")

    class NoSolution:
        status, x, mip_gap, message = 1, None, None, "time limit reached"

    monkeypatch.setattr(M.Program, "solve", lambda self, *a, **k: NoSolution())
    plan, result = make_plan(prof, prof.hardware.usable_memory_bytes, solver="milp")
    ref, _ = make_plan(prof, prof.hardware.usable_memory_bytes, solver="exhaustive")
    assert result.status == "time limit"
    assert result.warnings and "exhaustive search's plan" in result.warnings[0]
    assert plan.provenance.search.solver.startswith("exhaustive (milp fallback")
    assert (plan.placement, plan.activations) == (ref.placement, ref.activations)


# -- the committed grid: how often and by how much the MILP wins


def _grid():
    return sorted((ROOT / "plans" / "profiles").rglob("*.json"))


@pytest.mark.slow
def test_win_rate_on_the_committed_grid(capsys):
    rows = []
    for path in _grid():
        prof = load_profile(path)
        for w in (1, 4):
            t = make_terms(prof, choose_chunk_numel(facts_from_profile(prof))[0], w)
            budget = prof.hardware.usable_memory_bytes
            host = default_host_budget(prof.hardware)
            # Any incumbent the time limit leaves must be no worse than the exhaustive search's
            # and within both budgets, so a short limit checks the same invariants.
            r = M.solve(t, budget, host, time_limit_s=1)
            if r.best is None:
                continue
            gain = (r.baseline.time_us - r.best.time_us) / r.baseline.time_us
            rows.append((path.stem, w, gain, r.status, r.solver_seconds["milp"]))
            assert gain >= 0 and r.best.peak_bytes <= budget and r.best.host_bytes <= host
    wins = [g for _, _, g, _, _ in rows if g > 1e-4]
    with capsys.disabled():
        print(
            f"\nMILP vs exhaustive on {len(rows)} fitting cells of the grid: wins {len(wins)} "
            f"(> 0.01%), median win {100 * statistics.median(wins or [0]):.2f}%, "
            f"largest {100 * max(wins or [0]):.2f}%; statuses "
            f"{ {s: sum(r[3] == s for r in rows) for s in {r[3] for r in rows}} }"
        )
    assert rows


def _llama70b_replicated():
    # The bench's figure (tools/bench/milp.py): device budget only, the hardest setting
    # (a host budget makes most llama-70b cells infeasible and the program trivial).
    # Persistent optimizer states replicated, as the bench measured it before plan v3;
    # sharded (what make_plan asks at 4 ranks now) see the slow test below.
    prof = load_profile(ROOT / "plans/profiles/llama-70b/llama-70b-h100-b1-s4096.json")
    t = make_terms(prof, choose_chunk_numel(facts_from_profile(prof))[0], 4, shard_persistent=False)
    return prof, M.solve_program(t, prof.hardware.usable_memory_bytes)


def test_llama70b_milp_proves_its_choice_optimal():
    prof, solved = _llama70b_replicated()
    assert solved.status == "optimal"
    assert solved.choice.peak_bytes <= prof.hardware.usable_memory_bytes


@pytest.mark.bench
def test_llama70b_milp_under_two_seconds(capsys):
    _, solved = _llama70b_replicated()
    with capsys.disabled():
        print(f"\nllama-70b (h100, W=4, replicated) MILP: {solved.status}, {solved.seconds:.2f} s")
    assert solved.status == "optimal" and solved.seconds < 2.0


@pytest.mark.slow
def test_llama70b_milp_with_sharded_persistent_states(capsys):
    # Sharded persistent states make a persistent chunk cost 7 instead of 16 device bytes
    # per element here (bf16, 4 ranks): four of the 41 chunks fit where two did, and HiGHS
    # takes ~5 s instead of ~0.5 s on this 2-core machine to prove its choice optimal,
    # over the < 2 s target. TODO(#17): break the symmetry of which chunks persist.
    # Here only that it proves it (a generous limit: the time depends on the load).
    prof = load_profile(ROOT / "plans/profiles/llama-70b/llama-70b-h100-b1-s4096.json")
    t = make_terms(prof, choose_chunk_numel(facts_from_profile(prof))[0], 4)
    assert t.shard_persistent
    solved = M.solve_program(t, prof.hardware.usable_memory_bytes, time_limit_s=120)
    with capsys.disabled():
        print(f"\nllama-70b (h100, W=4, sharded) MILP: {solved.status}, {solved.seconds:.2f} s")
    assert solved.status == "optimal" and solved.choice.n_persist > 2


# -- plans, explain


@pytest.fixture(scope="module")
def departing():
    """A library cell where the MILP leaves the paper's space (mistral-7b on an H100)."""
    prof = load_profile(ROOT / "plans/profiles/mistral-7b/mistral-7b-h100-b4-s2048.json")
    plan, result = make_plan(prof, prof.hardware.usable_memory_bytes, solver="milp")
    return prof, plan, result


def test_milp_plan_leaves_the_paper_space_and_records_the_four_count_plan(departing):
    prof, plan, result = departing
    s = plan.provenance.search
    assert s.solver.startswith("milp (HiGHS optimal") and not is_four_count(plan)
    base = s.runners_up[0]
    assert (base.n_persist, base.n_buffer, base.n_swap, base.n_checkpoint) == (
        result.baseline.n_persist,
        result.baseline.n_buffer,
        result.baseline.n_swap,
        result.baseline.n_checkpoint,
    )
    assert plan.prediction.iter_time_us < base.iter_time_us
    assert plan.prediction.peak_memory_bytes <= plan.hardware.budget_bytes
    # The plan says what it is: its placement and strip are the MILP's choice.
    assert plan.placement.persistent == result.best.persistent_ids()
    assert [a.policy for a in plan.activations] == result.best.strip(len(plan.model.blocks))
    assert P.dump(plan) == P.dump(
        make_plan(prof, prof.hardware.usable_memory_bytes, solver="milp")[0]
    )


def test_explain_prices_each_departure(departing):
    prof, plan, result = departing
    deps = M.explain_departures(prof, plan)
    assert deps
    text = render_explain(plan, "x.json", deps)
    assert "four-count" in text and "departure" in text and "ms" in text
    unpriced = render_explain(plan, "x.json")
    assert "pass --profile" in unpriced
    # Undoing every departure at once gives back the four-count plan's strip and prefix.
    base = plan.provenance.search.runners_up[0]
    strip = [a.policy for a in plan.activations]
    for d in deps:
        if d.kind == "blocks":
            strip[d.first : d.last + 1] = block_policies(
                len(strip), base.n_swap, base.n_checkpoint
            )[d.first : d.last + 1]
    assert strip == block_policies(len(strip), base.n_swap, base.n_checkpoint)
    assert all(d.buys_us is not None for d in deps)


def test_milp_is_registered_and_deterministic():
    assert set(SOLVERS) == {"exhaustive", "milp"}
    prof = load_profile(ROOT / "plans/profiles/llama-7b/llama-7b-rtx3090-b4-s2048.json")
    a = make_plan(prof, prof.hardware.usable_memory_bytes, solver="milp", world_size=4)[0]
    b = make_plan(prof, prof.hardware.usable_memory_bytes, solver="milp", world_size=4)[0]
    assert P.dump(a) == P.dump(b)


def test_host_budget_refuses_with_the_figures():
    prof = load_profile(ROOT / "plans/profiles/llama-13b/llama-13b-rtx3090-b4-s2048.json")
    with pytest.raises(BudgetError) as e:
        make_plan(prof, prof.hardware.usable_memory_bytes, solver="milp")
    msg = str(e.value)
    assert msg.startswith("host memory:") and "available" in msg and "--world-size" in msg
    host = default_host_budget(prof.hardware)
    assert f"{host / 2**30:.2f} GiB available" in msg


def test_host_budget_binds_the_choice():
    # A host budget between the least and the most any fitting configuration needs: both
    # solvers keep to it, and the plan they return would not have been chosen without it.
    prof = load_profile(ROOT / "plans/profiles/gpt2-xl/gpt2-xl-rtx3090-b8-s1024.json")
    budget = prof.hardware.usable_memory_bytes
    free, _ = make_plan(prof, budget, host_budget_bytes=2**50)
    b = free.prediction.breakdown
    cap = int(0.8 * (b["host_bytes"] + b["host_swap_bytes"]))
    for solver in ("exhaustive", "milp"):
        plan, _ = make_plan(prof, budget, solver=solver, host_budget_bytes=cap)
        pb = plan.prediction.breakdown
        assert pb["host_bytes"] + pb["host_swap_bytes"] <= cap
        assert plan.prediction.iter_time_us >= free.prediction.iter_time_us


def test_swapped_activations_are_a_host_term():
    prof = load_profile(ROOT / "plans/profiles/gpt2-xl/gpt2-xl-rtx3090-b8-s1024.json")
    t = make_terms(prof, choose_chunk_numel(facts_from_profile(prof))[0])
    strip = ["swap", "keep"] * (t.n_blocks // 2) + ["keep"] * (t.n_blocks % 2)
    p = predict_plan(t, [], min_buffers(t, 0), strip)
    swapped = {b for b, pol in zip(prof.model.blocks, strip) if pol == "swap"}
    expected = sum(s.saved_tensor_bytes for s in prof.segments if s.segment in swapped)
    assert p.breakdown["host_swap_bytes"] == pytest.approx(expected)
    assert p.breakdown["host_bytes"] == M.host_bytes_per_chunk(t).sum() + t.host_scratch_bytes
    assert np.isclose(
        predict_plan(t, [], min_buffers(t, 0), ["keep"] * t.n_blocks).breakdown["host_swap_bytes"],
        0,
    )


def test_repair_steps_past_the_solvers_tolerance():
    # Found by hypothesis in CI: a budget 4e-9 bytes under the all-persistent peak. HiGHS
    # accepts that configuration within its (relative) feasibility tolerance, and tightening
    # the budget by one byte per repair never excluded it; the repair step now does.
    from protrain.planner.search.emit import ModelFacts

    layers = [f"layers.{i}" for i in range(3)]
    facts = ModelFacts(
        name="synthetic",
        blocks=layers,
        params=[
            ("embed.weight", (4, 8), "float32"),
            *((f"{b}.p0", (1,), "float32") for b in layers),
            ("norm.weight", (8,), "float32"),
            ("head.weight", (4, 8), "float32"),
        ],
        tied=[],
        segments=["<pre>", *layers, "<post>"],
        order=["embed.weight", *(f"{b}.p0" for b in layers), "norm.weight", "head.weight"],
        uses={
            "<pre>": ["embed.weight"],
            **{b: [f"{b}.p0"] for b in layers},
            "<post>": ["norm.weight", "head.weight"],
        },
    )
    t, _ = _terms(facts, 1, False)
    budget = _budget(t, 0.9999999999999999)
    best = exhaustive(t, budget).best
    solved = M.solve_program(t, budget, paper_space=True, rel_gap=0.0)
    assert solved.choice is not None and solved.repairs >= 1, solved
    assert (
        round(solved.choice.time_us) == round(best.time_us) and solved.choice.peak_bytes <= budget
    )
