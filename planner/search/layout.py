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

The chunk size itself is chosen by the planner (``cost.chunk_candidates`` and
``planning.search_chunk_sizes``: least simulated waste over a grid, then the search); here it
is an input.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from protrain.executor.errors import ConfigError

ALIGN_NUMEL = 32
"""Parameter offsets inside a chunk are multiples of this many elements (see above)."""


def aligned(numel: int) -> int:
    """``numel`` rounded up to a multiple of ``ALIGN_NUMEL``."""
    return -(-numel // ALIGN_NUMEL) * ALIGN_NUMEL


@dataclass(frozen=True)
class Slot:
    name: str
    chunk: int
    offset: int
    numel: int


def groups(segments: Sequence[str], uses: dict[str, list[str]], order: Sequence[str]) -> dict[str, str]:
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


def assign(order: Sequence[str], numel: dict[str, int], groups: dict[str, str],
           chunk_numel: int, fresh: Collection[str] = ()) -> list[list[Slot]]:
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
