"""Placements: which chunks are persistent, and what the cost model reads of one.

A placement is a count ``n_persist`` (the first chunks in execution order, the paper's
space) or the persistent chunk ids themselves (any subset, the MILP's). ``cost.evaluate``
prices one placement at several buffer counts and over a grid of strips; what it reads of
the Terms alone (``fixed_terms``) and of the placement alone (``placed``: the offloaded
mask, their host bytes, uploads and offloads, the CPU steps' order) is computed here once
and read again, the same values each time. The placement's share of the memory walk
(``placement_memory``) and the fewest buffers it needs (``min_buffers``) are here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .memo import last_call, per_object
from .memory_walk import ALPHA_GPU
from .terms import Terms

Placement = int | Sequence[int]
"""Which chunks are persistent: a count ``n_persist`` (the first chunks in execution
order, the paper's space) or the persistent chunk ids themselves (any subset)."""


def offload_mask(t: Terms, persist: Placement) -> np.ndarray:
    """(C,) 1 for each offloaded chunk of ``persist`` (see ``Placement``)."""
    if isinstance(persist, (int, np.integer)):
        return (np.arange(t.n_chunks) >= persist).astype(np.int64)
    off = np.ones(t.n_chunks, dtype=np.int64)
    off[np.asarray(list(persist), dtype=np.int64)] = 0
    return off


def host_bytes_per_chunk(t: Terms) -> np.ndarray:
    """(C,) host bytes per rank of each chunk, offloaded (``accounting.state_events``): a frozen
    one's home only."""
    if t.trainable is None:
        return t.host_numel * t.host_bytes_per_elem
    return t.host_numel * np.where(t.trainable, t.host_bytes_per_elem, t.frozen_host_bytes_per_elem)


def persist_bytes_per_chunk(t: Terms) -> np.ndarray:
    """(C,) device bytes of each chunk if persistent: a frozen one's values only."""
    return np.where(t.trainable, t.persist_chunk_bytes, t.frozen_persist_bytes)


def trains(t: Terms, off: np.ndarray) -> np.ndarray:
    """``off`` (a (C,) chunk mask) less the frozen chunks: those that step."""
    return off if t.trainable is None else off * t.trainable


def placement_memory(
    t: Terms, off: np.ndarray, n_buffer: int
) -> tuple[float, float, np.ndarray, float]:
    """``MemoryTerms``' parts that the placement decides and the strips do not: ``states``,
    ``resident``, ``grads``, ``alpha`` (what ``evaluate`` adds to ``grid_terms``' walk)."""
    n_off = int(off.sum())
    states = (
        (t.n_chunks - n_off) * t.persist_chunk_bytes
        if t.trainable is None
        else int(persist_bytes_per_chunk(t) @ (1 - off))
    )  # (frozen chunks: their values only)
    return (
        states,
        min(n_buffer, n_off) * t.chunk_bytes,
        (t.grad_live @ off) * t.chunk_bytes,
        ALPHA_GPU if t.gpu else 1.0,
    )


def min_buffers(t: Terms, persist: Placement) -> int:
    """Fewest buffers a schedule needs: the most offloaded chunks one segment uses at once."""
    off = offload_mask(t, persist)
    return int((t.uses @ off).max()) if off.any() else 0


_FIXED: dict = {}


def fixed_terms(t: Terms) -> dict:
    """What ``evaluate`` reads of ``t`` whatever the placement, computed once per Terms object
    (kept while it lives; Terms are frozen and their arrays never written after make_terms)."""
    return per_object(_FIXED, t, lambda: _fixed_terms(t))


def _fixed_terms(t: Terms) -> dict:
    again = t.up_bwd * (
        np.cumsum(t.up_bwd[::-1], axis=0)[::-1] > 1
    )  # backward uses after a chunk's first
    ss, cs = np.nonzero(t.offload_at)
    by_step = np.lexsort((cs, -ss))  # backward order: s descending, then c
    out = {
        "uploads_f": t.up_fwd.sum(axis=0),  # (C,) forward uploads of each chunk
        "up_bwd_again": again,
        "uploads_b_cached": again.sum(axis=0),
        "uploads_b": t.up_bwd.sum(axis=0),
        "host_per_chunk": host_bytes_per_chunk(t),
        # (s, c) of every chunk's gradients leaving, in backward order (s descending, then c)
        "offload_steps": [(int(ss[i]), int(cs[i])) for i in by_step],
        "offload_s": ss[by_step],
        "offload_c": cs[by_step],
        "n_params": int(t.chunk_params.sum()),
        # chunks by their last forward use, latest first (ties: the higher id)
        "last_used_first": np.array(
            sorted(range(t.n_chunks), key=lambda c: (-t.last_fwd_use[c], -c)), dtype=np.int64
        ),
    }
    return out


@dataclass(frozen=True)
class Placed:
    """What ``evaluate`` reads of one placement whatever the buffers and strips (the
    expressions it had inline: the same values)."""

    off: np.ndarray  # (C,) offloaded chunks
    order: np.ndarray  # offloaded chunks by their last forward use, latest first
    trains: np.ndarray  # (C,) offloaded chunks that step
    host: float  # their host bytes with every home kept, scratch included
    n_up_f: np.ndarray  # (S,) chunks uploaded for forward segment s
    up_f: np.ndarray  # (S,) their upload time
    in_use: np.ndarray  # (S,) offloaded chunks segment s uses
    grad_down: np.ndarray  # (S,) gradients leaving at segment s's end
    n_params_off: int
    n_trains_dev: int  # persistent chunks that step
    steps: tuple  # fixed["offload_steps"] of offloaded chunks
    offload_s: np.ndarray  # their segments
    cpu_us: np.ndarray  # their CPU steps' time


_LAST_PLACED: list = [None]
"""``(t, placement, Placed)`` of the last ``placed``: the search evaluates one placement at
several buffer counts in a row."""


def placed(t: Terms, persist: Placement, fixed: dict) -> Placed:
    """``Placed`` of ``persist`` (``fixed``: ``fixed_terms(t)``); the last one again for the same
    Terms object and placement (its arrays are read-only)."""
    key = int(persist) if isinstance(persist, (int, np.integer)) else tuple(int(c) for c in persist)
    return last_call(_LAST_PLACED, t, key, lambda: _placed(t, persist, fixed))


def _placed(t: Terms, persist: Placement, fixed: dict) -> Placed:
    off = offload_mask(t, persist)
    order = fixed["last_used_first"]
    on = off[fixed["offload_c"]] > 0
    n_up_f = t.up_fwd @ off
    stepping = trains(t, off)
    for a in (off, n_up_f):  # (shared by the calls last_call answers)
        a.flags.writeable = False
    return Placed(
        off=off,
        order=order[off[order] > 0],
        trains=stepping,
        host=float(fixed["host_per_chunk"] @ off) + (t.host_scratch_bytes if stepping.any() else 0),
        n_up_f=n_up_f,
        up_f=n_up_f * t.t_up,
        in_use=t.uses @ off,
        grad_down=t.offload_at @ off * t.t_down,
        n_params_off=int(t.chunk_params @ off),
        n_trains_dev=int(trains(t, 1 - off).sum()),
        steps=tuple(st for st, o in zip(fixed["offload_steps"], on.tolist()) if o),
        offload_s=fixed["offload_s"][on],
        cpu_us=t.chunk_params[fixed["offload_c"][on]] * t.cpu_adam_us_per_param,
    )
