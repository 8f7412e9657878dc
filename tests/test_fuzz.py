"""Hostile inputs: plan and profile loaders only ever return a checked object or raise
their own error (``PlanError`` / ``ProfileError``) — never another exception, a
hang or a crash — whatever bytes they are given.

Mutations of a real file (truncation, byte flips, insertions, deletions, spliced
duplicates), type-confused JSON (any leaf or subtree replaced by a value of another
JSON type), deeply nested documents and files over the size caps. 6,000 plan,
4,000 profile and 1,000 checkpoint-manifest cases run derandomized, so CI runs the
same ones each time. ``tools/fuzz_loaders.py`` drives the same loaders with atheris
(coverage-guided) when it is installed.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from protrain import plans
from protrain.executor.checkpoint import Manifest, decode_manifest
from protrain.planner.profiling.profile import MAX_PROFILE_BYTES, Profile, load_profile
from protrain.plans import plan as P
from protrain.plans.errors import CheckpointError, PlanError, ProfileError

ROOT = Path(__file__).resolve().parents[1]
PLAN_BYTES = (ROOT / "plans/gpt2-tiny/example.json").read_bytes()
PROFILE_BYTES = sorted((ROOT / "plans/profiles/gpt2-xl").glob("*.json"))[0].read_bytes()
MANIFEST_BYTES = json.dumps(
    {
        "format": "protrain-checkpoint",
        "version": 1,
        "step": 3,
        "model_fingerprint": "sha256:" + "a" * 64,
        "world_size": 2,
        "compute_dtype": "bfloat16",
        "params": {"w": [4, 8], "b": [8]},
        "tied": [],
        "scaler": {"scale": 1.0, "good_steps": 0},
        "data": {"draws": 3},
        "files": {
            n: {"bytes": 10, "sha256": "b" * 64}
            for n in (
                "model.safetensors",
                "optim.safetensors",
                "rng-rank0.safetensors",
                "rng-rank1.safetensors",
            )
        },
    }
).encode()


def fuzz(n: int) -> settings:
    return settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )


json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=8),
)
json_value = st.recursive(
    json_leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=6), kids, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def byte_mutation(draw, base: bytes) -> bytes:
    n = len(base)
    kind = draw(st.sampled_from(["truncate", "flip", "insert", "delete", "splice"]))
    i = draw(st.integers(0, n))
    if kind == "truncate":
        return base[:i]
    if kind == "flip":
        i = min(i, n - 1)
        return base[:i] + bytes([draw(st.integers(0, 255))]) + base[i + 1 :]
    if kind == "insert":
        return base[:i] + draw(st.binary(min_size=1, max_size=16)) + base[i:]
    j = draw(st.integers(i, min(n, i + 64)))
    if kind == "delete":
        return base[:i] + base[j:]
    return base[:j] + base[i:j] + base[j:]  # splice: a duplicated slice


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


@functools.cache
def _all_paths(base: bytes) -> list[tuple]:
    return list(_paths(json.loads(base)))


@st.composite
def type_confusion(draw, base: bytes) -> bytes:
    doc = json.loads(base)
    paths = _all_paths(base)
    path = draw(st.sampled_from(paths[1:]))
    node = doc
    for key in path[:-1]:
        node = node[key]
    if draw(st.booleans()) or not isinstance(node, dict):
        node[path[-1]] = draw(json_value)
    else:
        del node[path[-1]]
        if draw(st.booleans()):
            node[draw(st.text(min_size=1, max_size=6))] = draw(json_value)
    return json.dumps(doc).encode()


@st.composite
def deep_nesting(draw, base: bytes) -> bytes:
    depth = draw(st.sampled_from([64, 1_000, 100_000]))
    open_, close = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
    nested = (open_ * depth + "1" + close * depth).encode()
    doc = json.loads(base)
    key = draw(st.sampled_from(sorted(doc)))
    return json.dumps({**doc, key: None}).encode().replace(b"null", nested, 1)


def hostile(base: bytes):
    return st.one_of(
        byte_mutation(base), type_confusion(base), deep_nesting(base), st.binary(max_size=64)
    )


def plan_loads_or_refuses(data: bytes) -> None:
    try:
        plan = plans.load(data)
    except PlanError:
        return
    # Accepted: it must then be a fully valid plan that round-trips canonically.
    assert plans.load(P.dump(plan)) == plan


def profile_loads_or_refuses(data: bytes) -> None:
    try:
        profile = load_profile(data)
    except ProfileError:
        return
    assert isinstance(profile, Profile)
    assert msgspec.json.decode(msgspec.json.encode(profile), type=Profile) == profile


# A quarter of the examples in the default run (the 10-minute budget), all of them in the slow run.
@fuzz(1_500)
@given(data=hostile(PLAN_BYTES))
def test_plan_load_only_raises_plan_error(data: bytes):
    plan_loads_or_refuses(data)


@pytest.mark.slow
@fuzz(6_000)
@given(data=hostile(PLAN_BYTES))
def test_plan_load_only_raises_plan_error_long(data: bytes):
    plan_loads_or_refuses(data)


@fuzz(1_000)
@given(data=hostile(PROFILE_BYTES))
def test_profile_load_only_raises_profile_error(data: bytes):
    profile_loads_or_refuses(data)


@pytest.mark.slow
@fuzz(4_000)
@given(data=hostile(PROFILE_BYTES))
def test_profile_load_only_raises_profile_error_long(data: bytes):
    profile_loads_or_refuses(data)


@fuzz(1_000)
@given(data=hostile(MANIFEST_BYTES))
def test_manifest_decode_only_raises_checkpoint_error(data: bytes):
    try:
        m = decode_manifest(data)
    except CheckpointError:
        return
    assert isinstance(m, Manifest) and "model.safetensors" in m.files


def test_the_fuzzers_bases_load():
    """The mutations start from files that load, so rejections are the mutations' doing."""
    plans.load(PLAN_BYTES)
    load_profile(PROFILE_BYTES)
    decode_manifest(MANIFEST_BYTES)


@pytest.mark.parametrize("which", ["plan", "profile"])
def test_oversized_files_are_refused_before_reading(tmp_path, which):
    path = tmp_path / f"big-{which}.json"
    with open(path, "wb") as f:  # sparse: no 64 MiB written to disk
        f.write(b'{"schema_version": 1, "pad": "')
        f.truncate(max(P.MAX_PLAN_BYTES, MAX_PROFILE_BYTES) + 2)
    loader, error = (plans.load, PlanError) if which == "plan" else (load_profile, ProfileError)
    with pytest.raises(error, match="larger than 64 MiB"):
        loader(path)


def test_plan_loading_never_executes_code(tmp_path):
    """A pickle (the classic code-execution payload) is refused as not-JSON."""
    import pickle

    payload = pickle.dumps({"schema_version": 1})
    with pytest.raises(PlanError):
        plans.load(payload)


# ------------------------------------------------------------------ issue 31: shapes validate
# accepts train can take

SIZES = st.one_of(
    st.integers(1, 64),
    st.integers(1, 2**70),
    st.sampled_from([2**k for k in (16, 20, 24, 31, 32, 40, 62)]),
)


@st.composite
def reshaped_plan(draw) -> P.Plan:
    """The example plan with random training shape, chunk size and buffer count (small and
    absurd)."""
    import msgspec.structs as ms

    plan = plans.load(PLAN_BYTES)
    fields = {
        f: draw(SIZES) if draw(st.booleans()) else getattr(plan.training, f)
        for f in ("micro_batch", "seq_len", "grad_accum", "world_size")
    }
    plan = ms.replace(plan, training=ms.replace(plan.training, **fields))
    if draw(st.booleans()):
        plan = ms.replace(plan, chunks=ms.replace(plan.chunks, chunk_numel=draw(SIZES)))
    if draw(st.booleans()):
        plan = ms.replace(plan, placement=ms.replace(plan.placement, n_buffer=draw(SIZES)))
    return plan


@fuzz(150)
@given(plan=reshaped_plan())
def test_what_validate_accepts_train_takes_or_refuses_cleanly(plan):
    # Whatever shape validate accepts, train's pre-checks (run before the model is built)
    # accept it within this machine's memory or refuse it with a ProtrainError: never
    # another exception, never an acceptance whose host need exceeds what is available.
    from protrain.planner.commands.preflight import available_host_memory
    from protrain.planner.commands.train import prechecks
    from protrain.plans.errors import ProtrainError
    from protrain.plans.validation import validate

    try:
        validate(plan, "fuzzed")
    except PlanError:
        return event("refused by validate")
    try:
        need = prechecks(plan, "gpt2-tiny", device="cpu", where="fuzzed")
    except ProtrainError as e:
        return event(f"refused by train's pre-checks: {type(e).__name__}")
    event("accepted")
    assert 0 < need <= available_host_memory()


@pytest.mark.slow
@fuzz(12)
@given(plan=reshaped_plan())
def test_what_the_pre_checks_accept_trains_or_refuses_cleanly(plan, tmp_path_factory):
    # The step after the pre-checks: a shape they accept (and small enough to run a step of
    # on a CPU) trains one step, or is refused with a ProtrainError (another world size: Comm).
    from protrain.planner.commands.train import prechecks, train
    from protrain.plans.errors import ProtrainError
    from protrain.plans.validation import validate

    t = plan.training
    try:
        validate(plan, "fuzzed")
        prechecks(plan, "gpt2-tiny", device="cpu", where="fuzzed")
    except ProtrainError:
        return
    if t.micro_batch * t.seq_len * t.grad_accum > 1 << 14:
        return event("accepted, too long to run here")
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_bytes(P.dump(plan))
    try:
        losses = train(
            str(path), "gpt2-tiny", steps=1, echo=lambda _: None, progress=False, device="cpu"
        )
    except ProtrainError as e:
        return event(f"refused by train: {type(e).__name__}")
    event("trained")
    assert len(losses) == 1
