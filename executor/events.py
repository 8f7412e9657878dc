"""What the engine does, as it does it: the one observation interface (``Engine.on_event``).

Profilers, tracers and tests subscribe a callback; the engine calls it with one
frozen ``Event`` at each point below. Nothing else of the executor is an
observation interface: a listener never reads or replaces engine internals.

[Note: events]
Each ``kind`` is a verb of the plan or a phase of the
step. ``begin``/``end`` bracket an operation, ``mark`` is a single moment. All on
the main thread unless the table says otherwise.

=============  ==========  ==================================================================
kind           edge        when (fields besides ``kind``, ``edge``, ``time_s``)
=============  ==========  ==================================================================
step           begin, end  ``Engine.step``: after the batch checks / after the loss is known
                           (``loss``)
segment        begin       the segment's fetches have landed (compute may start) (``phase``,
                           ``segment``)
segment        end         its compute is over, before its offloads and releases (same)
fetch,         begin, end  a chunk's upload is queued between the two (``chunk``, ``nbytes``,
prefetch                   ``stream``); a fetch is waited on before its segment begins, a
                           prefetch not
swap_in        begin, end  one swapped storage's upload (``block``, ``nbytes``, ``stream``)
offload        begin, end  a chunk's gradient download (``chunk``, ``nbytes``, ``stream``)
swap_out       begin, end  one saved storage's download (``block``, ``nbytes``, ``stream``)
release        mark        a chunk's device storage was freed (``chunk``)
land           mark        CPU worker thread: a chunk's gradients reached the host, before they
                           are accumulated (``chunk``)
cpu_step       begin, end  CPU worker thread: a chunk's AdamW update; its new weights are written
                           to the chunk's home after ``end`` (``chunk``)
device_step    begin, end  a persistent or device-homed chunk's AdamW update on the device
                           (``chunk``)
collective     begin, end  a collective (world size > 1) (``detail``: which and of what, e.g.
                           "all-gather of chunk 3"); a fetch's all-gather runs on the copy
                           engine's upload stream (CUDA) or worker thread (CPU emulation)
saved          mark        end of each forward, per segment, when activations are counted
                           (always on CPU; on CUDA if a listener asked): ``nbytes`` (each storage
                           once, the first segment to save it owns it: the ledger's count) and
                           ``swap_bytes`` (what a swap of the segment moves) (``phase``,
                           ``segment``)
=============  ==========  ==================================================================

Copies: ``stream`` is the CUDA stream a copy is queued on (``None`` on a CPU
device, where ``begin``/``end`` of a synchronous copy bracket the copy itself). On
CUDA ``end`` means *queued*: a listener that wants device times records a timing
event on ``stream`` at ``begin`` and at ``end`` (the stream has already been made
to wait for compute, and a swap-in for its swap-out, when ``begin`` is emitted).

Listeners run synchronously on the emitting thread, inside the engine: keep them
short, never call back into the engine, and make them thread-safe (``land`` and
``cpu_step`` come from the CPU AdamW worker while the main thread runs backward).
A listener that sleeps is a legitimate way to perturb timing in tests. With no listener, emitting
costs one truth test.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal[
    "step",
    "segment",
    "fetch",
    "prefetch",
    "swap_in",
    "offload",
    "swap_out",
    "release",
    "land",
    "cpu_step",
    "device_step",
    "collective",
    "saved",
]
Edge = Literal["begin", "end", "mark"]


@dataclass(frozen=True, slots=True)
class Event:
    """One observation; see [Note: events] for which fields each kind fills."""

    kind: Kind
    edge: Edge
    time_s: float = 0.0
    """``time.perf_counter()`` on the emitting thread, when the event was emitted."""
    phase: str = ""
    """``segment``/``saved``: "forward", "backward" or "evaluate"; else ""."""
    segment: str = ""
    """``segment``/``saved``: the plan's segment (``<pre>``, a block path, ``<post>``)."""
    chunk: int | None = None
    """Chunk id (fetch, prefetch, offload, release, land, cpu_step, device_step)."""
    block: str = ""
    """Block path (swap_in, swap_out)."""
    nbytes: int = 0
    """Bytes copied (copies), or saved activation bytes (``saved``)."""
    stream: Any = None
    """Copies on CUDA: the ``torch.cuda.Stream`` the copy is queued on; else None."""
    loss: float | None = None
    """``step`` end: the step's loss (as ``StepResult.loss``)."""
    swap_bytes: int = 0
    """``saved``: bytes a swap of the segment moves (or would move, for a keep block)."""
    detail: str = ""
    """``collective``: the operation and its operand, as in error messages ("all-reduce of the
    loss")."""


Listener = Callable[[Event], None]


class Events:
    """An engine's listeners, and what the copies being issued are for.

    One per engine, shared by its parts (they reach it as ``copies.events``).
    """

    def __init__(self):
        # Replaced, never mutated: the CPU worker may be iterating the old tuple.
        self.listeners: tuple[Listener, ...] = ()
        # Main thread only. The segment whose step began last (labels swap copies), and
        # (kind, chunk, block) of the copies issued inside ``about(...)``.
        self.segment = ""
        self.subject: tuple[Kind, int | None, str] | None = None

    def listen(self, callback: Listener) -> Callable[[], None]:
        """Add ``callback``; returns the function that removes it again."""
        self.listeners += (callback,)

        def remove() -> None:
            self.listeners = tuple(cb for cb in self.listeners if cb is not callback)

        return remove

    def emit(self, kind: Kind, edge: Edge, **fields: Any) -> None:
        if self.listeners:
            event = Event(kind, edge, time.perf_counter(), **fields)
            for callback in self.listeners:
                callback(event)

    def about(self, kind: Kind, chunk: int | None = None, block: str = "") -> Events:
        """``with events.about("prefetch", chunk=3): store.fetch(3)``: the copies issued
        inside are that operation's (the copy engine alone cannot tell a fetch from a prefetch)."""
        self.subject = (kind, chunk, block)
        return self

    def __enter__(self) -> Events:
        return self

    def __exit__(self, *exc) -> None:
        self.subject = None
