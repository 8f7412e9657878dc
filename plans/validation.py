"""What a well-typed plan must also satisfy: ``validate``, and the residency replay it runs.

``plan.py`` is the format (Structs, canonical ``dump``, ``load``); this module is its
semantics: every parameter in one chunk, the placement a partition, one policy per
block, and the schedule replayed on chunk ids (``simulate_residency``) so that a plan
that loads can never overflow its buffers or free an upload in flight. ``load`` calls
``validate``; nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from math import prod

from . import homes as H
from .bounds import check_plan as check_bounds
from .errors import PlanError
from .migrate import REGENERATE, SCHEMA_VERSION
from .plan import POST, PRE, Plan, Schedule, Step, plan_fingerprint, segments


def validate(plan: Plan, where: str = "<plan>") -> None:
    """Check the invariants a well-typed plan must also satisfy; raise ``PlanError`` on the first.

    Every parameter in exactly one chunk, inside it and not overlapping another; the
    placement partitions the chunks; one policy per block; the schedule names only
    existing chunks and segments and, replayed, keeps every segment's parameters
    resident without ever holding more than ``n_buffer`` offloaded chunks.
    """

    def fail(path: str, what: str, hint: str = REGENERATE) -> None:
        raise PlanError(f"{where}: {what} - at `{path}`", hint)

    if plan.schema_version != SCHEMA_VERSION:
        fail(
            "$.schema_version",
            f"expected {SCHEMA_VERSION} after migration, got {plan.schema_version}",
        )

    # -- bounds: shapes, counts and sizes that could never be allocated or iterated (bounds.py)
    check_bounds(plan, where)

    # -- training ↔ schedule: fp16's loss scaler checks every gradient for overflow
    # before any parameter changes, so no CPU step may start during backward.
    if plan.training.compute_dtype == "float16" and plan.schedule.cpu_adam != "after_backward":
        fail(
            "$.schedule.cpu_adam",
            f"is {plan.schedule.cpu_adam!r} but float16 compute needs 'after_backward' (the loss "
            "scaler's overflow check needs every gradient before any step)",
        )

    # -- training ↔ placement: one rank has nothing to shard over. Refused rather than read
    # as replicated, so that a plan's flag always says what the executor does.
    if plan.placement.shard_persistent_states and plan.training.world_size == 1:
        fail(
            "$.placement.shard_persistent_states",
            "is true but the plan is for one rank (world_size 1)",
            "set it to false, or make the plan with `protrain plan --world-size N` (N > 1)",
        )

    # -- model
    blocks = plan.model.blocks
    first: dict[str, int] = {}
    for i, b in enumerate(blocks):
        if b in (PRE, POST) or not b:
            fail(f"$.model.blocks[{i}]", f"{b!r} is not a module path")
        if first.setdefault(b, i) != i:
            fail(f"$.model.blocks[{i}]", f"block {b!r} is listed twice")

    # -- chunks: ids, bounds, overlaps, one chunk per parameter
    cap = plan.chunks.chunk_numel
    owner: dict[str, int] = {}
    for ci, chunk in enumerate(plan.chunks.items):
        cpath = f"$.chunks.list[{ci}]"
        if chunk.id != ci:
            fail(
                f"{cpath}.id",
                f"chunk ids must be 0, 1, 2, … in order; expected {ci}, got {chunk.id}",
            )
        for pi, p in enumerate(chunk.params):
            ppath = f"{cpath}.params[{pi}]"
            if prod(p.shape) != p.numel:
                fail(
                    f"{ppath}.numel",
                    f"{p.name}: numel {p.numel} != product of shape {p.shape} = {prod(p.shape)}",
                )
            if p.offset + p.numel > cap:
                fail(
                    f"{ppath}.offset",
                    f"{p.name}: elements [{p.offset}, {p.offset + p.numel}) exceed the chunk size "
                    f"{cap}",
                )
            if p.name in owner:
                fail(f"{ppath}.name", f"parameter {p.name!r} is also in chunk {owner[p.name]}")
            owner[p.name] = ci
        spans = sorted(
            (p.offset, p.offset + p.numel, pi, p.name) for pi, p in enumerate(chunk.params)
        )
        for (_, end_a, _, name_a), (start_b, _, pi_b, name_b) in zip(spans, spans[1:]):
            if start_b < end_a:
                fail(f"{cpath}.params[{pi_b}].offset", f"{name_b} overlaps {name_a} in chunk {ci}")
    n_params = sum(p.numel for c in plan.chunks.items for p in c.params)
    if n_params != plan.model.n_params:
        fail(
            "$.model.n_params",
            f"chunks hold {n_params} elements but the model declares {plan.model.n_params}",
        )
    for field in ("pre_block_params", "post_block_params"):
        for i, name in enumerate(getattr(plan.model, field)):
            if name not in owner:
                fail(f"$.model.{field}[{i}]", f"parameter {name!r} is in no chunk")
    for i, pair in enumerate(plan.model.tied):
        if len(pair) != 2:
            fail(f"$.model.tied[{i}]", f"expected a [name, alias] pair, got {len(pair)} names")
        if pair[0] not in owner:
            fail(f"$.model.tied[{i}][0]", f"tied parameter {pair[0]!r} is in no chunk")
        if pair[1] in owner:
            fail(
                f"$.model.tied[{i}][1]", f"alias {pair[1]!r} must not have a chunk slot of its own"
            )
    if plan.model.fingerprint != plan_fingerprint(plan):
        fail(
            "$.model.fingerprint",
            "does not match the parameters listed in the chunks (the file was edited)",
        )

    # -- placement: one home per chunk, each allowed by the training setup (homes.py)
    n_chunks = len(plan.chunks.items)
    pl, t = plan.placement, plan.training
    if len(pl.homes) != n_chunks:
        fail(
            "$.placement.homes",
            f"lists {len(pl.homes)} homes for {n_chunks} chunks (one per chunk, in chunk order)",
        )
    if pl.n_persist != len(pl.persistent):
        fail(
            "$.placement.n_persist",
            f"is {pl.n_persist} but {len(pl.persistent)} chunks are persistent",
        )
    if pl.offloaded and pl.n_buffer < 1:
        fail("$.placement.n_buffer", "offloaded chunks need at least one device buffer")
    setup = H.Setup(t.compute_dtype, t.grad_accum)
    for i, name in enumerate(pl.homes):
        why = H.HOMES[name].refusal(setup, plan.schedule.cpu_adam)
        if why:
            fail(
                f"$.placement.homes[{i}]",
                f"chunk {i} is {name!r}, which {why} (this plan: {t.compute_dtype}, grad_accum "
                f"{t.grad_accum}, schedule.cpu_adam {plan.schedule.cpu_adam!r})",
            )
        if H.HOMES[name].needs_trainable and all(p.frozen for p in plan.chunks.items[i].params):
            fail(
                f"$.placement.homes[{i}]",
                f"chunk {i} is {name!r}, whose master is its only copy of the values, "
                "but its parameters are all frozen (Param.frozen): a frozen chunk has no master",
            )
    slotted = sum(H.HOMES[h].uses_slots for h in pl.homes)
    if (pl.n_host_slots > 0) != bool(slotted):
        fail(
            "$.placement.n_host_slots",
            f"is {pl.n_host_slots} with {slotted} homeless chunks (at least 1 if any, else 0)",
        )

    # -- activations
    _in_order(
        [a.block for a in plan.activations],
        blocks,
        fail,
        "$.activations[{}]",
        "one policy per block, in model.blocks order",
    )

    simulate_residency(plan, where)


def _in_order(got: list[str], expected: list[str], fail, path: str, what: str) -> None:
    """Refuse ``got`` unless it is ``expected`` (``what``), at the first difference: ``path``
    formatted with its index, each side's name there ('nothing' past an end)."""
    if got != expected:
        i = next(
            (i for i, (a, b) in enumerate(zip(got, expected)) if a != b),
            min(len(got), len(expected)),
        )
        fail(
            path.format(i),
            f"{what}: expected {[*expected, 'nothing'][i]!r}, got {[*got, 'nothing'][i]!r}",
        )


def param_segments(plan: Plan) -> dict[str, list[str]]:
    """The segments that use each chunked parameter, in forward order: ``<pre>`` and ``<post>``
    as the model lists them, and the block whose path prefixes its name."""
    pre, post = set(plan.model.pre_block_params), set(plan.model.post_block_params)
    out = {}
    for p in (p for c in plan.chunks.items for p in c.params):
        block = next((b for b in plan.model.blocks if p.name.startswith(b + ".")), None)
        out[p.name] = [
            s for s, used in ((PRE, p.name in pre), (block, block), (POST, p.name in post)) if used
        ]
    return out


def segment_chunks(plan: Plan) -> dict[str, set[int]]:
    """Chunk ids holding the parameters each segment uses (persistent chunks included)."""
    owner = {p.name: c.id for c in plan.chunks.items for p in c.params}
    need: dict[str, set[int]] = {s: set() for s in segments(plan)}
    for name, segs in param_segments(plan).items():
        for s in segs:
            need[s].add(owner[name])
    return need


Turn = tuple[str, int, int]
"""``(kind, chunk, +1 | -1)``: a chunk's values (kind ``chunks``) or gradient buffer (``grads``)
made resident / opened (+1), or released / closed (-1)."""


def replay(schedule: Schedule) -> Iterator[tuple[str, int, Step, frozenset[int], list, list]]:
    """The schedule replayed on chunk ids: the one simulator of its events, which the checks
    below (``simulate_residency``), the accounting stream (``accounting.state_events``) and
    the predicted trace (planner/views/trace.py) all read.

    Yields ``(phase, index, step, resident, begin, end)`` per step, forward then backward:
    ``resident`` the offloaded chunks resident as the step starts; ``begin`` the ``Turn`` s of
    its start (``fetch`` then ``prefetch`` of chunks not yet resident; in backward, a
    chunk's gradient buffer opens at its first fetch), ``end`` those of its end (``offload``
    closes gradient buffers, then ``release`` frees chunks). Nothing is checked here: a
    turn that would repeat the state (a fetch of a resident chunk, a release of one that is
    not) is simply not one."""
    resident: set[int] = set()
    grads: set[int] = set()

    def turn(kind: str, ids, held: set[int], sign: int) -> list[Turn]:
        out = []
        for c in ids:
            if (c in held) != (sign > 0):
                (held.add if sign > 0 else held.discard)(c)
                out.append((kind, c, sign))
        return out

    for phase, steps in (("forward", schedule.forward), ("backward", schedule.backward)):
        for si, step in enumerate(steps):
            before = frozenset(resident)
            begin = turn("chunks", (*step.fetch, *step.prefetch), resident, 1)
            begin += turn("grads", step.fetch if phase == "backward" else (), grads, 1)
            end = turn("grads", step.offload, grads, -1) + turn(
                "chunks", step.release, resident, -1
            )
            yield phase, si, step, before, begin, end


def simulate_residency(plan: Plan, where: str = "<plan>") -> list[tuple[str, str, frozenset[int]]]:
    """Replay the schedule on the chunk ids alone; return (phase, segment, resident) per step.

    Replay rules (the executor follows exactly these):
    1. A step starts: ``swap_in`` (backward), then every id in ``fetch`` becomes
       resident (waiting if it is in flight), then every id in ``prefetch`` starts
       loading and counts as resident from then on.
    2. The segment runs; every offloaded chunk holding a parameter it uses must be
       in ``fetch`` of this step (so the executor waits on it).
    3. The step ends: ``offload`` (backward), then ``release`` frees the buffers.
    4. A prefetched chunk is fetched by a later step before it is released and before
       backward ends: only a fetch waits for the upload, so a prefetch that no fetch
       follows could still be writing the buffer when its storage is freed.
    Resident offloaded chunks never exceed ``n_buffer``; forward's resident set
    carries into backward, and backward ends with nothing resident. Each offloaded
    chunk is offloaded exactly once in backward, no earlier than the last step that
    uses it; each swapped block is swapped in exactly once, no later than its own
    backward step, and no other block is.
    """

    def fail(path: str, what: str) -> None:
        raise PlanError(f"{where}: {what} - at `{path}`", REGENERATE)

    offloaded = set(plan.placement.offloaded)
    n_buffer = plan.placement.n_buffer
    need = segment_chunks(plan)
    order = segments(plan)
    swapped = {a.block for a in plan.activations if H.POLICIES[a.policy].moves}
    resident: frozenset[int] = frozenset()
    trace: list[tuple[str, str, frozenset[int]]] = []
    offloaded_at: dict[int, int] = {}
    swapped_in_at: dict[str, int] = {}
    # Prefetched chunk → its JSON path, until a step fetches it (rule 4).
    in_flight: dict[int, str] = {}

    for phase, steps, expected in (
        ("forward", plan.schedule.forward, order),
        ("backward", plan.schedule.backward, order[::-1]),
    ):
        _in_order(
            [s.segment for s in steps],
            expected,
            fail,
            f"$.schedule.{phase}[{{}}].segment",
            "one step per segment, in segment order",
        )
    for phase, si, step, before, begin, _ in replay(plan.schedule):
        spath = f"$.schedule.{phase}[{si}]"
        for field in ("fetch", "prefetch", "release", "offload"):
            ids = getattr(step, field)
            for i, c in enumerate(ids):
                if c not in offloaded:
                    kind = "persistent" if c < len(plan.chunks.items) else "unknown"
                    fail(
                        f"{spath}.{field}[{i}]",
                        f"chunk {c} is {kind}; events name offloaded chunks only",
                    )
            if len(set(ids)) != len(ids):
                fail(f"{spath}.{field}", f"chunk ids repeat: {ids}")
        if phase == "forward" and (step.offload or step.swap_in):
            fail(f"{spath}", "`offload` and `swap_in` are backward-only events")
        for i, b in enumerate(step.swap_in):
            if b not in swapped:
                fail(f"{spath}.swap_in[{i}]", f"block {b!r} has no `swap` policy")
            if b in swapped_in_at:
                fail(f"{spath}.swap_in[{i}]", f"block {b!r} is swapped in twice")
            if order[::-1].index(b) < si:
                fail(f"{spath}.swap_in[{i}]", f"block {b!r} is swapped in after its own backward")
            swapped_in_at[b] = si
        for c in step.fetch:
            in_flight.pop(c, None)  # the fetch waits for the upload
        for i, c in enumerate(step.prefetch):
            if c in before or c in step.fetch:
                fail(f"{spath}.prefetch[{i}]", f"chunk {c} is already resident")
            in_flight[c] = f"{spath}.prefetch[{i}]"
        resident = before | {c for kind, c, _ in begin if kind == "chunks"}
        if len(resident) > n_buffer:
            fail(
                f"{spath}",
                f"{len(resident)} offloaded chunks resident {sorted(resident)} "
                f"but placement.n_buffer is {n_buffer}",
            )
        missing = (need[step.segment] & offloaded) - set(step.fetch)
        if missing:
            fail(
                f"{spath}.fetch",
                f"segment {step.segment!r} uses chunks {sorted(missing)}, "
                "which must be fetched by this step",
            )
        trace.append((phase, step.segment, frozenset(resident)))
        for i, c in enumerate(step.offload):  # (backward only: forward's refused above)
            if c in offloaded_at:
                fail(f"{spath}.offload[{i}]", f"chunk {c} is offloaded twice")
            offloaded_at[c] = si
        for i, c in enumerate(step.release):
            if c not in resident:
                fail(f"{spath}.release[{i}]", f"chunk {c} is not resident")
            if c in in_flight:
                fail(
                    in_flight[c],
                    f"chunk {c} is prefetched but never fetched before `{spath}.release[{i}]` "
                    "frees it (its upload could still be writing the freed buffer)",
                )
        resident -= set(step.release)

    for c, path in in_flight.items():
        fail(
            path,
            f"chunk {c} is prefetched but never fetched before backward ends "
            "(its upload could still be in flight when the iteration ends)",
        )
    if resident:
        fail(
            "$.schedule.backward",
            f"chunks {sorted(resident)} are still resident when backward ends",
        )
    last_use_bwd = {
        c: si
        for si, step in enumerate(plan.schedule.backward)
        for c in need[step.segment] & offloaded
    }
    for c in sorted(offloaded):
        if c not in offloaded_at:
            fail("$.schedule.backward", f"offloaded chunk {c} is never offloaded in backward")
        if offloaded_at[c] < last_use_bwd.get(c, -1):
            fail(
                f"$.schedule.backward[{offloaded_at[c]}].offload",
                f"chunk {c} is offloaded before its last use in backward (step {last_use_bwd[c]})",
            )
    for b in sorted(swapped - set(swapped_in_at)):
        fail("$.schedule.backward", f"swapped block {b!r} is never swapped in")
    return trace
