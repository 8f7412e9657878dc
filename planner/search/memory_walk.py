"""The accounting stream's figures: a plan's device and host peaks (``walk``), per step.

plans/accounting.py streams every allocation and free of wrap and one iteration (the
one memory model; the executor's ledger is held to its model states while training).
What the planner reads from it lives here: the whole stream, activations and the
gradients of shared parameters added to the model states (``events``), its peaks
(``walk``, ``step_highs``), the allocator's fragmentation factor on a GPU, the activation
bytes a profile gives the stream (``SegmentBytes``) and the per-element bytes of each
model state (``element_bytes``). ``show``, ``fit``, the cost model's property tests and
the tools read them; the executor does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from protrain.plans import accounting as A
from protrain.plans import homes as H
from protrain.plans.plan import Plan, segments

ALPHA_GPU = 1.10
"""Fragmentation factor on CUDA: allocator block rounding and cached-but-free
segments. 1.10 is the paper's reported worst case (≤ 10% over-prediction target);
not yet fitted to a measured GPU peak."""


@dataclass(frozen=True)
class ElementBytes:
    """Bytes per chunk element of each model state, for one training setup (homes.py's table)."""

    compute: int  # values, gradients, the offloaded home and staging
    persistent: (
        int  # a trainable persistent chunk on the device: values, gradients, moments, master
    )
    # a trainable offloaded chunk's shard on the host: home, moments, accumulator, master, staging
    host: int


def element_bytes(compute_dtype: str, grad_accum: int = 1) -> ElementBytes:
    """Per-element bytes of a trainable chunk's states, read from the homes table."""
    s = H.Setup(compute_dtype, grad_accum)
    return ElementBytes(
        compute=s.cb, persistent=H.PERSISTENT.per_elem(s, "device"), host=H.HOST.per_elem(s, "host")
    )


HOMED_BYTES = H.DEVICE_HOMED.per_elem(H.Setup("float32"), "device")
"""Device bytes per element of a device-homed chunk's shard: fp32 master and the two fp32
Adam moments, whatever the compute dtype (chunks.py [Note: device homes])."""


@dataclass(frozen=True)
class SegmentBytes:
    """Activation bytes per segment in forward order (``<pre>``, blocks, ``<post>``), from a
    profile."""

    saved: Sequence[int]  # what keeping the segment's saved tensors holds
    swapped: Sequence[int]  # what swapping them moves (and brings back)
    inputs: Sequence[int]  # what a checkpointed block keeps: its inputs
    fwd_peak: Sequence[int]  # transient peak in forward (counted on a GPU only)
    bwd_peak: Sequence[int]  # transient peak in backward (counted on a GPU only)
    gpu: bool = False


@dataclass(frozen=True)
class Walk:
    """The stream and the figures derived from it."""

    events: list[A.Event]
    states_bytes: int  # persistent chunks' states, from wrap on
    buffers_bytes: int  # the offloaded chunks' reserved device buffers
    activation_walk_bytes: int  # most device bytes above those two at once (gradients, activations)
    peak_bytes: float  # (states + buffers + walk) × alpha
    host_bytes: int  # offloaded chunks' states on the host
    host_swap_bytes: int  # swapped activations on the host at the turn
    alpha: float
    disk_bytes: int = 0  # NVMe chunks' states in the file (placement.nvme)


def events(
    plan: Plan, acts: SegmentBytes | None = None, trainable: Sequence[bool] | None = None
) -> list[A.Event]:
    """The allocation stream of wrap and one iteration (plans/accounting.py's module
    docstring): the model states' (``accounting.state_events``) with the activations of
    ``acts`` and the gradients autograd holds for shared parameters, in each step's order."""
    wrap, steps = A.state_events(plan, trainable)
    segs = segments(plan)
    policy = {a.block: a.policy for a in plan.activations}
    out: list[A.Event] = list(wrap)

    def ev(phase, seg, where, kind, nbytes, chunk=-1, block=""):
        if nbytes:
            out.append(A.Event(phase, seg, where, kind, nbytes, chunk, block))

    def act(i: int, field: str) -> int:
        return int(getattr(acts, field)[i]) if acts is not None else 0

    gpu = acts is not None and acts.gpu
    held = [
        H.held_bytes(policy.get(s, H.KEEP.name), act(i, "saved"), act(i, "inputs"))
        for i, s in enumerate(segs)
    ]
    moves = {
        b for b, p in policy.items() if H.POLICIES[p].moves
    }  # (homes.POLICIES: swapped blocks)
    recomputes = {b for b, p in policy.items() if H.POLICIES[p].recomputes}

    shared = A.shared_grads(plan, trainable)
    back_in: set[str] = set()
    for phase, step, begin, end in steps:
        s = step.segment
        i = segs.index(s)
        out.append(A.Event(phase, s, "device", "step", 0))  # marks the step's start
        for b in step.swap_in:
            back_in.add(b)
            ev(phase, s, "device", "swapped_in", act(segs.index(b), "swapped"), block=b)
        out += begin
        if phase == "backward":
            ev(phase, s, "device", "shared_grads", shared[s, 1])
        if phase == "forward":
            ev(phase, s, "device", "activations", held[i], block=s)
            if gpu and s in moves:
                ev(phase, s, "device", "swap_out", act(i, "saved"), block=s)
        elif gpu and s in recomputes:
            ev(phase, s, "device", "recompute", act(i, "saved"), block=s)
        transient = act(i, "fwd_peak" if phase == "forward" else "bwd_peak") if gpu else 0
        ev(phase, s, "device", "transient", transient)
        ev(phase, s, "device", "transient", -transient)
        out += end
        if phase == "forward":
            if gpu and i and segs[i - 1] in moves:
                ev(phase, s, "device", "swap_out", -act(i - 1, "saved"), block=segs[i - 1])
            if i == len(segs) - 1:  # the turn: every swapped block's activations are on the host
                for b in plan.model.blocks:
                    if b in moves:
                        ev(phase, s, "host", "swapped", act(segs.index(b), "swapped"), block=b)
        else:
            if gpu and s in recomputes:
                ev(phase, s, "device", "recompute", -act(i, "saved"), block=s)
            ev(phase, s, "device", "activations", -held[i], block=s)
            ev(phase, s, "device", "shared_grads", -shared[s, -1])
            if s in back_in:
                ev(phase, s, "device", "swapped_in", -act(i, "swapped"), block=s)
                ev(phase, s, "host", "swapped", -act(i, "swapped"), block=s)
    return out


def walk(
    plan: Plan, acts: SegmentBytes | None = None, trainable: Sequence[bool] | None = None
) -> Walk:
    """``events`` and its figures: the peaks on the device and the host."""
    stream = events(plan, acts, trainable)
    alpha = ALPHA_GPU if acts is not None and acts.gpu else 1.0
    states = sum(
        e.nbytes
        for e in stream
        if e.phase == "wrap" and e.where == "device" and e.kind != "buffers"
    )
    buffers = sum(e.nbytes for e in stream if e.phase == "wrap" and e.kind == "buffers")
    host = sum(e.nbytes for e in stream if e.phase == "wrap" and e.where == "host")
    high = step_highs(stream)
    most = max((sum(k.values()) for _, _, k in high), default=0)
    # swapped activations on the host: the most the running total of their events reaches
    most_swap = max(
        accumulate((e.nbytes for e in stream if e.phase != "wrap" and e.where == "host"), initial=0)
    )
    return Walk(
        stream,
        states_bytes=states,
        buffers_bytes=buffers,
        activation_walk_bytes=most,
        peak_bytes=(states + buffers + most) * alpha,
        host_bytes=host,
        host_swap_bytes=most_swap,
        alpha=alpha,
        disk_bytes=sum(e.nbytes for e in stream if e.where == "disk"),
    )


def by_step(stream: Sequence[A.Event]) -> list[tuple[str, str, list[A.Event]]]:
    """The device events after wrap, grouped by step (``step`` markers start each group)."""
    out: list[tuple[str, str, list[A.Event]]] = []
    for e in stream:
        if e.kind == "step":
            out.append((e.phase, e.segment, []))
        elif e.phase != "wrap" and e.where == "device":
            out[-1][2].append(e)
    return out


def step_highs(stream: Sequence[A.Event]) -> list[tuple[str, str, dict[str, int]]]:
    """Device bytes allocated after wrap, by kind, at each step's high point (after its
    allocations, before its frees: a step allocates before it frees), in step order."""
    totals: dict[str, int] = {}
    out = []
    for phase, segment, evs in by_step(stream):
        high = dict(totals)
        for e in evs:
            if e.nbytes > 0:
                high[e.kind] = high.get(e.kind, 0) + e.nbytes
            totals[e.kind] = totals.get(e.kind, 0) + e.nbytes
        out.append((phase, segment, high))
    return out
