"""The plan file format: canonical bytes, round trips, strict loading with JSON-path errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planfactory import random_plans

from protrain import plans
from protrain.plans import migrate as M
from protrain.plans import plan as P
from protrain.plans.errors import PlanError

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "plans" / "gpt2-tiny" / "example.json"
FIXTURES = sorted((ROOT / "tests" / "fixtures" / "plans").glob("v*/*.json"))
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- round trips


@SETTINGS
@given(random_plans())
def test_random_plans_round_trip(plan):
    data = P.dump(plan)
    assert plans.load(data) == plan
    assert P.dump(plans.load(data)) == data


COMMITTED = sorted((ROOT / "plans").glob("*/*.json"))
COMMITTED = [p for p in COMMITTED if p.parent.name not in ("schema", "hardware")]


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_plans_round_trip_byte_for_byte(path):
    data = path.read_bytes()
    assert P.dump(plans.load(data)) == data


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: str(p.relative_to(ROOT)))
def test_frozen_fixtures_load(path):
    # Frozen files are never edited; they must load (after migration). Their bytes may
    # differ from a fresh dump once informational fields with defaults are added.
    plan = plans.load(path)
    assert plan.schema_version == P.SCHEMA_VERSION


def test_frozen_fixture_exists_for_every_supported_version():
    versions = {int(p.parent.name[1:]) for p in FIXTURES}
    assert versions >= set(range(P.MIN_SCHEMA_VERSION, P.SCHEMA_VERSION + 1))


def test_canonical_layout():
    text = EXAMPLE.read_text()
    lines = text.splitlines()
    assert lines[0] == "{" and lines[1] == f'  "schema_version": {P.SCHEMA_VERSION},'
    assert text.endswith("}\n") and not text.endswith("\n\n")
    # Two-space indent everywhere, no tabs.
    assert all((len(x) - len(x.lstrip(" "))) % 2 == 0 and "\t" not in x for x in lines)
    # One parameter per line, and one step per line.
    plan = plans.load(EXAMPLE)
    n_params = sum(len(c.params) for c in plan.chunks.items)
    assert sum('"offset":' in x for x in lines) == n_params
    assert sum('"segment":' in x for x in lines) == 2 * (len(plan.model.blocks) + 2)
    # Sections appear in the Struct definition order.
    keys = [k for k in json.loads(text)]
    assert keys == list(P.Plan.__struct_fields__)


def test_dump_is_deterministic_and_has_no_float_noise():
    plan = plans.load(EXAMPLE)
    noisy = P.Plan(
        **{f: getattr(plan, f) for f in P.Plan.__struct_fields__ if f != "prediction"},
        prediction=P.Prediction(iter_time_us=12, breakdown={"b_bytes": 3, "a_us": 1}),
    )
    assert P.dump(noisy) == P.dump(noisy)
    text = P.dump(noisy).decode()
    assert text.index('"a_us"') < text.index('"b_bytes"')  # dict keys sorted


# ------------------------------------------------------------------------- corruptions


def _doc() -> dict:
    return json.loads(EXAMPLE.read_bytes())


def _load_err(doc_or_bytes) -> str:
    data = doc_or_bytes if isinstance(doc_or_bytes, bytes) else json.dumps(doc_or_bytes).encode()
    with pytest.raises(PlanError) as e:
        plans.load(data)
    return str(e.value)


def test_deleted_field_names_it():
    doc = _doc()
    del doc["chunks"]["list"][1]["params"][0]["numel"]
    msg = _load_err(doc)
    assert "numel" in msg and "$.chunks.list[1].params[0]" in msg and "HINT:" in msg


def test_wrong_type_names_the_path():
    doc = _doc()
    doc["chunks"]["list"][0]["params"][1]["numel"] = "8192"
    assert "$.chunks.list[0].params[1].numel" in _load_err(doc)


def test_bool_is_not_an_int():
    doc = _doc()
    doc["placement"]["n_buffer"] = True
    assert "$.placement.n_buffer" in _load_err(doc)


def test_unknown_binding_field_is_refused_but_unknown_info_field_is_not():
    doc = _doc()
    doc["placement"]["n_swap"] = 3
    assert "n_swap" in _load_err(doc)
    doc = _doc()
    doc["prediction"]["new_diagnostic_us"] = 5
    plans.load(json.dumps(doc).encode())


def test_overlapping_offsets():
    doc = _doc()
    doc["chunks"]["list"][1]["params"][2]["offset"] -= 1
    msg = _load_err(doc)
    assert "overlaps" in msg and "$.chunks.list[1].params[" in msg


def test_offset_past_chunk_end():
    doc = _doc()
    doc["chunks"]["list"][1]["params"][-1]["offset"] = doc["chunks"]["chunk_numel"]
    assert "exceed the chunk size" in _load_err(doc)


def test_unknown_chunk_id_in_schedule():
    doc = _doc()
    doc["schedule"]["forward"][1]["prefetch"] = [99]
    msg = _load_err(doc)
    assert "$.schedule.forward[1].prefetch[0]" in msg and "99" in msg


def test_unknown_home_in_placement():
    doc = _doc()
    doc["placement"]["homes"][1] = "attic"
    msg = _load_err(doc)
    assert "$.placement.homes[1]" in msg and "persistent" in msg  # msgspec lists the valid names


def test_parameter_in_two_chunks():
    doc = _doc()
    dup = dict(
        doc["chunks"]["list"][0]["params"][1],
        offset=doc["chunks"]["list"][2]["params"][-1]["offset"] + 100,
    )
    doc["chunks"]["list"][2]["params"].append(dup)
    assert "also in chunk 0" in _load_err(doc)


def test_placement_names_one_home_per_chunk():
    doc = _doc()
    doc["placement"]["homes"] = doc["placement"]["homes"][:-1]
    msg = _load_err(doc)
    assert "$.placement.homes" in msg and "one per chunk" in msg
    doc = _doc()
    doc["placement"]["homes"].append("host")
    assert "one per chunk" in _load_err(doc)
    doc = _doc()
    doc["placement"]["n_persist"] = 2
    assert "$.placement.n_persist" in _load_err(doc)


def test_one_policy_per_block():
    doc = _doc()
    doc["activations"] = doc["activations"][:1]
    assert "$.activations[1]" in _load_err(doc)
    doc = _doc()
    doc["activations"][0]["policy"] = "offload"
    assert "$.activations[0].policy" in _load_err(doc)


def test_schedule_exceeding_buffer_count():
    doc = _doc()
    doc["placement"]["n_buffer"] = 1
    msg = _load_err(doc)
    assert "n_buffer is 1" in msg and "$.schedule.forward" in msg


def test_segment_must_fetch_what_it_uses():
    doc = _doc()
    doc["schedule"]["forward"][1]["fetch"] = []
    assert "must be fetched" in _load_err(doc)


def test_edited_parameter_list_breaks_the_fingerprint():
    doc = _doc()
    doc["chunks"]["list"][0]["params"][0]["shape"] = [128, 128]
    doc["chunks"]["list"][0]["params"][0]["numel"] = 128 * 128
    doc["model"]["n_params"] += 128 * 128 - 256 * 64
    assert "$.model.fingerprint" in _load_err(doc)


@pytest.mark.parametrize(
    "version,word", [(P.SCHEMA_VERSION + 1, "newer"), (0, "older"), (-3, "older")]
)
def test_version_window(version, word):
    doc = _doc()
    doc["schema_version"] = version
    msg = _load_err(doc)
    assert word in msg and f"{P.MIN_SCHEMA_VERSION}–{P.SCHEMA_VERSION}" in msg and "HINT:" in msg


def test_truncated_non_utf8_and_not_json():
    data = EXAMPLE.read_bytes()
    assert "truncated" in _load_err(data[: len(data) // 2]).lower()
    assert "UTF-8" in _load_err(data[:20] + b"\xff\xfe" + data[20:])
    assert "schema_version" in _load_err(b"[1, 2, 3]")
    assert "schema_version" in _load_err(b'{"chunks": []}')


def test_missing_file_names_it(tmp_path):
    with pytest.raises(PlanError, match="nope.json"):
        plans.load(tmp_path / "nope.json")


@SETTINGS
@given(random_plans(), st.data())
def test_random_corruptions_never_escape_as_raw_errors(plan, data):
    """Any single corruption gives PlanError (or, if still valid, a plan equal to a reload)."""
    doc = json.loads(P.dump(plan))
    path = []
    node = doc
    # Walk to a random leaf and replace it with a value of a random other kind.
    while isinstance(node, (dict, list)) and node:
        key = data.draw(
            st.sampled_from(list(node.keys()) if isinstance(node, dict) else range(len(node)))
        )
        path.append(key)
        if not isinstance(node[key], (dict, list)) or not node[key]:
            break
        node = node[key]
    replacement = data.draw(st.sampled_from([None, "x", -1, 10**6, 1.5, [], {}, True]))
    if path:
        node[path[-1]] = replacement
    try:
        loaded = plans.load(json.dumps(doc).encode())
    except PlanError as e:
        assert "$" in str(e) or "schema" in str(e)
        return
    assert plans.load(P.dump(loaded)) == loaded


# --------------------------------------------------------------------------- migration


def test_migration_hook_applies_steps_in_order(monkeypatch):
    calls = []

    def v1_to_v2(d):
        calls.append(d["schema_version"])
        d = dict(d)
        d["renamed"] = d.pop("old")
        return d

    monkeypatch.setitem(M.MIGRATIONS, 1, v1_to_v2)
    out = M.migrate({"schema_version": 1, "old": 5}, 1, target=2)
    assert out == {"schema_version": 2, "renamed": 5} and calls == [1]


def test_missing_migration_is_a_plan_error():
    last = max(M.MIGRATIONS) + 1
    with pytest.raises(PlanError, match=f"no migration from plan schema {last} to {last + 1}"):
        M.migrate({"schema_version": last}, last, target=last + 1)


V1 = ROOT / "tests" / "fixtures" / "plans" / "v1" / "gpt2-tiny-example.json"


def test_v1_fixture_migrates_to_cpu_adam_during_backward():
    # The frozen v1 file is float32 and the v1 executor overlapped CPU steps with
    # backward unless clipping was configured: the migration writes that down.
    plan = plans.load(V1)
    assert plan.schema_version == P.SCHEMA_VERSION and plan.schedule.cpu_adam == "during_backward"
    assert plan.request.max_grad_norm is None


def test_v1_to_v2_is_pure_and_fills_fp16_as_after_backward():
    doc = json.loads(V1.read_bytes())
    doc["training"]["compute_dtype"] = "float16"
    before = json.dumps(doc)
    out = M.v1_to_v2(doc)
    assert json.dumps(doc) == before  # the input is not touched
    assert out["schedule"]["cpu_adam"] == "after_backward"
    assert plans.load(json.dumps(doc).encode()).schedule.cpu_adam == "after_backward"
    # The rest of the file is carried over as it was.
    assert {k: v for k, v in out["schedule"].items() if k != "cpu_adam"} == doc["schedule"]


def test_v1_file_with_a_v2_field_is_refused():
    doc = json.loads(V1.read_bytes())
    doc["schedule"]["cpu_adam"] = "after_backward"
    msg = _load_err(doc)
    assert "$.schedule.cpu_adam" in msg and "schema 1" in msg
    assert msg.startswith("<plan bytes>: ")  # the migration's error names the file like every other


def test_v1_malformed_schedule_fails_in_the_strict_decode():
    doc = json.loads(V1.read_bytes())
    doc["schedule"] = [1, 2]
    assert "$.schedule" in _load_err(doc)
    doc = json.loads(V1.read_bytes())
    del doc["training"]
    assert "training" in _load_err(doc)


V2 = ROOT / "tests" / "fixtures" / "plans" / "v2" / "gpt2-tiny-clip.json"


def test_v2_fixture_migrates_to_replicated_persistent_states():
    # The v2 executor replicated persistent chunks' masters and moments on every rank.
    plan = plans.load(V2)
    assert (
        plan.schema_version == P.SCHEMA_VERSION and plan.placement.shard_persistent_states is False
    )
    assert plans.load(V1).placement.shard_persistent_states is False  # v1 → v2 → v3


def test_v2_to_v3_is_pure_and_keeps_the_rest():
    doc = json.loads(V2.read_bytes())
    doc["training"]["world_size"] = 4  # a v2 plan for 4 ranks ran replicated too
    before = json.dumps(doc)
    out = M.v2_to_v3(doc)
    assert json.dumps(doc) == before  # the input is not touched
    assert out["placement"] == {**doc["placement"], "shard_persistent_states": False}
    assert {k: v for k, v in out.items() if k != "placement"} == {
        k: v for k, v in doc.items() if k != "placement"
    }


def test_v2_file_with_a_v3_field_is_refused():
    doc = json.loads(V2.read_bytes())
    doc["placement"]["shard_persistent_states"] = True
    msg = _load_err(doc)
    assert "$.placement.shard_persistent_states" in msg and "schema 2" in msg
    doc["placement"] = "persistent"  # malformed: left to the strict decode
    assert "$.placement" in _load_err(doc)


def test_sharded_persistent_states_need_several_ranks():
    doc = _doc()
    assert (
        doc["training"]["world_size"] == 1 and doc["placement"]["shard_persistent_states"] is False
    )
    doc["placement"]["shard_persistent_states"] = True
    msg = _load_err(doc)
    assert "$.placement.shard_persistent_states" in msg and "one rank" in msg
    del doc["placement"]["shard_persistent_states"]
    assert "shard_persistent_states" in _load_err(doc)  # required: a plan says which
    doc["placement"]["shard_persistent_states"] = True
    doc["training"]["world_size"] = 2
    assert plans.load(json.dumps(doc).encode()).placement.shard_persistent_states


def test_cpu_adam_is_required_and_closed():
    doc = _doc()
    del doc["schedule"]["cpu_adam"]
    assert "cpu_adam" in _load_err(doc) and "$.schedule" in _load_err(doc)
    doc = _doc()
    doc["schedule"]["cpu_adam"] = "whenever"
    assert "$.schedule.cpu_adam" in _load_err(doc)


def test_fp16_plan_must_step_cpu_adam_after_backward():
    doc = _doc()
    doc["training"]["compute_dtype"] = "float16"
    msg = _load_err(doc)
    assert "$.schedule.cpu_adam" in msg and "float16" in msg
    doc["schedule"]["cpu_adam"] = "after_backward"
    assert plans.load(json.dumps(doc).encode()).schedule.cpu_adam == "after_backward"


def test_prefetch_released_before_any_fetch():
    # <pre> prefetches chunk 1 for h.0 and h.0 prefetches chunk 2 for h.1; release 2 at
    # the end of h.0 instead: its upload may still be writing the freed buffer.
    doc = _doc()
    doc["schedule"]["forward"][1]["release"] = [2]
    msg = _load_err(doc)
    assert "$.schedule.forward[1].prefetch[0]" in msg and "never fetched" in msg
    assert "$.schedule.forward[1].release[0]" in msg


def test_prefetch_never_fetched_before_backward_ends():
    doc = _doc()
    doc["schedule"]["backward"][2]["prefetch"] = [2]  # h.0's backward; nothing fetches 2 later
    msg = _load_err(doc)
    assert "$.schedule.backward[2].prefetch[0]" in msg and "backward ends" in msg


def test_prefetch_fetched_later_across_forward_and_backward_is_fine():
    # A prefetch in forward's last step, fetched two steps into backward, is fine.
    doc = _doc()
    fwd, bwd = doc["schedule"]["forward"], doc["schedule"]["backward"]
    fwd[2]["release"], fwd[3]["prefetch"] = (
        [1],
        [1],
    )  # drop chunk 1 after h.1, bring it back at <post>
    assert bwd[2]["segment"] == "transformer.h.0" and bwd[2]["fetch"] == [1]
    plan = plans.load(json.dumps(doc).encode())
    assert plan.schedule.forward[3].prefetch == [1]


V3 = ROOT / "tests" / "fixtures" / "plans" / "v3" / "gpt2-tiny-w2-sharded.json"
V4 = ROOT / "tests" / "fixtures" / "plans" / "v4" / "gpt2-tiny-homeless.json"


def test_v3_to_v4_keeps_every_home():
    # The v3 executor kept every offloaded chunk's home: no homeless chunk, no slots.
    for old in (V1, V2, V3):
        placement = plans.load(old).placement
        assert placement.homeless == [] and placement.n_host_slots == 0
    doc = json.loads(V3.read_bytes())
    before = json.dumps(doc)
    out = M.v3_to_v4(doc)
    assert json.dumps(doc) == before  # pure
    assert out["placement"] == {**doc["placement"], "homeless": [], "n_host_slots": 0}
    doc["placement"]["homeless"] = [1]
    msg = _load_err(doc)
    assert "$.placement.homeless" in msg and "schema 3" in msg


def test_homeless_chunks_are_validated():
    plan = plans.load(V4)
    assert plan.placement.homeless == [1, 2] and plan.placement.n_host_slots == 2
    doc = json.loads(V4.read_bytes())
    for key, value, words in (
        ("homeless", [2, 1], "ascending"),
        ("homeless", [0], "offloaded"),
        ("n_host_slots", 0, "at least 1"),
    ):
        bad = json.loads(json.dumps(doc))
        bad["placement"][key] = value
        msg = _load_err(bad)
        assert f"$.placement.{key}" in msg and words in msg, msg
    bad = json.loads(json.dumps(doc))
    bad["placement"]["homeless"] = []
    assert "at least 1" in _load_err(bad)  # slots without homeless chunks


V6 = ROOT / "tests" / "fixtures" / "plans" / "v6" / "gpt2-tiny-nvme.json"


def test_v6_to_v7_names_one_home_per_chunk():
    # The five id lists of schema 6 become one home per chunk; a chunk both homeless and on
    # disk is nvme_homeless. The migration is pure and every other field is untouched.
    doc = json.loads(V6.read_bytes())
    before = json.dumps(doc)
    out = M.v6_to_v7(doc)
    assert json.dumps(doc) == before  # pure
    assert out["placement"] == {
        "n_persist": 1,
        "n_buffer": 3,
        "homes": ["persistent", "host", "nvme", "nvme", "nvme", "nvme_homeless"],
        "shard_persistent_states": False,
        "n_host_slots": 1,
    }
    assert {k: v for k, v in out.items() if k != "placement"} == {
        k: v for k, v in doc.items() if k != "placement"
    }
    plan = plans.load(V6)  # and the lists read back from the homes
    assert (plan.placement.persistent, plan.placement.offloaded) == ([0], [1, 2, 3, 4, 5])
    assert (plan.placement.homeless, plan.placement.nvme, plan.placement.device_homed) == (
        [5],
        [2, 3, 4, 5],
        [],
    )
    for old in (V1, V2, V3):  # older files: every offloaded chunk at home on the host
        homes = plans.load(old).placement.homes
        assert set(homes) <= {"persistent", "host"} and "host" in homes


@pytest.mark.parametrize(
    "key,value,words",
    [
        ("offloaded", [1, 2, 3, 4], "neither persistent nor offloaded"),
        ("offloaded", [0, 1, 2, 3, 4, 5], "both persistent and offloaded"),
        ("persistent", [9], "chunk ids (0..5)"),
        ("nvme", [3, 2], "ascending"),
        ("homeless", [0], "not offloaded"),
        ("device_homed", [5], "also in `homeless`"),
        ("device_homed", [2], "also in `nvme`"),
        ("nvme", "all", "must list chunk ids"),
    ],
)
def test_v6_lists_that_name_no_home_are_refused(key, value, words):
    doc = json.loads(V6.read_bytes())
    doc["placement"][key] = value
    msg = _load_err(doc)
    assert f"$.placement.{key}" in msg and words in msg and "schema 6" in msg, msg


def test_v6_file_with_homes_is_refused():
    doc = json.loads(V6.read_bytes())
    doc["placement"]["homes"] = ["host"] * 6
    msg = _load_err(doc)
    assert "$.placement.homes" in msg and "schema 6" in msg


@pytest.mark.parametrize(
    "home,dtype,words",
    [
        ("homeless", "float32", "16-bit compute"),
        ("nvme_homeless", "float32", "16-bit compute"),
    ],
)
def test_homes_preconditions_come_from_the_table(home, dtype, words):
    # validate() asks plans/homes.py whether each chunk's home allows the plan's setup.
    doc = json.loads(P.dump(plans.load(V6)))
    doc["training"]["compute_dtype"] = dtype
    doc["placement"]["homes"][5] = home
    msg = _load_err(doc)
    assert "$.placement.homes[" in msg and words in msg, msg
