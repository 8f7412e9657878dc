"""The search's policy strips as a grid, and what depends on the strips alone.

A search evaluates one grid of per-block policy strips (``keep``/``swap``/``checkpoint``)
at every placement. ``GridTerms`` are the terms of the time and memory models that the
strips decide without the placement (activations held, swapped or recomputed, swap
times, the walk's placement-free part); ``grid_terms`` computes them once per grid and
activation profile. Which policy moves or recomputes comes from plans/homes.py.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from protrain.plans import homes as H

from .memo import per_object
from .terms import Terms

SWAP_OVERHEAD_US = 30.0
"""Host-side cost of swapping one block on a GPU, beyond the copies themselves:
pinned host allocations, a pack/unpack hook call per saved tensor and the event
waits. Without it a swap whose copies hide under compute would cost nothing and
the search would swap blocks even with memory to spare. TODO(#5): measure on a
GPU (the CPU benchmark cannot separate it from the synchronous copy)."""


@dataclass(frozen=True)
class PolicyGrid:
    """Block policies for every ``(n_swap, n_checkpoint)`` pair of a search, as masks."""

    n_swap: np.ndarray  # (G,)
    n_checkpoint: np.ndarray  # (G,)
    swap: np.ndarray  # (G, S) 1 where the segment is a swapped block
    ckpt: np.ndarray  # (G, S) 1 where the segment is a checkpointed block
    cache: dict = field(default_factory=dict, compare=False, repr=False)
    parent: tuple[PolicyGrid, np.ndarray] | None = field(default=None, compare=False, repr=False)
    """``(grid, idx)`` when this grid is rows ``idx`` of another: its strip-only terms are those
    rows."""
    """``grid_terms`` of this grid, per terms' activation arrays (a search evaluates one grid
    at every placement: what depends on the strips alone is computed once)."""


@dataclass(frozen=True)
class GridTerms:
    """What ``evaluate`` and ``memory_terms`` compute from the policy strips alone, (G, S) or
    (G,)."""

    held: np.ndarray  # activations held after forward segment s / until its backward (cumulative)
    swap_out_bytes: np.ndarray  # swapped activations still on the device at forward s (GPU only)
    swapped_in: np.ndarray  # swapped activations back on the device at backward s
    recompute_bytes: np.ndarray  # a checkpointed block's recomputed activations (GPU only)
    host_swap: np.ndarray  # (G,) swapped activations on the host at the turn
    swap_out_us: np.ndarray  # D2H time of each swapped block's activations
    swap_in_us: np.ndarray  # H2D time of the same
    recompute_us: np.ndarray  # a checkpointed block's forward again
    swap_overhead_us: np.ndarray  # (G,) fixed cost per swapped block (GPU)
    comp_b: np.ndarray  # backward compute of segment s, with a checkpointed block's recompute
    swap_out_total_us: (
        np.ndarray
    )  # (G,) the D2H time of every swapped block (a CPU's forward adds it)
    fwd_walk: (
        np.ndarray
    )  # (G,) the memory walk's highest forward step (bytes held, in flight, transient)
    bwd_base: np.ndarray  # each backward step's bytes but the offloaded chunks' open gradients


_MAX_CACHED = 8
"""Activation profiles whose strip-only terms a grid keeps (the oldest go first)."""


class _RowsOf:
    """Rows ``idx`` of a parent grid's ``GridTerms``, each field indexed when first read (a
    sub-grid's evaluation reads a few of them)."""

    def __init__(self, whole: GridTerms, idx: np.ndarray):
        self._whole, self._idx = whole, idx

    def __getattr__(self, name: str):
        if name not in GridTerms.__dataclass_fields__:
            raise AttributeError(name)
        value = getattr(self._whole, name)[self._idx]
        setattr(self, name, value)
        return value


_KEYS: dict = {}


def _key(t: Terms) -> tuple:
    """What ``grid_terms`` reads of ``t``, as a key (once per Terms object, kept while it lives)."""
    arrays = (
        t.saved,
        t.inputs,
        t.saved_tensor,
        t.comp_fwd,
        t.comp_bwd,
        t.shared_grads,
        t.fwd_peak,
        t.bwd_peak,
    )
    return per_object(
        _KEYS,
        t,
        lambda: (
            *(np.asarray(a, dtype=np.float64).tobytes() for a in arrays),
            t.gpu,
            t.swap_out_us_per_byte,
            t.swap_in_us_per_byte,
        ),
    )


def grid_terms(t: Terms, grid: PolicyGrid) -> GridTerms:
    """The strip-only terms of ``grid`` for ``t``'s activation profile, cached on the grid, keyed
    by the values they are computed from (the chunk sizes of one profile share them)."""
    key = _key(t)
    hit = grid.cache.get(key)
    if hit is not None:
        return hit
    if len(grid.cache) >= _MAX_CACHED:
        grid.cache.pop(next((k for k in grid.cache if not isinstance(k, str)), None), None)
    if grid.parent is not None:  # each row is one strip's terms: index the parent's
        whole, idx = grid.parent
        out = _RowsOf(grid_terms(t, whole), idx)
        grid.cache[key] = out
        return out
    # What each policy holds after forward (homes.POLICIES): its strips' mask times that term
    # (whole bytes: the sum is exact). <pre> and <post> are kept.
    mask = {"keep": 1.0 - grid.swap - grid.ckpt, "swap": grid.swap, "checkpoint": grid.ckpt}
    term = {"saved": t.saved, "inputs": t.inputs}
    held_each = sum(mask[p.name] * term[p.held] for p in H.POLICIES.values() if p.held)  # (G, S)
    back_in = grid.swap * t.saved_tensor  # swapped block s back on device during its backward
    # [Swap-out in flight] (memory_terms)
    out_each = grid.swap * t.saved if t.gpu else np.zeros_like(held_each)  # (G, S)
    swap_out = out_each.copy()
    swap_out[:, 1:] += out_each[:, :-1]
    held = np.cumsum(held_each, axis=1)
    # At backward segment s: block s's own activations (swapped in one step earlier) and
    # block s-1's, whose swap-in the schedule issues as segment s begins.
    swapped_in = back_in + np.concatenate([np.zeros((len(grid.swap), 1)), back_in[:, :-1]], axis=1)
    recompute_bytes = grid.ckpt * t.saved if t.gpu else np.zeros_like(held_each)
    swap_out_us = grid.swap * t.saved_tensor * t.swap_out_us_per_byte
    recompute_us = grid.ckpt * t.comp_fwd
    # The walk's byte terms are whole numbers below 2**53, so their float sums are exact in
    # any order: the backward steps' part that no placement changes is summed once here.
    bwd_base = held + swapped_in + t.shared_grads
    if t.gpu:
        bwd_base = bwd_base + recompute_bytes + t.bwd_peak
    out = GridTerms(
        held=held,
        swap_out_bytes=swap_out,
        swapped_in=swapped_in,
        recompute_bytes=recompute_bytes,
        host_swap=grid.swap @ t.saved_tensor,
        swap_out_us=swap_out_us,
        swap_in_us=grid.swap * t.saved_tensor * t.swap_in_us_per_byte,
        recompute_us=recompute_us,
        swap_overhead_us=grid.swap.sum(axis=1) * (SWAP_OVERHEAD_US if t.gpu else 0.0),
        comp_b=t.comp_bwd + recompute_us,
        swap_out_total_us=swap_out_us.sum(axis=1),
        fwd_walk=(held + swap_out + (t.fwd_peak if t.gpu else 0.0)).max(axis=1),
        bwd_base=bwd_base,
    )
    grid.cache[key] = out
    return out


def grid_codes(grid: PolicyGrid):
    """Flat indices into ``(2, S)`` and ``(4, S)`` tables of per-segment values, (G, S) each:
    a forward segment's by whether it is a swapped block; a backward segment's by whether it
    is a checkpointed block and whether the segment before it is a swapped one (what the
    time model's per-segment terms depend on, cost.py ``evaluate``). Cached on the grid."""
    hit = grid.cache.get("codes")
    if hit is None and grid.parent is not None:  # rows of the parent's
        whole, idx = grid.parent
        hit = tuple(c[idx] for c in grid_codes(whole))
        grid.cache["codes"] = hit
    if hit is None:
        G, S = grid.swap.shape
        cols = np.arange(S)
        prev = np.zeros((G, S), dtype=np.int64)
        prev[:, 1:] = grid.swap[:, :-1] > 0
        hit = ((grid.swap > 0) * S + cols, ((grid.ckpt > 0) * 2 + prev) * S + cols)
        grid.cache["codes"] = hit
    return hit


def policy_grid(n_blocks: int, pairs: list[tuple[int, int]]) -> PolicyGrid:
    """The paper's layouts (``block_policies``) for every ``(n_swap, n_checkpoint)`` pair
    (the same grid object for the same pairs: a search runs one grid at every chunk size)."""
    return _policy_grid(n_blocks, tuple(pairs))


@functools.lru_cache(maxsize=16)
def _policy_grid(n_blocks: int, pairs: tuple[tuple[int, int], ...]) -> PolicyGrid:
    # block_policies' layout for every pair at once, as policy indices (G, N): the first
    # n_swap + n_checkpoint blocks checkpointed, swap i at (i * length) // n_swap, the rest kept
    # (tests/test_cost.py holds it equal to strips_grid of block_policies).
    ns = np.array([p[0] for p in pairs], dtype=np.int64).reshape(-1)
    nc = np.array([p[1] for p in pairs], dtype=np.int64).reshape(-1)
    length = ns + nc
    assert (ns >= 0).all() and (nc >= 0).all() and (length <= n_blocks).all(), (n_blocks, pairs)
    index = {name: i for i, name in enumerate(H.POLICIES)}
    code = np.where(
        np.arange(n_blocks) < length[:, None], index[H.CHECKPOINT.name], index[H.KEEP.name]
    )
    rows = np.repeat(np.arange(len(pairs)), ns)
    nth = np.arange(len(rows)) - np.repeat(
        np.cumsum(ns) - ns, ns
    )  # i = 0 … n_swap - 1 within each row
    code[rows, (nth * length[rows]) // np.maximum(ns[rows], 1)] = index[H.SWAP.name]
    return _masks_grid(code)


def strips_grid(strips: Sequence[Sequence[str]]) -> PolicyGrid:
    """Any per-block policy strips (``keep``/``swap``/``checkpoint`` per block) as a grid."""
    S = len(strips[0]) + 2
    assert all(len(strip) == S - 2 for strip in strips), (S - 2, {len(strip) for strip in strips})
    unknown = {p for strip in strips for p in strip} - set(H.POLICIES)
    assert not unknown, unknown
    index = {name: i for i, name in enumerate(H.POLICIES)}
    return _masks_grid(
        np.array([[index[p] for p in strip] for strip in strips], dtype=np.int64).reshape(
            len(strips), S - 2
        )
    )


def _masks_grid(code: np.ndarray) -> PolicyGrid:
    """The grid of per-block policy indices ``code`` (G, N) into ``homes.POLICIES``."""
    G, N = code.shape
    swap = np.zeros((G, N + 2), dtype=np.float64)
    ckpt = np.zeros((G, N + 2), dtype=np.float64)
    # The grid's two masks, from the policies table: blocks whose activations move to the host
    # and back, and blocks recomputed in backward (the rest keep theirs).
    swap[:, 1:-1] = np.array([p.moves for p in H.POLICIES.values()], dtype=np.float64)[code]
    ckpt[:, 1:-1] = np.array([p.recomputes for p in H.POLICIES.values()], dtype=np.float64)[code]
    return PolicyGrid(
        swap.sum(axis=1).astype(np.int64), ckpt.sum(axis=1).astype(np.int64), swap, ckpt
    )
