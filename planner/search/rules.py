"""The fixed rules that turn a configuration into a plan's event schedule (no torch).

The cost model (``cost.py``) replays the very schedule the plan will hold, and
``emit.py`` writes it down; both take it from here. The rules are in ``emit.py``'s
docstring. ``ModelFacts`` is what a plan needs to know about a model, as plain data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protrain.plans import plan as P
from protrain.plans.errors import BudgetError

if TYPE_CHECKING:
    from ..profiling.profile import Profile


def cpu_adam_schedule(compute_dtype: str, max_grad_norm: float | None = None) -> P.CpuAdam:
    """When the offloaded chunks' CPU AdamW steps may start (``Schedule.cpu_adam``).

    Global-norm clipping scales every gradient by a coefficient of all of them, and
    fp16's loss scaler skips the whole update when any gradient overflowed: both
    need every gradient before any parameter changes, so the CPU steps wait for the
    end of backward. Otherwise each starts as soon as its chunk's gradients land.
    """
    return (
        "after_backward"
        if max_grad_norm is not None or compute_dtype == "float16"
        else "during_backward"
    )


HOST_SLOTS = 1
"""``placement.n_host_slots`` of a plan with homeless chunks (executor/chunks.py [Note: host
slots]). One shard-sized slot: it is what the 12 B layout adds to the host, so it is kept to
one (the issue's bound: a pool set by the plan, not by the model's size). A fetch then waits
for the last upload or CPU step that used the slot; the cost model does not charge that wait.
"""


def build_schedule(
    segments: Sequence[str],
    need: dict[str, set[int]],
    offloaded: set[int],
    n_buffer: int,
    swapped: Sequence[str],
    cpu_adam: P.CpuAdam = "during_backward",
) -> P.Schedule:
    """The event lists for one iteration (see the module docstring for the rules)."""
    seq = [("forward", s) for s in segments] + [("backward", s) for s in reversed(segments)]
    need_off = [sorted(need[s] & offloaded) for _, s in seq]
    for (_, s), ids in zip(seq, need_off):
        if len(ids) > n_buffer:
            raise BudgetError(
                f"segment {s!r} uses {len(ids)} offloaded chunks at once but n_buffer is "
                f"{n_buffer}",
                f"use n_buffer >= {len(ids)}, or a larger chunk size",
            )

    # next_use[k][c]: the first step j >= k that uses chunk c (len(seq): none).
    next_use: list[dict[int, int]] = [{} for _ in range(len(seq) + 1)]
    for k in range(len(seq) - 1, -1, -1):
        next_use[k] = {**next_use[k + 1], **dict.fromkeys(need_off[k], k)}

    fetch: list[list[int]] = [list(ids) for ids in need_off]
    prefetch: list[list[int]] = [[] for _ in seq]
    release: list[list[int]] = [[] for _ in seq]
    resident: set[int] = set()
    for k in range(len(seq)):
        # Desired resident set once step k has fetched and prefetched.
        desired = list(need_off[k])
        for c in need_off[k + 1] if k + 1 < len(seq) else []:
            if len(desired) < n_buffer and c not in desired:
                desired.append(c)
        cached = sorted(
            (c for c in resident if c not in desired and next_use[k].get(c, len(seq)) < len(seq)),
            key=lambda c: (next_use[k][c], c),
        )
        desired += cached[: max(0, n_buffer - len(desired))]
        if k:
            release[k - 1] = sorted(resident - set(desired))
        resident &= set(desired)
        prefetch[k] = sorted(set(desired) - resident - set(need_off[k]))
        resident |= set(desired)
    release[-1] = sorted(resident)

    back = list(reversed(segments))
    offload: list[list[int]] = [[] for _ in back]
    for c in sorted(offloaded):
        last = max((j for j, s in enumerate(back) if c in need[s]), default=len(back) - 1)
        offload[last].append(c)
    swap_in: list[list[str]] = [[] for _ in back]
    for b in swapped:
        swap_in[max(0, back.index(b) - 1)].append(b)

    n = len(segments)
    forward = [
        P.Step(segment=s, fetch=fetch[k], prefetch=prefetch[k], release=release[k])
        for k, s in enumerate(segments)
    ]
    backward = [
        P.Step(
            segment=s,
            fetch=fetch[n + j],
            prefetch=prefetch[n + j],
            release=release[n + j],
            offload=offload[j],
            swap_in=swap_in[j],
        )
        for j, s in enumerate(back)
    ]
    return P.Schedule(forward=forward, backward=backward, cpu_adam=cpu_adam)


@dataclass(frozen=True)
class ModelFacts:
    """What a plan needs to know about a model, as plain data (no torch)."""

    name: str
    blocks: list[str]
    params: list[tuple[str, tuple[int, ...], str]]
    """(name, shape, dtype) of each unique parameter, in registration order."""
    tied: list[list[str]]
    segments: list[str]
    order: list[str]
    """Parameter names in first-use order."""
    uses: dict[str, list[str]]
    """Segment → parameters it uses."""
    frozen: frozenset[str] = frozenset()
    """Parameters that do not train (``requires_grad=False``): laid out after the trainable
    ones (``layout.layout_order``), their chunks keep values only."""


def facts_from_profile(profile: Profile) -> ModelFacts:
    """The model facts a plan needs, read from a profile (no model, no torch)."""
    segments = [P.PRE, *profile.model.blocks, P.POST]
    uses: dict[str, list[str]] = {
        s: [] for s in segments
    }  # each segment's parameters, in profile order
    for p in profile.params:  # (one pass: a deep model has hundreds of each)
        for s in dict.fromkeys(p.uses):
            if s in uses:
                uses[s].append(p.name)
    return ModelFacts(
        name=profile.model.name,
        blocks=list(profile.model.blocks),
        params=[(p.name, tuple(p.shape), p.dtype) for p in profile.params],
        tied=[list(t) for t in profile.model.tied],
        segments=segments,
        order=[p.name for p in profile.params],
        uses=uses,
        frozen=frozenset(p.name for p in profile.params if p.frozen),
    )
