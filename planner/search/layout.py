"""Chunk layout: parameters, in execution order, packed into fixed-size flat chunks.

Rules (ProTrain §3.1; README "Plan file"):
- Parameters go in first-use order, so the chunks are fetched in the order the
  forward pass needs them and one chunk serves consecutive blocks.
- A block's parameters are not split across two chunks unless the block alone is
  larger than a chunk: if the block does not fit in what is left of the current
  chunk, it starts a new one. Splitting a block would make it wait on two fetches.
- Frozen parameters (a LoRA model's base) go after every trainable one, so adapters share
  a few chunks and a chunk of frozen parameters keeps only its values (``layout_order``).
- A parameter larger than a chunk cannot be laid out: the chunk size must grow.
- Every parameter starts at an offset that is a multiple of ``ALIGN_NUMEL`` elements
  (128 bytes in fp32, 64 in 16-bit). A parameter is a view into its chunk, and BLAS
  sums a matmul in another order when an operand is not aligned (measured on CPU:
  ``g @ W`` with ``W`` at an element offset not a multiple of 4 differs from the
  aligned result in the last bit in about half of random trials), so an unaligned
  view would change the math that plain PyTorch does on its own allocations (#15).

The chunk sizes worth a search are ``chunk_candidates`` (the least padding over a grid of
multiples of the largest segment); ``planning.search_chunk_sizes`` plans each and keeps the
best. ``assign`` takes the size as an input.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Sequence
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

from protrain.plans.errors import ConfigError

from .memo import per_object

ALIGN_NUMEL = 32
"""Parameter offsets inside a chunk are multiples of this many elements (see above)."""


def aligned(numel: int) -> int:
    """``numel`` rounded up to a multiple of ``ALIGN_NUMEL``."""
    return -(-numel // ALIGN_NUMEL) * ALIGN_NUMEL


class Slot(NamedTuple):  # (a tuple: made a few thousand times per plan, as fast as a tuple is made)
    name: str
    chunk: int
    offset: int
    numel: int


def groups(
    segments: Sequence[str], uses: dict[str, list[str]], order: Sequence[str]
) -> dict[str, str]:
    """Layout group of each parameter: the segment that uses it first (``<unused>`` if none),
    so a block — or the embeddings, or the head — stays in one chunk when it fits."""
    out: dict[str, str] = {}
    for s in segments:
        for n in uses[s]:
            out.setdefault(n, s)
    for n in order:
        out.setdefault(n, "<unused>")
    return out


def layout_order(facts) -> tuple[list[str], dict[str, str], set[str]]:
    """What ``assign`` packs ``facts``' parameters by: their order, groups and the parameters
    that start a new chunk. First-use order and ``groups``, except that the frozen parameters
    (``ModelFacts.frozen``) come after every trainable one, from a new chunk, and each
    segment's trainable ones are a group of their own: a LoRA model's adapters share a few
    chunks (persistent, stepped on the device) and the frozen base fills the rest, chunks of
    values only (no master, no moments). Without frozen parameters, the plain layout."""
    grp = groups(facts.segments, facts.uses, facts.order)
    if not facts.frozen:
        return list(facts.order), grp, set()
    trainable = [n for n in facts.order if n not in facts.frozen]
    order = trainable + [n for n in facts.order if n in facts.frozen]
    fresh = {order[len(trainable)]} if trainable and len(order) > len(trainable) else set()
    return order, {n: g if n in facts.frozen else "<trainable>" + g for n, g in grp.items()}, fresh


def assign(
    order: Sequence[str],
    numel: dict[str, int],
    groups: dict[str, str],
    chunk_numel: int,
    fresh: Collection[str] = (),
) -> list[list[Slot]]:
    """Pack parameters into chunks of ``chunk_numel`` elements; return the slots per chunk.

    ``order``: parameter names in first-use order. ``groups``: parameter → group (its
    block path, or the segment name for parameters outside blocks); a group is kept
    in one chunk when it fits in one. ``fresh``: parameters that start a new chunk.
    """
    biggest = max(numel[n] for n in order)
    if biggest > chunk_numel:
        name = max(order, key=lambda n: numel[n])
        raise ConfigError(
            f"parameter {name} has {biggest} elements, more than the chunk size {chunk_numel}",
            f"use a chunk size of at least {biggest} elements",
        )
    group_numel: dict[str, int] = {}  # elements a group takes from an empty chunk, padding included
    for n in order:
        group_numel[groups[n]] = aligned(group_numel.get(groups[n], 0)) + numel[n]

    chunks: list[list[Slot]] = [[]]
    used = 0  # elements used in the current (last) chunk
    current_group = None
    for n in order:
        g = groups[n]
        if g != current_group:
            current_group = g
            # A new group starts: open a new chunk if the whole group would fit in an
            # empty chunk but not in the rest of this one.
            if used and group_numel[g] <= chunk_numel and used + group_numel[g] > chunk_numel:
                chunks.append([])
                used = 0
        used = aligned(used)
        if used + numel[n] > chunk_numel or (used and n in fresh):
            chunks.append([])
            used = 0
        chunks[-1].append(Slot(n, len(chunks) - 1, used, numel[n]))
        used += numel[n]
    return chunks


def chunk_need(facts, chunk_numel: int) -> tuple[list[set[int]], np.ndarray, np.ndarray]:
    """Chunks each segment uses, parameter elements per chunk, and where each chunk's last
    parameter ends (elements), for one chunk size (``ModelFacts`` laid out as ``emit`` does)."""
    need, per_chunk, ends, _ = _layout(_layout_key(facts), chunk_numel)
    return [set(x) for x in need], per_chunk.copy(), ends.copy()


def chunk_trainable(facts, chunk_numel: int) -> np.ndarray | None:
    """(C,) whether each chunk trains (some parameter in it is not frozen, as the executor
    decides: chunks.py [Note: frozen chunks]), or None when no parameter is frozen."""
    if not facts.frozen:
        return None
    return np.array(_layout(_layout_key(facts), chunk_numel)[3], dtype=bool)


_KEYS: dict = {}


def _layout_key(facts) -> tuple:
    """What the layout reads of ``facts``, hashable: ``make_plan`` asks for each chunk size
    several times (candidates, search, terms), and lays it out once. Made once per facts
    object while it lives (ModelFacts are frozen, their lists never written after they are made)."""
    return per_object(
        _KEYS,
        facts,
        lambda: (
            tuple(facts.order),
            tuple(facts.params),
            tuple(facts.segments),
            tuple(tuple(facts.uses[s]) for s in facts.segments),
            facts.frozen,
        ),
    )


@functools.lru_cache(maxsize=32)
def _layout(
    key: tuple, chunk_numel: int
) -> tuple[tuple[frozenset[int], ...], np.ndarray, np.ndarray, tuple[bool, ...]]:
    """``chunk_need``'s three answers and each chunk's trainability, from one ``assign``."""
    order, params, segments, uses, frozen = key
    uses = dict(zip(segments, map(list, uses)))
    numel = {n: math.prod(s) for n, s, _ in params}
    facts = SimpleNamespace(order=list(order), segments=list(segments), uses=uses, frozen=frozen)
    order, grp, fresh = layout_order(facts)  # (what layout_order reads of ModelFacts)
    slots = assign(order, numel, grp, chunk_numel, fresh)
    owner = {s.name: i for i, chunk in enumerate(slots) for s in chunk}
    need = tuple(frozenset(owner[n] for n in uses[s]) for s in segments)
    per_chunk = np.array([sum(s.numel for s in chunk) for chunk in slots], dtype=np.int64)
    ends = np.array([max(s.offset + s.numel for s in chunk) for chunk in slots], dtype=np.int64)
    trains = tuple(any(s.name not in frozen for s in chunk) for chunk in slots)
    return need, per_chunk, ends, trains


CHUNK_GRID = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0)
"""Chunk-size candidates as multiples of the largest segment's (or parameter's) size.

Below 1× a block would straddle chunks and wait on two fetches; above ~4× the
chunks get too coarse for persistence to be chosen finely (a 70B model would have
~20 chunks). Candidates are rounded up to 1024 elements (4 KiB in fp32) so
parameter views stay aligned for vectorised kernels."""


MIN_CHUNKS = 4
"""Candidates giving fewer chunks are used only if none gives this many: with one or
two chunks there is nothing to choose between persistent and offloaded."""


def chunk_candidates(facts) -> tuple[list[int], dict[int, int]]:
    """The chunk sizes worth a search, smallest first, and the waste of every candidate.

    Of ``CHUNK_GRID``'s sizes giving at least ``MIN_CHUNKS`` chunks (else all of them),
    a size is worth searching only if it wastes fewer elements (chunk padding) than
    every smaller one: a larger chunk that also wastes more is coarser on every count
    (persistence and buffers come in bigger steps, more padding rides along). The
    search (``planning.make_plan``) then plans each and keeps the best plan, as the
    paper searches the chunk size too.

    Why not the least waste alone: whole blocks tile a chunk of 1×, 2×, 3×, 4× a
    block equally well, so the waste ties and the old rule (ties to the larger) gave a
    14B GPT-2 (54 × 4608) 1.02B-element chunks (16 GB of persistent state each on a
    24 GB card) and llama-70b 41 chunks of 1.7B. Measured on the plan library (108 cells, 2-core
    CPU, before item 4b): ties to the smaller is never slower and 1.8% faster at the median (25% at
    most); planning every size on this list finds the best plan of all seven sizes in 106 cells
    (mixtral-8x7b on 4x a100-80g / 4x h100: 1.25× is 1.1-1.6% faster, with more waste), and finds
    plans the least-waste size cannot (llama-3.1-8b on one rtx3090 / rtx4090: its 128K-vocabulary
    embedding makes 4× the least wasteful, 4 chunks, and nothing fits; 1.25× plans). The list has 1
    size for most models (1×: blocks tile it), 3 for gpt2-xl and llama-3.1-8b.
    """
    numel = {n: math.prod(s) for n, s, _ in facts.params}
    largest = max(
        max(sum(numel[n] for n in facts.uses[s]) for s in facts.segments), max(numel.values())
    )
    total = sum(numel.values())
    waste, count = {}, {}
    for f in CHUNK_GRID:
        size = -(-int(largest * f) // 1024) * 1024
        _, per_chunk, _ = chunk_need(facts, size)
        waste[size], count[size] = len(per_chunk) * size - total, len(per_chunk)
    fine = sorted(s for s in waste if count[s] >= MIN_CHUNKS)
    if not fine:  # too few chunks whatever the size: the size giving the most, least waste
        return [max(waste, key=lambda s: (count[s], -waste[s], -s))], waste
    out = []
    for size in fine:
        if not out or waste[size] < waste[out[-1]]:
            out.append(size)
    return out, waste


def choose_chunk_numel(facts) -> tuple[int, dict[int, int]]:
    """The candidate with the least wasted elements (ties to the smaller) among those
    giving at least ``MIN_CHUNKS`` chunks (else the one giving the most): the last of
    ``chunk_candidates``; and the waste of every candidate. ``make_plan`` searches all
    of ``chunk_candidates``; this is one size for tools and tests that need one."""
    sizes, waste = chunk_candidates(facts)
    return sizes[-1], waste
