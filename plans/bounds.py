"""Bounds on every count and size a plan or a command-line flag can carry: checked once, here.

A plan that passes the schema can still say ``chunk_numel: 2**62`` or
``micro_batch: 10**12``: well-typed, consistent, and impossible to allocate or to
iterate. ``validate`` (every plan ``load`` reads, and every plan ``wrap`` is given)
and the commands that take the same values as flags (``protrain plan --grad-accum``,
``--batch``, ``--seq``, ``--world-size``; planner/commands/checks.py ``check_flags``) refuse them
by this module's limits, with the JSON path or the flag, the value and the limit.

The limits are far above anything that trains (a trillion-element chunk, 65,536
micro-batches per step, 65,536 ranks, 16M-token micro-batches) and far below what
overflows: each keeps every product the executor forms from them (bytes of a chunk,
of a batch, of a rank's shard) well inside int64. Whether a plan within them fits
*this* machine is another question, answered by ``train``'s host-memory check
(planner/commands/preflight.py ``plan_fits_host``) and the planner's budget.

No torch here: ``validate`` imports this module.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from .errors import PlanError

TRAINING_LIMITS: dict[str, tuple[int, str, str]] = {
    # field: (largest value, its flag, what it counts)
    "micro_batch": (1 << 24, "--batch", "sequences per micro-batch"),
    "seq_len": (1 << 24, "--seq", "tokens per sequence"),
    "grad_accum": (1 << 16, "--grad-accum", "micro-batches per optimizer step"),
    "world_size": (1 << 16, "--world-size", "ranks"),
}
MAX_TOKENS_PER_MICRO_BATCH = 1 << 32
"""micro_batch × seq_len: the (micro_batch, seq_len) batch is one tensor on every rank."""
MAX_NUMEL = 1 << 40
"""Elements of a chunk (``chunks.chunk_numel``), and the largest dimension of a parameter's
shape."""
MAX_COUNT = 1 << 20
"""Chunks, parameters per chunk, blocks, device buffers, host slots: each is iterated or
allocated per item."""


def training_excess(values: Mapping[str, int]) -> Iterator[tuple[str, int, int, str]]:
    """(field, value, limit, what) of each training value over its limit, then the product's."""
    for field, (limit, _, what) in TRAINING_LIMITS.items():
        value = values.get(field)
        if value is not None and value > limit:
            yield field, value, limit, what
    b, t = values.get("micro_batch"), values.get("seq_len")
    if b is not None and t is not None and b * t > MAX_TOKENS_PER_MICRO_BATCH:
        yield (
            "tokens",
            b * t,
            MAX_TOKENS_PER_MICRO_BATCH,
            "tokens per micro-batch (micro_batch × seq_len)",
        )


def _sizes(plan) -> Iterator[tuple[str, int, int, str]]:
    """(JSON path, value, limit, what) of every bounded value of a plan, in the order checked."""
    for field, value, limit, what in training_excess(
        {f: getattr(plan.training, f) for f in TRAINING_LIMITS}
    ):
        # (the product's excess is named at micro_batch, the first of its two factors)
        yield f"$.training.{'micro_batch' if field == 'tokens' else field}", value, limit, what
    yield "$.chunks.chunk_numel", plan.chunks.chunk_numel, MAX_NUMEL, "elements per chunk"
    yield "$.chunks.list", len(plan.chunks.items), MAX_COUNT, "chunks"
    yield "$.model.blocks", len(plan.model.blocks), MAX_COUNT, "blocks"
    yield "$.placement.n_buffer", plan.placement.n_buffer, MAX_COUNT, "device buffers"
    yield "$.placement.n_host_slots", plan.placement.n_host_slots, MAX_COUNT, "host slots"
    for ci, chunk in enumerate(plan.chunks.items):
        path = f"$.chunks.list[{ci}].params"
        yield path, len(chunk.params), MAX_COUNT, "parameters in one chunk"
        for pi, p in enumerate(chunk.params):
            for di, dim in enumerate(p.shape):
                yield f"{path}[{pi}].shape[{di}]", dim, MAX_NUMEL, "elements along one dimension"


def check_plan(plan, where: str = "<plan>") -> None:
    """Refuse a plan carrying a shape, count or size over its limit, naming its JSON path."""
    for path, value, limit, what in _sizes(plan):
        if value > limit:
            raise PlanError(
                f"{where}: {value:,} {what} is more than protrain can allocate or iterate "
                f"(at most {limit:,}) - at `{path}`",
                "regenerate the plan with `protrain plan` (its flags are checked against the same "
                "limits)",
            )
