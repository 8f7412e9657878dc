"""plans/accounting.py is the one memory model: the cost model's vectorised walk equals
its stream on random plans, and what `show` prints is what the plan predicted."""

from __future__ import annotations

import dataclasses
import glob
import random
import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planfactory import gpu_spec, random_facts, synthetic_profile

from protrain import plans
from protrain.planner.search import memory_walk
from protrain.planner.search.cost import (
    choose_chunk_numel,
    facts_from_profile,
    make_terms,
    min_buffers,
    predict_plan,
    segment_bytes,
)
from protrain.planner.search.emit import assemble
from protrain.plans import plan as P

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES: list[int] = []


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_facts(), st.integers(0, 2**31))
def test_cost_model_peak_is_the_accounting_peak(facts, seed):
    EXAMPLES.append(seed)
    # A random valid plan: device kind, dtype, world size, grad accumulation, chunk size,
    # any persistent set, any workable buffer count, any policy strip.
    rng = random.Random(seed)
    if rng.random() < 0.3:  # some parameters frozen (a LoRA base): their chunks keep values only
        facts = dataclasses.replace(
            facts, frozen=frozenset(n for n, _, _ in facts.params if rng.random() < 0.7)
        )
    spec = gpu_spec(link_gbps=rng.choice([2.0, 24.0]))
    if rng.random() < 0.4:
        spec = msgspec.structs.replace(spec, kind="cpu")
    dtype = rng.choice(["float32", "bfloat16"])
    prof = synthetic_profile(
        facts,
        spec,
        block_us=rng.uniform(10, 5000),
        act_bytes=rng.randint(10**3, 10**7),
        dtype=dtype,
        rng=rng,
    )
    world, accum = rng.choice([1, 1, 2, 3, 4]), rng.choice([1, 1, 2, 3])
    shard = world > 1 and rng.random() < 0.5  # persistent optimizer states sharded over the ranks
    size, _ = choose_chunk_numel(facts_from_profile(prof))
    size = rng.choice([size, size + rng.randint(1, size)])
    t = make_terms(prof, size, world, grad_accum=accum, shard_persistent=shard)
    persistent = sorted(rng.sample(range(t.n_chunks), rng.randint(0, t.n_chunks)))
    n_off = t.n_chunks - len(persistent)
    least = min_buffers(t, persistent)
    n_buffer = rng.randint(least, n_off + 1) if n_off else rng.randint(0, 2)
    strip = [rng.choice(["keep", "swap", "checkpoint"]) for _ in facts.blocks]
    training = P.Training(
        micro_batch=1,
        seq_len=1024,
        compute_dtype=dtype,
        master_dtype="float32",
        world_size=world,
        grad_accum=accum,
    )
    # Homeless chunks (placement.homeless) where the plan may have them: any offloaded subset.
    offloaded = [
        c
        for c in range(t.n_chunks)
        if c not in persistent and (t.trainable is None or t.trainable[c])
    ]
    homeless = (
        sorted(rng.sample(offloaded, rng.randint(0, len(offloaded)))) if t.homeless_ok else []
    )
    # Device-homed chunks (placement.device_homed), where the plan may have them: any of the rest.
    rest = [c for c in offloaded if c not in homeless]
    homed = (
        sorted(rng.sample(rest, rng.randint(0, len(rest))))
        if t.homed_ok and rng.random() < 0.5
        else []
    )
    # Chunks on disk (placement.nvme), any plan: any offloaded ones not device-homed.
    nvme = (
        sorted(rng.sample(offloaded, rng.randint(0, len(offloaded)))) if rng.random() < 0.3 else []
    )
    nvme = [c for c in nvme if c not in homed]
    cpu_adam = "during_backward" if (homeless or homed) else None
    plan = assemble(
        facts,
        training=training,
        chunk_numel=size,
        persistent=persistent,
        n_buffer=n_buffer,
        policies=strip,
        shard_persistent_states=shard,
        homeless=homeless,
        device_homed=homed,
        cpu_adam=cpu_adam,
        nvme=nvme,
    )

    walk = memory_walk.walk(plan, segment_bytes(prof))
    pred = predict_plan(t, persistent, n_buffer, strip, homeless, homed, nvme)
    b = pred.breakdown
    assert walk.peak_bytes == pred.peak_bytes
    assert (walk.states_bytes, walk.buffers_bytes, walk.activation_walk_bytes) == (
        b["states_bytes"],
        b["buffers_bytes"],
        b["activation_walk_bytes"],
    )
    assert (walk.host_bytes, walk.host_swap_bytes) == (b["host_bytes"], b["host_swap_bytes"])


@pytest.mark.parametrize("world", [1, 4])
def test_a_frozen_chunk_has_no_gradients_moments_or_master(world):
    plan = next(p for p in _library() if p.training.world_size == world and p.placement.persistent)
    assert plan.placement.shard_persistent_states == (world > 1)  # the planner shards when it can
    everything = memory_walk.walk(plan)
    frozen = memory_walk.walk(
        plan, trainable=[c.id != plan.placement.persistent[0] for c in plan.chunks.items]
    )
    eb = memory_walk.element_bytes(plan.training.compute_dtype, plan.training.grad_accum)
    numel = -(-plan.chunks.chunk_numel // world) * world
    # gradients (whole on every rank), and this rank's shard of the moments and master
    assert everything.states_bytes - frozen.states_bytes == numel * eb.compute + numel // world * (
        eb.persistent - 2 * eb.compute
    )


def test_element_bytes():
    # fp32: values + gradients + moments on the device; the chunk is its own master.
    assert memory_walk.element_bytes("float32") == memory_walk.ElementBytes(
        compute=4, persistent=16, host=16
    )
    # fp32 with accumulation: a staging buffer, because later micro-batches cannot land in place.
    assert memory_walk.element_bytes("float32", grad_accum=2).host == 20
    # bf16: gradients land in the home (optim.py [Note: gradients land in home]): 14 B ...
    assert memory_walk.element_bytes("bfloat16") == memory_walk.ElementBytes(
        compute=2, persistent=16, host=14
    )
    # ... unless accumulating: an fp32 accumulator and a bf16 staging buffer.
    assert memory_walk.element_bytes("bfloat16", grad_accum=3).host == 20


def _library() -> list[P.Plan]:
    return [
        plans.load(f)
        for f in sorted(glob.glob(str(ROOT / "plans" / "*" / "*.json")))
        if "/profiles/" not in f and "/hardware/" not in f and "/schema/" not in f
    ]


def test_show_prints_the_predictions_figures_for_every_library_plan():
    from protrain.planner.hardware.units import human_bytes
    from protrain.planner.views.show import render_show

    plans = _library()
    assert len(plans) >= 20
    for plan in plans:
        text = render_show(plan)
        walk = memory_walk.walk(plan)
        shown = {
            "states_bytes": walk.states_bytes,
            "buffers_bytes": walk.buffers_bytes,
            "host_bytes": walk.host_bytes,
        }
        for key, value in shown.items():
            line = next(ln for ln in text.splitlines() if ln.split()[:1] == [key])
            assert line.split(None, 1)[1] == human_bytes(value), (key, line)
        b = plan.prediction.breakdown
        if b:  # a plan the search made: its prediction holds the same figures
            assert shown == {k: b[k] for k in shown}, plan.model.name


def test_cost_search_and_milp_do_not_import_torch():
    import subprocess

    code = (
        "import sys; import protrain.planner.search.cost, protrain.planner.search.exhaustive, "
        "protrain.planner.search.milp, protrain.plans.accounting; sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_property_ran_on_500_plans():
    assert len(EXAMPLES) >= 500 or not EXAMPLES  # (not run in this session: nothing to count)


def test_the_closed_form_equals_the_simulator_on_every_committed_plan():
    """The search predicts with a closed form (``cost.evaluate``); the memory walk replays the
    schedule's events (``validation.replay`` under ``accounting.state_events``). On every
    committed plan, with the profile it was made from (``provenance.profile_digest``), the
    walk's peak and parts are the figures the plan's prediction holds."""
    from protrain.planner.profiling.profile import load_profile
    from protrain.planner.search.cost import segment_bytes
    from protrain.planner.search.planning import profile_digest

    profiles = {}
    for f in sorted(glob.glob(str(ROOT / "plans" / "profiles" / "*" / "*.json"))):
        prof = load_profile(f)
        profiles[profile_digest(prof)] = prof
    checked = 0
    for plan in _library():
        prof = profiles.get(plan.provenance.profile_digest)
        if prof is None or not plan.prediction.breakdown:
            continue  # (the example plan: made by hand, no profile)
        walk = memory_walk.walk(plan, segment_bytes(prof))
        b = plan.prediction.breakdown
        assert round(walk.peak_bytes) == plan.prediction.peak_memory_bytes, plan.model.name
        assert (walk.states_bytes, walk.buffers_bytes, walk.host_bytes) == (
            b["states_bytes"],
            b["buffers_bytes"],
            b["host_bytes"],
        ), plan.model.name
        checked += 1
    assert checked >= 90, checked
