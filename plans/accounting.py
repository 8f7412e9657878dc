"""Bytes where, when: one iteration of a plan as a stream of allocations and frees.

This is protrain's one memory model. The cost model's vectorised walk is
property-tested equal to it (tests/test_accounting.py), the executor's ledger is
checked against it at every step boundary while training (``Ledger.check``), and
``show``, ``fit`` and the chunk pool read their figures from it. Plain data in,
plain data out: no torch.

What lives where, per rank (``W`` ranks; a chunk's ``numel`` is the plan's
``chunk_numel`` padded to a multiple of ``W``; its shard is ``numel / W``):

- **device, from wrap on** — each persistent chunk: values and gradients in the
  compute dtype (whole on every rank), and if trainable its fp32 Adam moments (8 B
  per element) and an fp32 master (4 B) unless the compute dtype is fp32 (the chunk
  is its own master): for the whole chunk (replicated), or for this rank's shard
  only when ``placement.shard_persistent_states``. A frozen chunk has no gradients,
  moments or master.
- **device, device-homed chunks** (``placement.device_homed``) — each one's fp32
  master and moments for the elements it would keep on the host (``host_numel``:
  this rank's shard), ``HOMED_BYTES`` per element, from wrap on, and once, if any,
  the device steps' fp32 scratch of one ``STEP_PIECE`` (chunks.py [Note: device
  homes]); nothing of them on the host.
- **device, reserved** — ``min(n_buffer, offloaded chunks)`` chunk buffers for the
  offloaded chunks' values (the whole gathered chunk each), from wrap on: the chunk
  pool holds them for the run (transfer.py [Note: chunk memory pool]). Which chunk
  occupies them changes per step (``where == "buffers"`` events: from the step that
  fetches or prefetches a chunk to the step that releases it); that is what the
  CPU ledger counts, and it never exceeds the reservation (validation.py).
- **device, per step** — an offloaded chunk's gradients (if trainable) from its
  first fetch in backward to the end of the step that offloads them.
- **device, shared gradients** — a trainable parameter that more than one segment
  uses (a tied embedding and LM head): autograd holds the gradient of its later use
  until the earlier use's backward adds the other (one input buffer of its
  ``AccumulateGrad`` node), so ``numel`` compute-dtype bytes stay on the device from
  the end of the later segment's backward to the end of the earlier one's
  (``shared_grads``; measured in tests/test_shared_grads.py). The stream takes
  trainability per chunk, as everywhere in this module, so a frozen tied weight in a
  trainable chunk is counted (an over-count); the CPU ledger, which knows each
  parameter, does not count it.
- **device, activations** (given per segment, from a profile): a keep block or a
  segment outside the blocks holds ``saved`` from its forward to the end of its
  backward, a checkpointed block its ``inputs``; a swapped block holds nothing
  after forward and ``swapped`` from the step that swaps it in to the end of its
  backward. On a GPU also: a swapped block's ``saved`` while its D2H copy is in
  flight (its own forward step and the next one), a checkpointed block's
  recomputed ``saved`` during its backward, and each step's transient peak.
- **host** — each offloaded chunk's shard (at one rank: the chunk up to its last
  parameter, ``host_numel``, not its padding): its home (compute dtype) and, if
  trainable, moments (8 B) and an fp32 master (4 B, 16-bit compute only). With
  16-bit compute and no accumulation the gradients land in the home (14 B in all);
  otherwise an fp32 gradient accumulator (4 B) and, with ``grad_accum > 1``, a
  compute-dtype staging buffer for the later micro-batches. A *homeless* chunk
  (``placement.homeless``) has no home (12 B in all): its uploads and gradients pass
  through the plan's ``n_host_slots`` pinned slots of one shard each. Gradients in a
  home or a slot are stepped through an fp32 scratch of ``STEP_PIECE`` elements, one
  piece at a time (``scratch_bytes``): bounded by the executor, not by the model.
  Swapped activations: every swapped block's ``swapped`` bytes at the turn from
  forward to backward.
- **disk, NVMe chunks** (``placement.nvme``) — each one's fp32 master and moments (in
  fp32 compute the master is its home): no host bytes for them, ``nvme_span`` bytes each
  on the disk; the host keeps its home (16-bit, unless homeless) and gradient buffers,
  and once, if any, ``NVME_WINDOW`` bytes: the file's pages mapped at once while pieces
  of it are read and written (nvme.py [Note: NVMe tier]).

The device peak is the largest running total over the stream, times ``alpha``
(allocator fragmentation on a GPU, 1 on a CPU): planner/search/memory_walk.py ``walk``, with the
per-element figures the planner reads (``element_bytes``). This module streams the model
states (``state_events``: what the executor checks); the activation and
shared-gradient events come from a profile and matter to the planner only, which adds
them (``memory_walk.events``). Within a step the order is: swap-in,
fetches and prefetches, opened gradients; activations; transients (allocated, then
freed); offloads, the segment's activations, releases.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from . import homes as H
from .homes import DTYPE_BYTES, NVME_ALIGN, NVME_WINDOW, STEP_PIECE, nvme_span  # noqa: F401  (re-exported)
from .plan import Plan, Step, segments
from .validation import param_segments, replay


def setup(plan: Plan) -> H.Setup:
    """The plan's training setup, as the homes table takes it."""
    return H.Setup(plan.training.compute_dtype, plan.training.grad_accum)


def chunk_homes(plan: Plan) -> list[H.Home]:
    """Each chunk's home, in chunk order."""
    return [H.HOMES[h] for h in plan.placement.homes]


def host_numel(plan: Plan, cid: int) -> int:
    """Elements of offloaded chunk ``cid`` whose states one rank keeps (``homes.own_numel``; its
    ``end``: the element offset just past the chunk's last parameter)."""
    end = max((p.offset + p.numel for p in plan.chunks.items[cid].params), default=0)
    return H.own_numel(plan.chunks.chunk_numel, plan.training.world_size, end)


def plan_trainable(plan: Plan) -> list[bool]:
    """Each chunk trains unless all its parameters are frozen (``Param.frozen``, schema 8)."""
    return [any(not p.frozen for p in c.params) for c in plan.chunks.items]


def tied_spans(
    uses: Mapping[str, Sequence[int]], nbytes: Mapping[str, int]
) -> list[tuple[int, int, int]]:
    """``(first, last, bytes)`` of each parameter of ``nbytes`` that more than one segment uses
    (``uses``: segment indexes in forward order; a tied embedding and head): autograd holds its
    gradient from the backward step after its later use (``last - 1``) to the end of its
    earlier use's (``first``), so over the backward steps ``first .. last - 1``. The executor's
    stream (``shared_grads``) and the cost model (``cost.make_terms``) both read it."""
    return [(u[0], u[-1], nbytes[n]) for n in nbytes if len(u := uses.get(n, ())) > 1]


def shared_grads(
    plan: Plan, trainable: Sequence[bool] | None = None, frozen: Collection[str] = ()
) -> Counter[tuple[str, int]]:
    """Bytes of the gradients autograd holds for trainable parameters two segments use
    (module docstring, ``tied_spans``): ``[(segment, 1)]`` opened at that backward step,
    ``[(segment, -1)]`` closed at its end. ``frozen``: names of parameters without gradients
    (the executor's live ones), beside those the plan marks."""
    segs, cb, out = segments(plan), DTYPE_BYTES[plan.training.compute_dtype], Counter()
    uses = {n: [segs.index(s) for s in u] for n, u in param_segments(plan).items()}
    held = {
        p.name: p.numel * cb
        for c in plan.chunks.items
        for p in c.params
        if (trainable is None or trainable[c.id]) and p.name not in frozen and not p.frozen
    }
    for first, last, nbytes in tied_spans(uses, held):
        out[segs[last - 1], 1] += nbytes
        out[segs[first], -1] += nbytes
    return out


@dataclass(frozen=True)
class Event:
    """One allocation (``nbytes > 0``) or free (``< 0``)."""

    phase: str  # "wrap", "forward" or "backward"
    segment: str  # the step's segment; "" at wrap
    where: str  # "device", "host", or "buffers" (occupancy of the reserved chunk buffers)
    # device: chunks, buffers, grads, optim (model states); activations (held), shared_grads,
    # swapped_in, swap_out (in flight to the host), recompute, transient;
    # "buffers": chunks; host: home, optim, scratch, slots, swapped (activations), nvme_window;
    # disk: optim; "step" (0 bytes) marks each step's start
    kind: str
    nbytes: int
    chunk: int = -1
    block: str = ""


StepEvents = tuple[str, Step, list[Event], list[Event]]
"""``(phase, step, begin, end)``: a schedule step's model-state events (``state_events``)."""


def state_events(
    plan: Plan, trainable: Sequence[bool] | None = None
) -> tuple[list[Event], list[StepEvents]]:
    """The model states' events (see the module docstring): wrap's, and per schedule step
    ``(phase, step, begin, end)``: ``begin`` its fetches, prefetches and opened gradients,
    ``end`` its offloads and releases (``validation.replay``)."""
    W, cb = plan.training.world_size, DTYPE_BYTES[plan.training.compute_dtype]
    numel = H.padded_numel(plan.chunks.chunk_numel, W)
    chunk_bytes, shard = numel * cb, numel // W
    train = list(trainable) if trainable is not None else plan_trainable(plan)
    su, homes = setup(plan), chunk_homes(plan)
    # Persistent chunks' states: a shard each.
    sharded = W > 1 and plan.placement.shard_persistent_states
    out: list[Event] = []

    def ev(where: str, kind: str, nbytes: int, chunk: int = -1) -> None:
        if nbytes:
            out.append(Event("wrap", "", where, kind, nbytes, chunk))

    def states(offloaded: bool, steps_on: str) -> bool:
        """Each such chunk's parts, one event per (where, kind); whether one of them trains."""
        group = [
            c for c, h in enumerate(homes) if h.offloaded == offloaded and h.steps_on == steps_on
        ]
        for c in group:
            own = host_numel(plan, c) if offloaded else shard if sharded else numel
            for where, kind in (
                ("device", "chunks"),
                ("device", "grads"),
                ("device", "optim"),
                ("host", "home"),
                ("host", "optim"),
                ("disk", "optim"),
            ):
                ev(where, kind, homes[c].nbytes(su, where, numel, own, train[c], kind), c)
        return any(train[c] for c in group)

    states(False, "device")  # the persistent chunks
    n_buffers = min(plan.placement.n_buffer, sum(h.offloaded for h in homes))
    ev("device", "buffers", n_buffers * chunk_bytes)
    if states(True, "device"):  # the device-homed ones, and their steps' scratch
        ev("device", "optim", H.device_scratch_bytes(shard))
    host_steps = states(True, "host")
    if any(train[c] and h.on_disk for c, h in enumerate(homes)):
        ev("host", "nvme_window", NVME_WINDOW)
    if host_steps:
        ev("host", "scratch", H.host_scratch_bytes(su, shard))
    ev("host", "slots", plan.placement.n_host_slots * shard * cb)

    # A chunk's values occupy a reserved buffer; its gradients are device memory of their own.
    place = {"chunks": "buffers", "grads": "device"}

    def chunk_events(phase: str, step: Step, changes: list) -> list[Event]:
        return [
            Event(phase, step.segment, place[kind], kind, sign * chunk_bytes, c)
            for kind, c, sign in changes
            if kind == "chunks" or train[c]
        ]

    return out, [
        (phase, step, chunk_events(phase, step, begin), chunk_events(phase, step, end))
        for phase, _, step, _, begin, end in replay(plan.schedule)
    ]
