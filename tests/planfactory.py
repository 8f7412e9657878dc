"""Synthetic plans for tests: random model shapes and configurations, no torch model needed.

``random_facts`` makes a decoder-like model description (embedding before the
blocks, a few parameters per block, a head after them, optionally tied to the
embedding); ``assemble`` (the planner's own emitter) turns it into a plan. Used by
the schema property tests; planner tests use it for cost-model inputs.
"""

from __future__ import annotations

from hypothesis import strategies as st

from protrain.executor import plan as P
from protrain.planner.emit import ModelFacts, assemble


@st.composite
def random_facts(draw) -> ModelFacts:
    n_blocks = draw(st.integers(1, 6))
    blocks = [f"layers.{i}" for i in range(n_blocks)]
    params: list[tuple[str, tuple[int, ...], str]] = [("embed.weight", (draw(st.integers(4, 64)), 8), "float32")]
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
    return ModelFacts(name="synthetic", blocks=blocks, params=params,
                      tied=[["embed.weight", "head.weight"]] if tied else [],
                      segments=[P.PRE, *blocks, P.POST], order=order, uses=uses)


@st.composite
def random_plans(draw) -> P.Plan:
    facts = draw(random_facts())
    biggest = max(_numel(s) for _, s, _ in facts.params)
    chunk_numel = draw(st.integers(biggest, biggest * 4))
    # Lay out once without persistence to learn the chunk count, then choose a placement.
    probe = assemble(facts, training=_training(), chunk_numel=chunk_numel, persistent=[],
                     n_buffer=len(facts.params), policies=["keep"] * len(facts.blocks))
    n_chunks = len(probe.chunks.items)
    persistent = draw(st.lists(st.integers(0, n_chunks - 1), unique=True))
    policies = draw(st.lists(st.sampled_from(["keep", "swap", "checkpoint"]),
                             min_size=len(facts.blocks), max_size=len(facts.blocks)))
    # The largest number of chunks one segment uses bounds the buffer count from below.
    need = max(len({c.id for c in probe.chunks.items for p in c.params if p.name in set(u)})
               for u in facts.uses.values())
    n_buffer = draw(st.integers(max(1, need), max(1, need) + 2))
    return assemble(facts, training=_training(), chunk_numel=chunk_numel, persistent=persistent,
                    n_buffer=n_buffer, policies=policies)


def _training() -> P.Training:
    return P.Training(micro_batch=2, seq_len=16, compute_dtype="float32", master_dtype="float32",
                      world_size=1, grad_accum=1)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
