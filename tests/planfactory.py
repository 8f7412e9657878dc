"""Synthetic plans for tests: random model shapes and configurations, no torch model needed.

``random_facts`` makes a decoder-like model description (embedding before the
blocks, a few parameters per block, a head after them, optionally tied to the
embedding); ``assemble`` (the planner's own emitter) turns it into a plan. Used by
the schema property tests; planner tests use it for cost-model inputs.
"""

from __future__ import annotations

from hypothesis import strategies as st

from protrain.planner.search.emit import ModelFacts, assemble
from protrain.plans import plan as P


@st.composite
def random_facts(draw) -> ModelFacts:
    n_blocks = draw(st.integers(1, 6))
    blocks = [f"layers.{i}" for i in range(n_blocks)]
    params: list[tuple[str, tuple[int, ...], str]] = [
        ("embed.weight", (draw(st.integers(4, 64)), 8), "float32")
    ]
    uses = {P.PRE: ["embed.weight"]}
    for b in blocks:
        names = []
        for j in range(draw(st.integers(1, 4))):
            shape = tuple(draw(st.lists(st.integers(1, 24), min_size=1, max_size=2)))
            params.append((f"{b}.p{j}", shape, "float32"))
            names.append(f"{b}.p{j}")
        uses[b] = names
    tied = draw(st.booleans())
    params.append(("norm.weight", (8,), "float32"))
    uses[P.POST] = ["norm.weight"]
    if tied:
        uses[P.POST].append("embed.weight")
    else:
        params.append(("head.weight", (draw(st.integers(4, 64)), 8), "float32"))
        uses[P.POST].append("head.weight")
    order = [n for s in [P.PRE, *blocks, P.POST] for n in uses[s]]
    order = list(dict.fromkeys(order))
    return ModelFacts(
        name="synthetic",
        blocks=blocks,
        params=params,
        tied=[["embed.weight", "head.weight"]] if tied else [],
        segments=[P.PRE, *blocks, P.POST],
        order=order,
        uses=uses,
    )


@st.composite
def random_plans(draw) -> P.Plan:
    facts = draw(random_facts())
    biggest = max(_numel(s) for _, s, _ in facts.params)
    chunk_numel = draw(st.integers(biggest, biggest * 4))
    # Lay out once without persistence to learn the chunk count, then choose a placement.
    probe = assemble(
        facts,
        training=_training(),
        chunk_numel=chunk_numel,
        persistent=[],
        n_buffer=len(facts.params),
        policies=["keep"] * len(facts.blocks),
    )
    n_chunks = len(probe.chunks.items)
    persistent = draw(st.lists(st.integers(0, n_chunks - 1), unique=True))
    policies = draw(
        st.lists(
            st.sampled_from(["keep", "swap", "checkpoint"]),
            min_size=len(facts.blocks),
            max_size=len(facts.blocks),
        )
    )
    # The largest number of chunks one segment uses bounds the buffer count from below.
    need = max(
        len({c.id for c in probe.chunks.items for p in c.params if p.name in set(u)})
        for u in facts.uses.values()
    )
    n_buffer = draw(st.integers(max(1, need), max(1, need) + 2))
    return assemble(
        facts,
        training=_training(),
        chunk_numel=chunk_numel,
        persistent=persistent,
        n_buffer=n_buffer,
        policies=policies,
    )


def _training() -> P.Training:
    return P.Training(
        micro_batch=2,
        seq_len=16,
        compute_dtype="float32",
        master_dtype="float32",
        world_size=1,
        grad_accum=1,
    )


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ------------------------------------------------------------------ synthetic profiles

from protrain.planner.hardware.spec import HardwareSpec, LinkPoint  # noqa: E402
from protrain.planner.profiling.profile import (  # noqa: E402
    PROFILE_VERSION,
    ParamInfo,
    Profile,
    ProfileModel,
    ProfileTraining,
    SegmentProfile,
)


def gpu_spec(
    *, link_gbps: float = 24.0, mem_gib: float = 24.0, cpu_adam: float = 1e9, dev_adam: float = 5e10
) -> HardwareSpec:
    """An RTX-3090-like card; numbers round, for tests only."""
    bw = int(link_gbps * 1e9)
    return HardwareSpec(
        name="test-gpu",
        kind="gpu",
        device_name="test",
        device_memory_bytes=int(mem_gib * 2**30),
        usable_memory_bytes=int(mem_gib * 2**30),
        host_memory_bytes=2**38,
        cpu_cores=32,
        matmul_flops_per_s=10**14,
        matmul_fp32_flops_per_s=3 * 10**13,
        mem_bytes_per_s=9 * 10**11,
        link=[
            LinkPoint(size_bytes=2**20, h2d_bytes_per_s=bw // 2, d2h_bytes_per_s=bw // 2),
            LinkPoint(size_bytes=2**28, h2d_bytes_per_s=bw, d2h_bytes_per_s=bw),
        ],
        cpu_adam_params_per_s=int(cpu_adam),
        dev_adam_params_per_s=int(dev_adam),
        source="datasheet",
    )


def synthetic_profile(
    facts: ModelFacts,
    spec: HardwareSpec,
    *,
    block_us: float,
    act_bytes: int,
    micro_batch: int = 1,
    seq_len: int = 1024,
    dtype: str = "bfloat16",
    rng=None,
) -> Profile:
    """A profile of ``facts`` with block times and activations as given (jittered by ``rng``)."""
    import random

    rng = rng or random.Random(0)
    segs = []
    for s in facts.segments:
        j = 1.0 + 0.2 * rng.random()
        is_block = s in facts.blocks
        fwd = block_us * j if is_block else block_us * 0.2 * j
        act = int(act_bytes * j) if is_block else int(act_bytes * 0.3 * j)
        segs.append(
            SegmentProfile(
                segment=s,
                fwd_us=round(fwd),
                bwd_us=round(2 * fwd),
                saved_bytes=act,
                saved_tensor_bytes=int(act * 1.1),
                input_bytes=act // 8,
                fwd_peak_bytes=act // 4,
                bwd_peak_bytes=act // 3,
            )
        )
    params = [
        ParamInfo(
            name=n,
            shape=list(sh),
            dtype=d,
            uses=[s for s in facts.segments if n in facts.uses[s]],
            frozen=n in facts.frozen,
        )
        for n, sh, d in sorted(facts.params, key=lambda p: facts.order.index(p[0]))
    ]
    from protrain.plans.plan import fingerprint

    return Profile(
        profile_version=PROFILE_VERSION,
        source="analytic",
        model=ProfileModel(
            name=facts.name,
            fingerprint=fingerprint(facts.params, facts.blocks),
            n_params=sum(_numel(s) for _, s, _ in facts.params),
            blocks=list(facts.blocks),
            tied=[list(t) for t in facts.tied],
        ),
        training=ProfileTraining(micro_batch=micro_batch, seq_len=seq_len, compute_dtype=dtype),
        device="synthetic",
        attention="synthetic",
        bootstrap=False,
        iterations=0,
        segments=segs,
        params=params,
        hardware=spec,
    )
