"""Cost-model terms against what the executor does: transfer counts bound the emitted
schedule, and on CPU the predicted peak is the ledger's measured peak."""

from __future__ import annotations

import random

import msgspec
import pytest
from harness import make_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planfactory import gpu_spec, random_facts, synthetic_profile

from protrain.executor import AdamWConfig, wrap
from protrain.planner.commands.measure import measure
from protrain.planner.models.data import batches, load_tokens
from protrain.planner.models.zoo import block_paths
from protrain.planner.search.cost import (
    block_policies,
    choose_chunk_numel,
    facts_from_profile,
    make_terms,
    min_buffers,
)
from protrain.planner.search.emit import assemble
from protrain.planner.search.exhaustive import policy_pairs, space
from protrain.plans import plan as P


def test_block_policies_layout():
    assert block_policies(8, 2, 4) == [
        "swap",
        "checkpoint",
        "checkpoint",
        "swap",
        "checkpoint",
        "checkpoint",
        "keep",
        "keep",
    ]
    assert block_policies(4, 0, 0) == ["keep"] * 4
    assert block_policies(3, 3, 0) == ["swap"] * 3
    assert block_policies(5, 1, 2) == ["swap", "checkpoint", "checkpoint", "keep", "keep"]


def test_policy_grid_is_the_strips_of_block_policies():
    """``policy_grid`` lays out ``block_policies`` for every pair at once, without strings: the
    same masks and counts as ``strips_grid`` of the strips themselves, for every pair."""
    import numpy as np

    from protrain.planner.search import grid as G

    for n in (1, 2, 3, 5, 12, 48, 80):
        pairs = tuple((s, c) for s in range(n + 1) for c in range(n - s + 1))
        fast = G._policy_grid(n, pairs)
        slow = G.strips_grid([block_policies(n, s, c) for s, c in pairs])
        for f in ("n_swap", "n_checkpoint", "swap", "ckpt"):
            a, b = getattr(fast, f), getattr(slow, f)
            assert a.dtype == b.dtype and np.array_equal(a, b), (n, f)


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
    training = P.Training(
        micro_batch=1,
        seq_len=1024,
        compute_dtype="bfloat16",
        master_dtype="float32",
        world_size=1,
        grad_accum=1,
    )
    for n_persist, n_buffer in rng.sample(space(t), min(6, len(space(t)))):
        sw, ck = rng.choice(policy_pairs(t))
        plan = assemble(
            facts_from_profile(prof),
            training=training,
            chunk_numel=size,
            persistent=list(range(n_persist)),
            n_buffer=n_buffer,
            policies=block_policies(t.n_blocks, sw, ck),
        )
        fwd, bwd = _uploads(plan)
        import numpy as np

        off = (np.arange(t.n_chunks) >= n_persist).astype(int)
        order = sorted(np.nonzero(off)[0], key=lambda c: (-t.last_fwd_use[c], -c))
        cached = np.zeros(t.n_chunks, dtype=int)
        cached[order[:n_buffer]] = 1
        model_fwd = int((t.up_fwd @ off).sum())
        later = t.up_bwd * (np.cumsum(t.up_bwd[::-1], axis=0)[::-1] > 1)
        model_bwd = int((t.up_bwd @ (off * (1 - cached))).sum() + (later @ (off * cached)).sum())
        assert fwd <= model_fwd and bwd <= model_bwd, (
            n_persist,
            n_buffer,
            fwd,
            model_fwd,
            bwd,
            model_bwd,
        )
        assert n_buffer >= min_buffers(t, n_persist)


CPU_SPEC = gpu_spec().__class__(
    **{
        **{f: getattr(gpu_spec(), f) for f in gpu_spec().__struct_fields__},
        "kind": "cpu",
        "name": "cpu-test",
    }
)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_cpu_predicted_peak_is_the_ledger_peak(name, capsys):
    model = make_model(name)  # the same model (dropout on) the engine trains below
    prof = measure(
        model,
        name=name,
        blocks=block_paths(model),
        micro_batch=4,
        seq_len=64,
        compute_dtype="float32",
        device="cpu",
        spec=CPU_SPEC,
        warmup=1,
        iterations=1,
    )
    facts = facts_from_profile(prof)
    size, _ = choose_chunk_numel(facts)
    t = make_terms(prof, size)
    from protrain.planner.search.cost import predict

    rows = []
    configs = [
        (t.n_chunks, 0, 0, 0),
        (1, min_buffers(t, 1), 0, 0),
        (0, min_buffers(t, 0), 0, 0),
        (0, min_buffers(t, 0) + 1, 1, 1),
        (0, min_buffers(t, 0), 0, t.n_blocks),
        (0, min_buffers(t, 0), t.n_blocks, 0),
        (1, min_buffers(t, 1), 1, 0),
    ]
    training = P.Training(
        micro_batch=4,
        seq_len=64,
        compute_dtype="float32",
        master_dtype="float32",
        world_size=1,
        grad_accum=1,
    )
    for cfg in configs:
        plan = assemble(
            facts,
            training=training,
            chunk_numel=size,
            persistent=list(range(cfg[0])),
            n_buffer=cfg[1],
            policies=block_policies(t.n_blocks, cfg[2], cfg[3]),
        )
        engine = wrap(make_model(name), plan, AdamWConfig(), device="cpu")
        data = batches(load_tokens(), 4, 64, 0)
        measured = max(engine.step(next(data)).peak_bytes for _ in range(2))
        predicted = predict(t, *cfg).peak_bytes
        rows.append((cfg, predicted, measured))
        assert abs(predicted - measured) <= 0.10 * measured, (cfg, predicted, measured)
        assert predicted >= measured, (cfg, predicted, measured)  # never under-predict
    with capsys.disabled():
        print(
            f"\n{name} CPU ledger peak, predicted / measured:",
            ", ".join(f"{c} {p / m:.3f}" for c, p, m in rows),
        )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_facts(), st.integers(0, 2**31))
def test_any_placement_evaluates_the_paper_space_bit_for_bit(facts, seed):
    # The general evaluator (persistent ids, strips) is the paper-space one: a prefix given
    # as ids and the paper's strips give the same floats, to the last bit.
    import numpy as np

    from protrain.planner.search.cost import evaluate, policy_grid, strips_grid

    rng = random.Random(seed)
    prof = synthetic_profile(
        facts,
        gpu_spec(),
        block_us=rng.uniform(10, 5000),
        act_bytes=rng.randint(10**3, 10**7),
        rng=rng,
    )
    t = make_terms(prof, choose_chunk_numel(facts_from_profile(prof))[0])
    pairs = policy_pairs(t)
    n_persist, n_buffer = rng.choice(space(t))
    by_count = evaluate(t, n_persist, n_buffer, policy_grid(t.n_blocks, pairs))
    by_ids = evaluate(
        t,
        list(range(n_persist)),
        n_buffer,
        strips_grid([block_policies(t.n_blocks, s, c) for s, c in pairs]),
    )
    assert np.array_equal(by_count[0], by_ids[0]) and np.array_equal(by_count[1], by_ids[1])
    assert all(np.array_equal(by_count[2][k], by_ids[2][k]) for k in by_count[2])
    # A swapped block's saved tensors are host bytes at the forward→backward turn; nothing else is.
    swapped = policy_grid(t.n_blocks, pairs).swap
    assert np.allclose(by_count[2]["host_swap_bytes"], swapped @ t.saved_tensor)


# ------------------------------------------------------------- CPU Adam after backward


def _fixed_facts(n_blocks: int = 4):
    """A small decoder-like model: embedding, ``n_blocks`` blocks of a 32×32 weight and a
    bias, a final norm and an untied head; enough chunks for a persistent/offloaded split."""
    from protrain.planner.search.emit import ModelFacts

    blocks = [f"layers.{i}" for i in range(n_blocks)]
    params = [("embed.weight", (64, 32), "float32")]
    uses = {P.PRE: ["embed.weight"]}
    for b in blocks:
        params += [(f"{b}.w", (32, 32), "float32"), (f"{b}.b", (32,), "float32")]
        uses[b] = [f"{b}.w", f"{b}.b"]
    params += [("norm.weight", (32,), "float32"), ("head.weight", (64, 32), "float32")]
    uses[P.POST] = ["norm.weight", "head.weight"]
    order = [n for s in [P.PRE, *blocks, P.POST] for n in uses[s]]
    return ModelFacts(
        name="fixed",
        blocks=blocks,
        params=params,
        tied=[],
        segments=[P.PRE, *blocks, P.POST],
        order=order,
        uses=uses,
    )


def test_both_directions_share_the_link(monkeypatch):
    # Copies both ways at once move LINK_DUPLEX (1.45) times one direction's bytes, not 2x
    # (cost.LINK_DUPLEX: nvbandwidth on PCIe Gen4). A link-bound plan whose segments send
    # uploads one way while swap-outs (forward) or gradient offloads (backward) go the
    # other is slower than two independent lanes would make it, and faster than one lane.
    from protrain.planner.search import cost

    facts = _fixed_facts()
    prof = synthetic_profile(facts, gpu_spec(link_gbps=0.01), block_us=1, act_bytes=10**5)
    size, _ = choose_chunk_numel(facts_from_profile(prof))
    t = make_terms(prof, size)
    measured = cost.LINK_DUPLEX

    def time(duplex: float, persistent, n_buffer: int, policies) -> float:
        monkeypatch.setattr(cost, "LINK_DUPLEX", duplex)
        return cost.predict_plan(t, persistent, n_buffer, policies).time_us

    offloaded = ([], min_buffers(t, 0) + 1, ["swap", "keep", "swap", "keep"])
    one_lane, both, duplex = (time(d, *offloaded) for d in (1.0, measured, 2.0))
    assert one_lane > both > duplex
    # Every chunk persistent: swap-outs (D2H, forward) and swap-ins (H2D, backward) never
    # run at the same time, so the duplex factor changes nothing.
    persistent = (list(range(t.n_chunks)), 0, ["swap", "keep", "swap", "keep"])
    assert time(1.0, *persistent) == time(measured, *persistent) == time(2.0, *persistent)


@pytest.mark.parametrize("cpu_adam_rate", [1e6, 1e12])  # CPU Adam the bottleneck, or nearly free
def test_after_backward_prediction_is_the_formula(cpu_adam_rate):
    # A link so fast that every offloaded chunk's gradients land before backward ends, so
    # the after-backward schedule is exactly T_fwd + T_bwd + max(T_gpu_optim, T_cpu_optim).
    facts = _fixed_facts()
    prof = synthetic_profile(
        facts, gpu_spec(link_gbps=1e4, cpu_adam=cpu_adam_rate), block_us=100, act_bytes=10**6
    )
    size, _ = choose_chunk_numel(facts_from_profile(prof))
    during = make_terms(prof, size)
    after = make_terms(prof, size, cpu_adam="after_backward")
    assert after.n_chunks >= 3
    from protrain.planner.search.cost import predict

    nb = min_buffers(during, 1)
    d, a = predict(during, 1, nb, 1, 1), predict(after, 1, nb, 1, 1)
    b = a.breakdown
    formula = b["t_fwd_us"] + b["t_bwd_us"] + max(b["t_gpu_optim_us"], b["t_cpu_optim_us"])
    assert b["t_cpu_optim_us"] > 0 and a.time_us == pytest.approx(formula, rel=1e-12)
    # Forward, backward and memory are the same schedule; only the optimizer moves.
    for k in ("t_fwd_us", "t_bwd_us", "t_cpu_optim_us", "t_gpu_optim_us", "activation_walk_bytes"):
        assert b[k] == d.breakdown[k], k
    assert a.peak_bytes == d.peak_bytes
    if cpu_adam_rate == 1e6:  # overlapped with backward, the CPU steps hide part of their time
        assert a.time_us > d.time_us + 0.5 * b["t_bwd_us"]
    else:
        assert a.time_us >= d.time_us


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_facts(), st.integers(0, 2**31))
def test_after_backward_is_never_faster_than_during(facts, seed):
    # Each chunk's CPU step starts no earlier after backward than during it, on any
    # configuration of the space, any link and Adam rate (the last gradients may land
    # after backward ends: then the steps start from the landing).
    import numpy as np

    from protrain.planner.search.cost import evaluate, policy_grid

    rng = random.Random(seed)
    spec = gpu_spec(link_gbps=rng.choice([0.5, 24.0]), cpu_adam=rng.choice([2e6, 1e9]))
    if rng.random() < 0.3:
        spec = msgspec.structs.replace(spec, kind="cpu")
    prof = synthetic_profile(
        facts, spec, block_us=rng.uniform(10, 5000), act_bytes=rng.randint(10**3, 10**7), rng=rng
    )
    size = choose_chunk_numel(facts_from_profile(prof))[0]
    during, after = make_terms(prof, size), make_terms(prof, size, cpu_adam="after_backward")
    grid = policy_grid(during.n_blocks, policy_pairs(during))
    for n_persist, n_buffer in space(during):
        td, pd, parts_d = evaluate(during, n_persist, n_buffer, grid)
        ta, pa, parts_a = evaluate(after, n_persist, n_buffer, grid)
        assert np.all(ta >= td) and np.array_equal(pa, pd)
        # ... and it is the formula, from when backward ended or the last gradients landed.
        start = parts_a["t_cpu_optim_done_us"] - parts_a["t_cpu_optim_us"]
        if parts_a["t_cpu_optim_us"][0] > 0:
            assert np.all(start >= parts_a["t_bwd_us"] - 1e-6)
        assert np.allclose(
            ta,
            parts_a["t_fwd_us"]
            + np.maximum(
                parts_a["t_bwd_us"] + parts_a["t_gpu_optim_us"], parts_a["t_cpu_optim_done_us"]
            ),
        )


# ------------------------------------------------------------- swap-out in flight


def _peaky_profile(kind: str):
    """``_fixed_facts``'s profile with a large forward transient in block 1 only, so the
    forward step of block 1 is the walk's peak (on a GPU)."""
    facts = _fixed_facts()
    spec = gpu_spec()
    if kind == "cpu":
        spec = msgspec.structs.replace(spec, kind="cpu")
    prof = synthetic_profile(facts, spec, block_us=100, act_bytes=10**6)
    segs = [
        msgspec.structs.replace(
            s, bwd_peak_bytes=0, fwd_peak_bytes=10**8 if s.segment == facts.blocks[1] else 0
        )
        for s in prof.segments
    ]
    return facts, msgspec.structs.replace(prof, segments=segs)


def test_swap_out_in_flight_is_charged_on_a_gpu():
    # Block 0 is swapped: on a GPU its saved tensors stay on the device until their D2H
    # copy completes, which overlaps block 1's forward. The walk's peak (forward of block
    # 1) must count them; without the charge it would be short by block 0's saved bytes.
    from protrain.planner.search.cost import ALPHA_GPU, predict_plan

    facts, prof = _peaky_profile("gpu")
    size, _ = choose_chunk_numel(facts_from_profile(prof))
    t = make_terms(prof, size)
    policies = ["swap", "keep", "keep", "keep"]
    pred = predict_plan(
        t, list(range(t.n_chunks)), 0, policies
    )  # all persistent: no buffers, no grads
    seg = {s.segment: s for s in prof.segments}
    states = t.n_chunks * t.chunk_numel * t.state_bytes_per_elem
    expected = (
        states
        + seg[P.PRE].saved_bytes  # kept
        + seg["layers.0"].saved_bytes  # swapped, still on its way to the host
        + seg["layers.1"].saved_bytes  # kept
        + seg["layers.1"].fwd_peak_bytes
    ) * ALPHA_GPU  # block 1's transient
    assert pred.peak_bytes == pytest.approx(expected, rel=1e-12)
    # Keeping block 0 instead holds the same bytes at that step (and for longer).
    kept = predict_plan(t, list(range(t.n_chunks)), 0, ["keep"] * 4)
    assert kept.peak_bytes == pytest.approx(expected, rel=1e-12)


def test_swap_out_in_flight_terms():
    # Charged during the swapped block's own forward segment and the next one, on a GPU
    # only; never in backward (memory_plot's walk shows it as its own term).
    import numpy as np

    from protrain.planner.search.cost import memory_terms, strips_grid

    for kind in ("gpu", "cpu"):
        facts, prof = _peaky_profile(kind)
        size, _ = choose_chunk_numel(facts_from_profile(prof))
        t = make_terms(prof, size)
        off = np.zeros(t.n_chunks, dtype=np.int64)
        m = memory_terms(t, off, 0, strips_grid([["swap", "keep", "swap", "swap"]]))
        saved = [s.saved_bytes for s in prof.segments]  # <pre>, layers.0-3, <post>
        if kind == "gpu":
            want = [0, saved[1], saved[1], saved[3], saved[3] + saved[4], saved[4]]
        else:
            want = [0] * 6  # synchronous copies: gone when the segment ends
        assert m.swap_out[0].tolist() == want, kind


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_persistent_reductions_hide_under_backward(shard):
    # Under ZeRO-3 each persistent chunk's reduction starts when backward has ended the
    # first segment using it (engine.py [Note: overlapped reductions]). With long blocks
    # every reduction but the last chunk's (the embedding's: complete only when backward
    # ends) hides under the backward of the blocks before it; with blocks of ~no time
    # they all run after backward, one after another, as before the overlap.
    from protrain.planner.search.cost import predict_plan

    facts = _fixed_facts()
    for block_us, hidden in ((10**5, True), (1e-3, False)):
        prof = synthetic_profile(facts, gpu_spec(link_gbps=1.0), block_us=block_us, act_bytes=10**3)
        size, _ = choose_chunk_numel(facts_from_profile(prof))
        t = make_terms(prof, size, world_size=2, shard_persistent=shard)
        C = t.n_chunks
        assert C >= 3 and t.allreduce_us_per_chunk > 0
        b = predict_plan(t, list(range(C)), 0, ["keep"] * 4).breakdown
        reduce_us = t.allreduce_us_per_chunk / (2 if shard else 1)
        adam = int(t.chunk_params.sum()) * t.dev_adam_us_per_param + C * (
            t.allreduce_us_per_chunk - reduce_us
        )
        tail = reduce_us if hidden else C * reduce_us
        assert b["t_gpu_optim_us"] == pytest.approx(adam + tail, rel=1e-9, abs=1e-3), (block_us, b)


def test_device_homes_fill_what_homeless_chunks_leave():
    """cost.py [Device homes]: under a host cap that every offloaded chunk homeless still
    misses, the fewest first offloaded chunks are homed on the device: the host need then
    fits, the device carries their 12 B per element, their steps leave the CPU timeline for
    backward, and an explicit prediction of the same sets gives the same numbers."""
    from pathlib import Path

    from protrain.planner.profiling.profile import load_profile
    from protrain.planner.search import memory_walk
    from protrain.planner.search.cost import (
        choose_chunk_numel,
        evaluate,
        facts_from_profile,
        host_need,
        make_terms,
        policy_grid,
        predict_plan,
    )

    root = Path(__file__).resolve().parent.parent
    prof = load_profile(root / "plans/profiles/gpt2-xl/gpt2-xl-rtx3090-b8-s1024.json")
    size, _ = choose_chunk_numel(facts_from_profile(prof))
    t = make_terms(prof, size, world_size=4)
    assert t.homed_ok
    grid = policy_grid(t.n_blocks, [(0, t.n_blocks)])
    nb = 2
    _, peak0, free = evaluate(t, 0, nb, grid)
    all_homeless = (
        float(free["host_bytes"][0])
        - float(t.host_numel.sum()) * t.home_bytes_per_elem
        + t.slot_pool_bytes
    )
    cap = 0.6 * all_homeless
    time, peak, parts = evaluate(t, 0, nb, grid, host_cap=cap)
    kd = int(parts["n_device_homed"][0])
    assert 0 < kd < t.n_chunks and host_need(parts)[0] <= cap
    homed = list(range(kd))  # the first offloaded chunks (all chunks are offloaded here)
    homeless = (
        sorted(range(kd, t.n_chunks))[-int(parts["n_homeless"][0]) :]
        if parts["n_homeless"][0]
        else []
    )
    # device: 12 B per element of each homed chunk's shard and one fp32 scratch, times alpha
    extra = (
        sum(int(t.host_numel[c]) for c in homed) * memory_walk.HOMED_BYTES + t.homed_scratch_bytes
    )
    assert peak[0] == pytest.approx(peak0[0] + extra * (memory_walk.ALPHA_GPU if t.gpu else 1.0))
    assert parts["homed_peak_bytes"][0] == pytest.approx(peak[0] - peak0[0])
    # no CPU step for them; their device steps inside backward
    n_homed = int(t.chunk_params[:kd].sum())
    assert parts["t_cpu_optim_us"][0] == pytest.approx(
        free["t_cpu_optim_us"][0] - n_homed * t.cpu_adam_us_per_param
    )
    on_host = predict_plan(t, [], nb, ["checkpoint"] * t.n_blocks, homeless, [])
    assert (
        parts["t_cpu_optim_done_us"][0] < on_host.breakdown["t_cpu_optim_done_us"]
    )  # the tail went
    assert parts["t_bwd_us"][0] == pytest.approx(
        on_host.breakdown["t_bwd_us"]
        + n_homed * t.homed_adam_us_per_param
        + kd * t.allreduce_us_per_chunk / 2
    )  # and each reduce-scatter
    again = predict_plan(t, [], nb, ["checkpoint"] * t.n_blocks, homeless, homed)
    assert (again.time_us, again.peak_bytes) == (float(time[0]), float(peak[0]))
    assert again.breakdown["host_bytes"] == float(parts["host_bytes"][0])
