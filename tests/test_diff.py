"""``protrain diff``: the semantic difference of two plans (planner/views/show.py).

Plans come from the real emitter on meta models (``harness.make_plan``) and from
the search on a synthetic gpt2-xl profile (for predictions); targeted edits use
``msgspec.structs.replace``, which skips validation, so a test can change one fact
and check that exactly that fact is reported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness import make_plan
from msgspec.structs import replace
from planfactory import gpu_spec, synthetic_profile

from protrain import plans
from protrain.planner.views.diff import diff_json, render_diff
from protrain.plans import plan as P

ROOT = Path(__file__).resolve().parent.parent
KEYS = [
    "equal",
    "differs",
    "schema_version",
    "model",
    "training",
    "request",
    "hardware",
    "chunks",
    "placement",
    "activations",
    "schedule",
    "prediction",
    "informational",
]


def gpt2_4(persistent=(0,), n_buffer=2, policies=("keep",) * 4) -> P.Plan:
    return make_plan(
        "gpt2-4", persistent=list(persistent), n_buffer=n_buffer, policies=list(policies)
    )


def strips(text: str) -> tuple[str, str, str]:
    """The A, B and marker lines of the (unwrapped) policy strips, indentation kept."""
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.lstrip().startswith("A  "))
    return lines[i], lines[i + 1], lines[i + 2]


@pytest.fixture(scope="module")
def xl_plans() -> dict[str, P.Plan]:
    """gpt2-xl (48 blocks) planned by the search at two budgets and on a slower link."""
    from protrain.planner.models.zoo import block_paths, build
    from protrain.planner.search.emit import model_facts
    from protrain.planner.search.planning import make_plan as plan_from_profile

    model = build("gpt2-xl", device="meta")
    facts = model_facts(model, "gpt2-xl", block_paths(model), 8)
    fast = synthetic_profile(facts, gpu_spec(), block_us=2000, act_bytes=300 << 20)
    slow = synthetic_profile(facts, gpu_spec(link_gbps=6), block_us=2000, act_bytes=300 << 20)
    return {
        "24g": plan_from_profile(fast, 24 << 30)[0],
        "12g": plan_from_profile(fast, 12 << 30)[0],
        "12g-slow-link": plan_from_profile(slow, 12 << 30)[0],
    }


# ----------------------------------------------------------------------- equal


def test_identical_plans_are_equal():
    a = gpt2_4()
    b = plans.load(P.dump(a))  # a fresh copy through the file format
    text, equal = render_diff(a, b, "a.json", "b.json")
    assert equal
    assert "plans are equal (same decisions and predictions)" in text
    assert "a.json" in text and "b.json" in text
    assert "informational" not in text
    d = diff_json(a, b)
    assert d["equal"] and d["differs"] == []


def test_generator_and_provenance_are_informational():
    # See [Note: when `protrain diff` calls two plans equal]: who wrote a plan and how
    # the search found it do not make two plans different, but they are reported.
    a = gpt2_4()
    b = replace(
        a,
        generator=P.Generator(version="9.9.9"),
        provenance=P.Provenance(
            profile_digest="sha256:" + "ab" * 32, search=P.Search(solver="other", evaluated=7)
        ),
    )
    text, equal = render_diff(a, b, "a", "b")
    assert equal
    assert "plans are equal" in text
    assert "informational (does not affect equality)" in text
    assert "generator.version 0.1.0 → 9.9.9" in text
    assert "provenance.search.solver" in text and "→ other" in text
    d = diff_json(a, b)
    assert d["informational"]["generator"] == {"version": {"a": "0.1.0", "b": "9.9.9"}}


# --------------------------------------------------------------------- chunks


def test_a_moved_parameter_is_named():
    a = gpt2_4()
    # Move the last parameter of the last chunk to the end of the chunk's free space.
    last = a.chunks.items[-1]
    p = last.params[-1]
    new_offset = a.chunks.chunk_numel - p.numel
    assert new_offset > p.offset, "the last chunk must have free space for this edit"
    chunk = replace(last, params=[*last.params[:-1], replace(p, offset=new_offset)])
    b = replace(a, chunks=replace(a.chunks, items=[*a.chunks.items[:-1], chunk]))

    text, equal = render_diff(a, b, "a", "b")
    assert not equal
    assert "plans differ in: chunks" in text
    assert "1 parameter moved (chunk @ element offset)" in text
    assert f"{p.name}  {last.id} @ {p.offset} → {last.id} @ {new_offset}" in text
    others = [q.name for c in a.chunks.items for q in c.params if q.name != p.name]
    assert not any(f"  {n}  " in text for n in others)
    d = diff_json(a, b)
    assert d["differs"] == ["chunks"]
    assert d["chunks"]["moved"] == [
        {
            "name": p.name,
            "a": {"chunk": last.id, "offset": p.offset},
            "b": {"chunk": last.id, "offset": new_offset},
        }
    ]


def test_many_moved_parameters_are_cut_at_ten():
    a = gpt2_4(persistent=())
    b = make_plan("gpt2-4", persistent=[], n_buffer=2, policies="keep", chunk_numel=131072)
    text, _ = render_diff(a, b, "a", "b")
    d = diff_json(a, b)
    n = len(d["chunks"]["moved"])
    assert n > 10
    na, nb = len(a.chunks.items), len(b.chunks.items)
    assert nb < na
    assert f"chunk_numel 65.54k → 131.07k elements; {na} → {nb} chunks" in text
    assert f"{n} parameters moved" in text
    assert f"… and {n - 10} more" in text
    assert "(chunk ids name each plan's own chunks)" in text


# ----------------------------------------------------------------- activations


def test_a_changed_policy_is_marked_under_its_block():
    a = gpt2_4(policies=["keep", "keep", "keep", "keep"])
    b = gpt2_4(policies=["keep", "keep", "checkpoint", "keep"])
    text, equal = render_diff(a, b, "a", "b")
    assert not equal
    assert "1 of 4 blocks differ" in text
    row_a, row_b, marks = strips(text)
    assert row_a.endswith("A  K K K K") and row_b.endswith("B  K K C K")
    assert marks.count("^") == 1
    assert marks.index("^") == row_b.index("C") == row_a.rindex("K") - 2
    d = diff_json(a, b)
    assert d["activations"]["changed"] == [
        {"index": 2, "block": "transformer.h.2", "a": "keep", "b": "checkpoint"}
    ]
    assert d["differs"] == ["activations"]  # checkpoint changes no schedule event


def test_a_swapped_block_changes_the_schedule_too():
    a = gpt2_4(persistent=())
    b = gpt2_4(persistent=(), policies=["swap", "keep", "keep", "keep"])
    text, _ = render_diff(a, b, "a", "b")
    d = diff_json(a, b)
    assert d["differs"] == ["activations", "schedule"]
    change = [c for c in d["schedule"]["changes"] if c["field"] == "swap_in"]
    assert change == [
        {
            "phase": "backward",
            "segment": change[0]["segment"],
            "field": "swap_in",
            "a": [],
            "b": ["transformer.h.0"],
        }
    ]
    assert f"of {d['schedule']['n_steps']['a']} steps differ" in text
    assert "swap_in  [] → ['transformer.h.0']" in text


def test_long_strips_wrap_at_forty_blocks(xl_plans):
    a = xl_plans["24g"]
    acts = list(a.activations)
    acts[45] = replace(acts[45], policy="swap" if acts[45].policy != "swap" else "keep")
    b = replace(a, activations=acts)
    text, _ = render_diff(a, b, "a", "b")
    lines = text.splitlines()
    assert any(line.strip() == "blocks 0-39" for line in lines)
    i = next(i for i, line in enumerate(lines) if line.strip() == "blocks 40-47")
    row_a, row_b, marks = lines[i + 1], lines[i + 2], lines[i + 3]
    assert len(row_a.split()) == 1 + 8
    # Block 45 is the sixth of the second group: letter column = "A  " + 5 letters of 2 chars.
    col = row_a.index("A  ") + 3 + 2 * 5
    assert marks.index("^") == col and marks.count("^") == 1
    assert row_a[col] != row_b[col]
    # The first group has no differences, hence no marker line.
    j = next(i for i, line in enumerate(lines) if line.strip() == "blocks 0-39")
    assert lines[j + 3].strip() == "blocks 40-47"


# ---------------------------------------------------------------- hardware


def test_hardware_and_request_changes_are_shown():
    base = gpt2_4()
    a = replace(
        base,
        hardware=P.Hardware(
            name="rtx3090",
            device_memory_bytes=24 << 30,
            budget_bytes=20 << 30,
            h2d_bytes_per_s=12 * 10**9,
        ),
        request=P.Request(model="gpt2-4", hardware="rtx3090", budget_bytes=20 << 30),
    )
    b = replace(
        base,
        hardware=P.Hardware(
            name="a100-80g",
            device_memory_bytes=80 << 30,
            budget_bytes=70 << 30,
            h2d_bytes_per_s=24 * 10**9,
        ),
        request=P.Request(model="gpt2-4", hardware="a100-80g", budget_bytes=70 << 30),
    )
    text, equal = render_diff(a, b, "a", "b")
    assert not equal
    lines = text.splitlines()
    i = lines.index("  hardware      name rtx3090 → a100-80g")  # one changed field per line
    assert lines[i + 1 : i + 4] == [
        " " * 16 + "device_memory_bytes 24.00 GiB → 80.00 GiB",
        " " * 16 + "budget_bytes 20.00 GiB → 70.00 GiB",
        " " * 16 + "h2d_bytes_per_s 12.0 GB/s → 24.0 GB/s",
    ]
    assert "  request       hardware rtx3090 → a100-80g" in lines
    d = diff_json(a, b)
    assert d["differs"] == ["request", "hardware"]
    assert list(d["hardware"]) == ["name", "device_memory_bytes", "budget_bytes", "h2d_bytes_per_s"]


# --------------------------------------------------------------- placement


def test_placement_change_names_n_persist_and_the_chunks_that_moved():
    a = gpt2_4(persistent=(0, 1, 2), n_buffer=2)
    b = gpt2_4(persistent=(0,), n_buffer=3)
    text, _ = render_diff(a, b, "a", "b")
    assert "n_persist 3 → 1; n_buffer 2 → 3" in text
    assert "persistent → offloaded: chunks 1-2" in text
    assert "offloaded → persistent" not in text
    back, _ = render_diff(b, a, "b", "a")
    assert "offloaded → persistent: chunks 1-2" in back
    d = diff_json(a, b)
    assert d["placement"] == {
        "n_persist": {"a": 3, "b": 1},
        "n_buffer": {"a": 2, "b": 3},
        "shard_persistent_states": {"a": False, "b": False},
        "to_offloaded": [1, 2],
        "to_persistent": [],
    }
    assert "placement" in d["differs"] and "schedule" in d["differs"]


def test_sharding_persistent_states_is_a_placement_change():
    a = gpt2_4()
    b = replace(
        a,
        training=replace(a.training, world_size=2),
        placement=replace(a.placement, shard_persistent_states=True),
    )
    text, _ = render_diff(a, b, "a", "b")
    assert "persistent optimizer states replicated → sharded" in text
    assert diff_json(a, b)["placement"]["shard_persistent_states"] == {"a": False, "b": True}
    assert "placement" in diff_json(a, b)["differs"]


# ------------------------------------------------------------------ models


def test_different_models_are_said_so():
    a = gpt2_4()
    b = make_plan("llama-4", persistent=[0], n_buffer=2, policies="keep")
    text, equal = render_diff(a, b, "gpt.json", "llama.json")
    assert not equal
    assert "!! DIFFERENT MODELS: A is gpt2-4" in text
    assert "B is llama-4" in text
    d = diff_json(a, b)
    assert not d["model"]["same_model"]
    assert "model" in d["differs"]
    assert d["chunks"]["added"] and d["chunks"]["removed"]
    # Steps are matched by segment: gpt2's and llama's blocks share no segment name.
    sched = d["schedule"]
    assert sched["n_matched"] == 2 * (2 + 4 + 4)
    assert (
        f"{sched['steps_differ']} of {sched['n_matched']} steps differ   (A has 12, B has 12"
        in text
    )
    assert "parameters added (only in B)" in text and "parameters removed (only in A)" in text


# -------------------------------------------------------------- prediction


def test_prediction_ratios_and_speed(xl_plans):
    a, b = xl_plans["12g"], xl_plans["24g"]  # more memory: B should be faster
    ta, tb = a.prediction.iter_time_us, b.prediction.iter_time_us
    assert 0 < tb < ta
    text, equal = render_diff(a, b, "12g.json", "24g.json")
    assert not equal
    assert (
        f"iteration {ta / 1e6:.3f} s → {tb / 1e6:.3f} s "
        f"(B/A = {tb / ta:.2f}×, B is {ta / tb:.2f}× faster)"
    ) in text
    pa, pb = a.prediction.peak_memory_bytes, b.prediction.peak_memory_bytes
    assert f"(B/A = {pb / pa:.2f}×)" in text
    tokens = 1 * 1024 * 1 * 1  # micro_batch × seq_len × grad_accum × world_size of the profile
    assert f"tokens/s {round(tokens * 1e6 / ta):,} → {round(tokens * 1e6 / tb):,}" in text
    d = diff_json(a, b)
    assert d["prediction"]["speedup"] == round(ta / tb, 4)
    assert d["prediction"]["time_ratio"] == round(tb / ta, 4)
    assert "placement" in d["differs"] and "prediction" in d["differs"]
    # The other way round B is slower.
    back, _ = render_diff(b, a, "24g.json", "12g.json")
    assert f"B is {ta / tb:.2f}× slower" in back


def test_a_slower_link_is_a_hardware_and_prediction_change(xl_plans):
    a, b = xl_plans["12g"], xl_plans["12g-slow-link"]
    text, _ = render_diff(a, b, "a", "b")
    d = diff_json(a, b)
    assert "hardware" in d["differs"] and "prediction" in d["differs"]
    assert "h2d_bytes_per_s 24.0 GB/s → 6.0 GB/s" in text
    assert "× slower" in text


def test_no_prediction_is_said_so():
    text, _ = render_diff(gpt2_4(), gpt2_4(n_buffer=3), "a", "b")
    assert "neither plan has one" in text


# --------------------------------------------------------------------- json


def test_diff_json_is_deterministic_and_serialisable(xl_plans):
    pairs = [
        (gpt2_4(), gpt2_4()),
        (gpt2_4(), gpt2_4(persistent=(0, 1), n_buffer=3)),
        (xl_plans["24g"], xl_plans["12g"]),
    ]
    shapes = []
    for a, b in pairs:
        d = diff_json(a, b)
        assert list(d) == KEYS
        text = json.dumps(d)
        assert json.loads(text) == d
        assert json.dumps(diff_json(a, b)) == text
        assert d["equal"] == (d["differs"] == [])
        assert d["equal"] == render_diff(a, b, "a", "b")[1]
        # Every section has the same keys whatever differs (changed-field dicts aside).
        shapes.append(
            {
                k: list(d[k])
                for k in (
                    "model",
                    "chunks",
                    "placement",
                    "activations",
                    "schedule",
                    "prediction",
                    "informational",
                )
            }
        )
    assert shapes[0] == shapes[1] == shapes[2]


# ------------------------------------------------------------------ imports


def test_diff_never_imports_torch():
    example = ROOT / "plans" / "gpt2-tiny" / "example.json"
    code = (
        "import sys\n"
        "from protrain.plans import load\n"
        "from protrain.planner.views.diff import diff_json, render_diff\n"
        f"a = load({str(example)!r}); b = load({str(example)!r})\n"
        "text, equal = render_diff(a, b, 'a', 'b'); assert equal, text\n"
        "assert diff_json(a, b)['equal']\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
