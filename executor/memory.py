"""The memory ledger: what the executor holds on the device, with a peak per step.

On CUDA the ledger reads the caching allocator (``memory_allocated`` and
``max_memory_allocated``), which sees everything, including temporaries inside
kernels' callers. On CPU there is no allocator to ask, so the executor counts
bytes itself at every place it allocates or frees device-side state:

- ``chunks``: storage of resident chunks (persistent ones always, offloaded ones
  between fetch and release);
- ``grads``: gradient buffers (persistent chunks always; offloaded chunks from
  their first backward fetch until their gradients are offloaded);
- ``optim``: fp32 master weights and Adam moments of persistent chunks;
- ``activations``: tensors saved for backward and held on the device, counted once
  per storage (keep blocks and the segments outside blocks: from forward until
  their backward ends; checkpointed blocks: their input; swapped blocks: only
  between swap-in and the end of their backward);
- ``shared_grads``: the gradient autograd holds for a parameter two segments use (a
  tied weight) from the later segment's backward to the earlier one's, counted by
  ``accounting.shared_grads``'s rule (autograd allocates it; no hook sees it).

The count is exact for what it names and deterministic. Its model states
(``chunks``, ``grads``, ``optim`` and the host bytes) are held to
``plans/accounting.py`` at every step boundary (``check``), on CUDA too, so the
single memory model and the executor's hooks cannot drift apart unnoticed. It does
not see op-internal temporaries or the activations a checkpointed block recomputes
during its own backward (no hook exposes them); those are the allocator's business
on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protrain.plans.accounting import state_events
from protrain.plans.plan import Plan

KINDS = ("chunks", "grads", "optim", "activations", "shared_grads")


STATE_KINDS = ("chunks", "grads", "optim")
"""Device kinds that are model states (the rest are activations)."""


def expected_states(
    plan: Plan, trainable: Sequence[bool] | None = None
) -> dict[tuple[str, str, str], dict[str, int]]:
    """Device model-state bytes as the executor's ledger counts them (``STATE_KINDS``;
    ``chunks``: persistent chunks' values plus the chunks occupying the reserved buffers) at
    every step's begin (after its fetches and prefetches) and end (after its releases):
    what ``Ledger.check`` holds the executor to. Keys ``(phase, segment, "begin" | "end")``."""
    wrap, steps = state_events(plan, trainable)
    totals = {
        k: sum(e.nbytes for e in wrap if e.where == "device" and e.kind == k) for k in STATE_KINDS
    }
    out = {}
    for phase, step, begin, end in steps:  # (a step's begin only allocates, its end only frees)
        for when, evs in (("begin", begin), ("end", end)):
            for e in evs:
                totals[e.kind] += e.nbytes
            out[(phase, step.segment, when)] = dict(totals)
    return out


class Ledger:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        # Counted bytes per kind (CPU; kept on CUDA too, for reports and ``check``).
        self.bytes: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.current_bytes = 0  # sum of self.bytes
        self.peak_bytes = 0  # max of self.current_bytes since reset_peak()
        # Host bytes of offloaded states on this rank: homes, fp32 masters, moments,
        # gradient accumulators (all shards under ZeRO-3). Allocated once, at wrap.
        self.host_bytes = 0
        # expected_states: (phase, segment, "begin"|"end") → model-state bytes.
        self.expected: dict[tuple[str, str, str], dict[str, int]] = {}

    def host_alloc(self, nbytes: int) -> None:
        self.host_bytes += nbytes

    def check(self, phase: str, segment: str, when: str, deferred_grads: int = 0) -> None:
        """Hold the counted model states to ``expected_states`` at a step boundary.
        ``deferred_grads``: gradient bytes whose offload waits for autograd (schedule.py
        [Note: gradient completion]), still open past the plan's moment."""
        want = self.expected.get((phase, segment, when))
        if want is None:
            return
        got = {k: self.bytes[k] for k in want}
        want = {**want, "grads": want["grads"] + deferred_grads}
        assert got == want, (
            f"ledger != accounting.py at {when} of {phase} {segment}: counted {got}, expected "
            f"{want}"
        )

    def alloc(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += nbytes
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def free(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] -= nbytes
        self.current_bytes -= nbytes
        assert self.bytes[kind] >= 0, f"ledger underflow: {kind=} {self.bytes[kind]=}"

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def device_peak_bytes(self) -> int:
        """Peak device bytes since ``reset_peak``: the allocator's on CUDA, the count on CPU."""
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else self.peak_bytes

    def allocator_stats(self) -> tuple[int, int]:
        """(peak reserved bytes since ``reset_peak``, allocation retries so far): CUDA only."""
        if not self.cuda:
            return 0, 0
        stats = torch.cuda.memory_stats(self.device)
        return torch.cuda.max_memory_reserved(self.device), int(stats.get("num_alloc_retries", 0))
