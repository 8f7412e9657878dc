"""Traces and the memory walk: the format validates, the predicted trace follows the cost
model, the measured trace covers every segment of a real CPU run, and the walk's peak
is the plan's predicted peak."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from harness import MICRO_BATCH, SEQ_LEN, make_model
from harness import make_plan as make_fixed_plan

from protrain.executor import AdamWConfig, wrap
from protrain.planner.hardware.spec import find_spec
from protrain.planner.models.data import batches, load_tokens
from protrain.planner.models.zoo import block_paths, build
from protrain.planner.profiling.analytic import analytic_profile
from protrain.planner.search.cost import (
    choose_chunk_numel,
    facts_from_profile,
    make_terms,
    min_buffers,
    predict,
)
from protrain.planner.search.planning import make_plan
from protrain.planner.views.memory_plot import memory_timeline, plot_memory
from protrain.planner.views.trace import (
    TRACKS,
    merge_traces,
    predicted_trace,
    record_trace,
    validate_trace,
    write_trace,
)
from protrain.plans import plan as P
from protrain.plans.errors import ConfigError


@pytest.fixture(scope="module")
def profiles():
    """Analytic profiles of gpt2 (124M) on a GPU spec and on the CPU spec (~1 s each)."""
    out = {}
    for hw, dtype in (("rtx3090", "bfloat16"), ("cpu", "float32")):
        model = build("gpt2", device="meta")
        out[hw] = analytic_profile(
            model,
            name="gpt2",
            blocks=block_paths(model),
            micro_batch=8,
            seq_len=1024,
            compute_dtype=dtype,
            spec=find_spec(hw),
        )
    return out


def plans_between(
    profile, world_size: int, fractions=(0.0, 0.1, 0.3, 0.6, 0.9), max_grad_norm=None
):
    """Plans for budgets spread between the smallest and the all-persistent peak, so the
    set covers everything-offloaded-and-checkpointed through mostly-persistent plans
    (with ``max_grad_norm``: plans whose CPU Adam steps run after backward)."""
    size, _ = choose_chunk_numel(facts_from_profile(profile))
    t = make_terms(profile, size, world_size)
    lo = predict(t, 0, max(1, min_buffers(t, 0)), 0, t.n_blocks).peak_bytes
    hi = predict(t, t.n_chunks, 0, 0, 0).peak_bytes
    return [
        make_plan(
            profile, int(lo + f * (hi - lo)) + 1, world_size=world_size, max_grad_norm=max_grad_norm
        )[0]
        for f in fractions
    ]


def x_events(doc, tid=None):
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and (tid is None or e["tid"] == tid)]


# --------------------------------------------------------------------------- format


def test_validate_trace_names_the_bad_field():
    good = {
        "traceEvents": [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "compute"}},
            {
                "name": "forward <pre>",
                "cat": "compute",
                "ph": "X",
                "ts": 0.0,
                "dur": 5,
                "pid": 1,
                "tid": 1,
            },
        ],
        "displayTimeUnit": "ms",
    }
    validate_trace(good)
    cases = [  # (mutation of the X event, words the message must contain)
        (lambda e: e.pop("ts"), "lacks `ts`"),
        (lambda e: e.update(dur=-1), "dur must be >= 0"),
        (lambda e: e.update(ts="0"), "ts must be a finite number"),
        (lambda e: e.update(name=3), "name must be a string"),
        (lambda e: e.update(tid=None), "tid must be"),
        (lambda e: e.update(ph="B"), "unsupported phase"),
    ]
    for mutate, words in cases:
        doc = copy.deepcopy(good)
        mutate(doc["traceEvents"][1])
        with pytest.raises(ValueError, match=words) as info:
            validate_trace(doc)
        assert "$.traceEvents[1]" in str(info.value)
    doc = copy.deepcopy(good)
    del doc["traceEvents"][0]["args"]
    with pytest.raises(ValueError, match="lacks `args`"):
        validate_trace(doc)
    with pytest.raises(ValueError, match="traceEvents"):
        validate_trace({"events": []})


# ------------------------------------------------------------------ predicted trace


# The trace replays the plan's own transfers with the executor's dependencies; the
# cost model counts an upper bound of the transfers and closes each segment at the
# max of its lanes (swap-outs and offloads included). So the trace is never longer
# than the prediction beyond rounding (0.5%: profile times are whole µs) and, over
# these plans, at most 10% shorter (seen: 0.93-1.00 on GPU, 0.996-1.00 on CPU).
TOLERANCE = {"gpu": (0.90, 1.005), "cpu": (0.98, 1.005)}


@pytest.mark.parametrize(
    "hw,world_size,clip",
    [
        ("rtx3090", 1, None),
        ("rtx3090", 2, None),
        ("cpu", 1, None),
        ("rtx3090", 1, 1.0),
        ("cpu", 1, 1.0),
    ],
)
def test_predicted_trace_follows_the_cost_model(profiles, hw, world_size, clip):
    profile = profiles[hw]
    low, high = TOLERANCE[profile.hardware.kind]
    for plan in plans_between(profile, world_size, max_grad_norm=clip):
        assert plan.schedule.cpu_adam == ("after_backward" if clip else "during_backward")
        if clip and plan.placement.offloaded:
            # Clipping needs every gradient first: no CPU step starts before backward ends.
            doc = predicted_trace(profile, plan)
            bwd = next(e for e in x_events(doc, TRACKS["iteration"]) if e["name"] == "backward")
            assert (
                min(e["ts"] for e in x_events(doc, TRACKS["CPU Adam"]))
                >= bwd["ts"] + bwd["dur"] - 1e-2
            )  # µs rounding
        doc = predicted_trace(profile, plan)
        validate_trace(doc)
        # Tracks: named by metadata, collectives only with several ranks.
        names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
        assert names == {"iteration", "compute", "H2D", "D2H", "CPU Adam"} | (
            {"collectives"} if world_size > 1 else set()
        )
        # Every segment computes forward and backward once; checkpointed blocks recompute.
        compute = [e["name"] for e in x_events(doc, TRACKS["compute"])]
        for seg in P.segments(plan):
            assert compute.count(f"forward {seg}") == 1 and compute.count(f"backward {seg}") == 1
        policies = [a.policy for a in plan.activations]
        assert sum(n.startswith("recompute ") for n in compute) == policies.count("checkpoint")
        d2h = [e["name"] for e in x_events(doc, TRACKS["D2H"])]
        h2d = [e["name"] for e in x_events(doc, TRACKS["H2D"])]
        assert sum(n.startswith("swap_out ") for n in d2h) == policies.count("swap")
        assert sum(n.startswith("swap_in ") for n in h2d) == policies.count("swap")
        # Each offloaded chunk: one gradient offload and one CPU Adam step per iteration.
        n_off = len(plan.placement.offloaded)
        assert sum(n.startswith("offload ") for n in d2h) == n_off
        assert len(x_events(doc, TRACKS["CPU Adam"])) == n_off
        n_up = sum(
            len(s.fetch) + len(s.prefetch) for s in plan.schedule.forward + plan.schedule.backward
        )
        assert sum(n.startswith(("fetch ", "prefetch ")) for n in h2d) <= n_up
        if world_size > 1 and n_off:
            assert x_events(doc, TRACKS["collectives"])
        # Total against the cost model's prediction.
        ratio = doc["metadata"]["trace_iter_time_us"] / plan.prediction.iter_time_us
        assert low <= ratio <= high, (plan.placement, policies, ratio)
        phases = x_events(doc, TRACKS["iteration"])
        assert [e["name"] for e in phases] == ["forward", "backward", "optimizer"]
        assert phases[-1]["ts"] + phases[-1]["dur"] == pytest.approx(
            doc["metadata"]["trace_iter_time_us"]
        )


def test_predicted_trace_refuses_a_profile_of_another_model(profiles):
    plan = plans_between(profiles["rtx3090"], 1, (0.5,))[0]
    meta = build("gpt2-tiny", device="meta")
    other = analytic_profile(
        meta,
        name="gpt2-tiny",
        blocks=block_paths(meta),
        micro_batch=1,
        seq_len=16,
        compute_dtype="bfloat16",
        spec=find_spec("rtx3090"),
    )
    with pytest.raises(ConfigError, match="fingerprints differ"):
        predicted_trace(other, plan)


# ------------------------------------------------------------------- memory walk


@pytest.mark.parametrize("hw", ["rtx3090", "cpu"])
def test_memory_timeline_peak_is_the_predicted_peak(profiles, hw):
    profile = profiles[hw]
    for plan in plans_between(profile, 1):
        steps = memory_timeline(profile, plan)
        segs = P.segments(plan)
        assert [label for label, _ in steps] == (
            [f"forward {s}" for s in segs] + [f"backward {s}" for s in reversed(segs)]
        )
        assert (
            max(b for _, b in steps) == plan.prediction.peak_memory_bytes
        )  # the same walk, to the byte
        assert all(b > 0 for _, b in steps)


def test_plot_memory_writes_a_png(profiles, tmp_path):
    pytest.importorskip("matplotlib")
    profile = profiles["rtx3090"]
    plan = plans_between(profile, 1, (0.3,))[0]
    out = tmp_path / "mem.png"
    plot_memory(profile, plan, out)
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 10_000


def test_plot_memory_without_matplotlib_names_the_extra(profiles, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib → ImportError
    profile = profiles["rtx3090"]
    plan = plans_between(profile, 1, (0.3,))[0]
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[plot\]'"):
        plot_memory(profile, plan, tmp_path / "mem.png")


# ------------------------------------------------------------------- measured trace


def test_measured_trace_of_a_cpu_run(tmp_path):
    # One persistent chunk, two offloaded ones, block 0 swapped and block 1 checkpointed:
    # every kind of event the executor has shows up.
    plan = make_fixed_plan("gpt2-tiny", persistent=[0], n_buffer=2, policies="swap checkpoint")
    steps = 3
    losses = {}
    docs = {}
    for traced in (False, True):
        engine = wrap(make_model("gpt2-tiny"), plan, AdamWConfig(), device="cpu")
        data = batches(load_tokens(), MICRO_BATCH, SEQ_LEN, 0)
        torch.manual_seed(1234)  # the same dropout masks in both runs
        if traced:
            with record_trace(engine) as rec:
                losses[traced] = [engine.step(next(data)).loss for _ in range(steps)]
            docs = rec.to_dict()
            # The recorder listened through Engine.on_event only, and has stopped listening.
            assert engine.events.listeners == ()
        else:
            losses[traced] = [engine.step(next(data)).loss for _ in range(steps)]
        engine.close()
    assert losses[True] == losses[False]  # recording does not change what is computed

    doc = docs
    validate_trace(doc)
    compute = x_events(doc, TRACKS["compute"])
    for step in range(steps):
        names = [e["name"] for e in compute if e["args"]["step"] == step]
        for seg in P.segments(plan):
            assert names.count(f"forward {seg}") == 1, (step, seg)
            assert names.count(f"backward {seg}") == 1, (step, seg)
    h2d = [e["name"] for e in x_events(doc, TRACKS["H2D"])]
    d2h = [e["name"] for e in x_events(doc, TRACKS["D2H"])]
    n_off = len(plan.placement.offloaded)
    assert any(n.startswith(("fetch c", "prefetch c")) for n in h2d)
    assert h2d.count("swap_in transformer.h.0") == steps
    assert d2h.count("swap_out transformer.h.0") == steps  # one span per block and step
    assert sum(n.startswith("offload c") for n in d2h) == steps * n_off
    assert len(x_events(doc, TRACKS["CPU Adam"])) == steps * n_off
    iteration = [e["name"] for e in x_events(doc, TRACKS["iteration"])]
    for name in ("forward", "backward", "optimizer"):
        assert iteration.count(name) == steps
    # Spans on one track of the main thread do not overlap (compute is one stream).
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in compute)
    assert all(a_end <= b_start + 1e-3 for (_, a_end), (b_start, _) in zip(spans, spans[1:]))

    # max_steps keeps the first steps only (CPU Adam spans count for the step that submitted them).
    engine = wrap(make_model("gpt2-tiny"), plan, AdamWConfig(), device="cpu")
    data = batches(load_tokens(), MICRO_BATCH, SEQ_LEN, 0)
    with record_trace(engine, max_steps=1) as rec:
        for _ in range(2):
            engine.step(next(data))
    first = rec.to_dict()
    engine.close()
    assert {e["args"]["step"] for e in x_events(first)} == {0}
    assert len(x_events(first, TRACKS["CPU Adam"])) == n_off

    # Side by side with the prediction for the same plan, in one file.
    meta = build("gpt2-tiny", device="meta")
    profile = analytic_profile(
        meta,
        name="gpt2-tiny",
        blocks=block_paths(meta),
        micro_batch=MICRO_BATCH,
        seq_len=SEQ_LEN,
        compute_dtype="float32",
        spec=find_spec("cpu"),
    )
    both = merge_traces(predicted_trace(profile, plan), doc)
    write_trace(both, tmp_path / "both.json")
    assert {e["pid"] for e in both["traceEvents"]} == {1, 2}


def test_predicted_trace_of_device_homed_chunks(profiles):
    """A host budget below what the plan without it needs: the planner homes chunks on the
    device (cost.py [Device homes]); the trace reduces and steps each on the device at its
    offload (no download, no CPU step) and agrees with the prediction."""
    profile = profiles["rtx3090"]
    size, _ = choose_chunk_numel(facts_from_profile(profile))
    t = make_terms(profile, size, 2)
    budget = int(0.95 * predict(t, t.n_chunks, 0, 0, t.n_blocks).peak_bytes)  # not all persistent
    free, _ = make_plan(profile, budget, world_size=2)
    cap = int(0.8 * free.prediction.breakdown["host_bytes"])
    plan, _ = make_plan(profile, budget, world_size=2, host_budget_bytes=cap)
    homed = plan.placement.device_homed
    # (seen: chunk 0 persistent, 1 and 2 device-homed, 3 homeless)
    assert homed and plan.placement.homeless and plan.prediction.breakdown["host_bytes"] <= cap
    doc = predicted_trace(profile, plan)
    validate_trace(doc)
    compute = [e["name"] for e in x_events(doc, TRACKS["compute"])]
    assert all(compute.count(f"adam (device) c{c}") == 1 for c in homed)
    d2h = [e["name"] for e in x_events(doc, TRACKS["D2H"])]
    assert not any(n == f"offload c{c}" for n in d2h for c in homed)
    assert not any(e["args"].get("chunk") in homed for e in x_events(doc, TRACKS["CPU Adam"]))
    low, high = TOLERANCE["gpu"]
    assert low <= doc["metadata"]["trace_iter_time_us"] / plan.prediction.iter_time_us <= high
