"""Configuration → plan: execution tracing, chunk layout rules and the schedule rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from protrain import plans
from protrain.planner.models.zoo import block_paths, build
from protrain.planner.profiling.graph import trace
from protrain.planner.search.emit import build_schedule, emit
from protrain.planner.search.layout import assign
from protrain.plans import plan as P
from protrain.plans import validation as V
from protrain.plans.errors import BudgetError, ConfigError, PlanError

ROOT = Path(__file__).resolve().parent.parent
TRAINING = P.Training(
    micro_batch=2,
    seq_len=16,
    compute_dtype="float32",
    master_dtype="float32",
    world_size=1,
    grad_accum=1,
)


def test_trace_sees_the_tied_head_after_the_blocks():
    model = build("gpt2-tiny", device="meta")
    g = trace(model, block_paths(model))
    assert g.uses[P.PRE] == ["transformer.wte.weight", "transformer.wpe.weight"]
    assert g.uses[P.POST] == [
        "transformer.ln_f.weight",
        "transformer.ln_f.bias",
        "transformer.wte.weight",
    ]
    assert g.order[:2] == ["transformer.wte.weight", "transformer.wpe.weight"]
    assert g.order[-2:] == ["transformer.ln_f.weight", "transformer.ln_f.bias"]
    assert g.graph.has_edge(("segment", P.POST), ("param", "transformer.wte.weight"))


def test_trace_llama_untied_head():
    model = build("llama-tiny", device="meta")
    g = trace(model, block_paths(model))
    assert g.uses[P.PRE] == ["model.embed_tokens.weight"]
    assert g.uses[P.POST] == ["model.norm.weight", "lm_head.weight"]
    assert all(n.startswith("model.layers.0.") for n in g.uses["model.layers.0"])


def test_layout_keeps_a_block_in_one_chunk_when_it_fits():
    from protrain.planner.search.layout import ALIGN_NUMEL as A

    order = ["a", "b1", "b2", "c"]
    numel = {"a": 6 * A, "b1": 3 * A, "b2": 3 * A, "c": 2 * A}
    groups = {"a": "pre", "b1": "blk", "b2": "blk", "c": "post"}
    chunks = assign(order, numel, groups, chunk_numel=10 * A)
    assert [[s.name for s in c] for c in chunks] == [["a"], ["b1", "b2", "c"]]
    # A group larger than a chunk is split rather than refused.
    chunks = assign(order, {**numel, "b1": 8 * A, "b2": 8 * A}, groups, chunk_numel=10 * A)
    assert [[s.name for s in c] for c in chunks] == [["a"], ["b1"], ["b2", "c"]]
    with pytest.raises(ConfigError, match=f"at least {10 * A + 1} elements"):
        assign(order, {**numel, "a": 10 * A + 1}, groups, chunk_numel=10 * A)


def test_layout_aligns_every_parameter():
    """Offsets are multiples of ALIGN_NUMEL: an unaligned parameter view makes BLAS sum in
    another order than on the parameter's own allocation (#15; see planner/search/layout.py)."""
    from protrain.planner.search.layout import ALIGN_NUMEL as A

    order = ["a", "b", "c", "d"]
    numel = {"a": 17, "b": 1, "c": 36, "d": 5}
    chunks = assign(order, numel, dict.fromkeys(order, "g"), chunk_numel=4 * A)
    assert [(s.name, s.offset) for c in chunks for s in c] == [
        ("a", 0),
        ("b", A),
        ("c", 2 * A),
        ("d", 0),
    ]
    assert len(chunks) == 2  # d (at 4A) would not fit the first chunk's 4A elements


def test_schedule_rules_on_a_chain():
    segs = [P.PRE, "b0", "b1", "b2", P.POST]
    need = {P.PRE: {0}, "b0": {1}, "b1": {2}, "b2": {3}, P.POST: {3, 0}}
    s = build_schedule(segs, need, offloaded={0, 1, 2, 3}, n_buffer=2, swapped=["b0"])
    fwd = {st.segment: st for st in s.forward}
    bwd = {st.segment: st for st in s.backward}
    assert fwd[P.PRE].fetch == [0] and fwd[P.PRE].prefetch == [1]  # one-segment lookahead
    assert fwd["b0"].fetch == [1]
    assert sorted(fwd[P.POST].fetch) == [0, 3]
    assert bwd["b0"].offload == [1] and bwd[P.PRE].offload == [0]  # at the last backward use
    assert bwd["b1"].swap_in == ["b0"]  # one segment ahead
    assert s.backward[-1].release and not any(
        c for st in s.backward for c in st.prefetch if c in st.fetch
    )
    with pytest.raises(BudgetError, match="n_buffer >= 2"):
        build_schedule(segs, need, offloaded={0, 1, 2, 3}, n_buffer=1, swapped=[])


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize(
    "n_persist,n_buffer,policy",
    [(99, 0, "keep"), (0, 1, "checkpoint"), (0, 2, "swap"), (1, 2, "keep")],
)
def test_emit_matrix_is_valid_and_deterministic(name, n_persist, n_buffer, policy):
    model = build(name, device="meta")
    blocks = block_paths(model)
    probe = emit(
        model,
        name=name,
        blocks=blocks,
        training=TRAINING,
        chunk_numel=65536,
        persistent=[],
        n_buffer=3,
        policies=["keep"] * len(blocks),
    )
    persistent = list(range(min(n_persist, len(probe.chunks.items))))
    kw = dict(
        name=name,
        blocks=blocks,
        training=TRAINING,
        chunk_numel=65536,
        persistent=persistent,
        n_buffer=n_buffer,
        policies=[policy] * len(blocks),
    )
    try:
        a = emit(model, **kw)
    except BudgetError:
        assert (name, n_buffer) == ("gpt2-tiny", 1)  # the tied head needs two chunks at once
        return
    assert P.dump(a) == P.dump(emit(build(name, device="meta"), **kw))
    residency = V.simulate_residency(a)
    assert max(len(r) for _, _, r in residency) <= a.placement.n_buffer


def test_example_plan_is_up_to_date():
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "protrain.planner.example_plan", "--check"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr


def _float_fields(t, path: str = "") -> set[str]:
    """Paths of the fields of msgspec type ``t`` that may hold a float."""
    import msgspec.inspect as mi

    if isinstance(t, mi.FloatType):
        return {path}
    if isinstance(t, mi.StructType):
        return {p for f in t.fields for p in _float_fields(f.type, f"{path}.{f.name}".lstrip("."))}
    if isinstance(t, mi.UnionType):
        return {p for x in t.types for p in _float_fields(x, path)}
    if isinstance(t, (mi.ListType, mi.TupleType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        inner = getattr(t, "item_type", None)
        items = [inner] if inner is not None else list(getattr(t, "item_types", ()))
        return {p for x in items for p in _float_fields(x, path + "[]")}
    if isinstance(t, mi.DictType):
        return _float_fields(t.key_type, path + "{}") | _float_fields(t.value_type, path + "{}")
    return set()


def test_round_trip_is_the_files_round_trip():
    """emit.round_trip (make_plan's check of what it made) decodes to what plans.load(P.dump())
    gives: the schema has one float, which it rounds as dump does (a new float field turns
    this red: round it there too)."""
    import msgspec

    from protrain.planner.search.emit import round_trip

    assert _float_fields(msgspec.inspect.type_info(P.Plan)) == {"request.max_grad_norm"}
    some = _committed_plans()[::8]
    assert len(some) > 5
    for p in some:
        for norm in (None, 1.0, 1 / 3, 2.5e-7):
            q = msgspec.structs.replace(
                p, request=msgspec.structs.replace(p.request, max_grad_norm=norm)
            )
            assert round_trip(q) == plans.load(P.dump(q))


def _committed_plans() -> list[P.Plan]:
    """Every plan under plans/, loaded once (the other JSON there, profiles and specs, is
    refused)."""
    out = []
    for path in sorted((ROOT / "plans").rglob("*.json")):
        try:
            out.append(plans.load(path))
        except PlanError:
            continue
    return out
