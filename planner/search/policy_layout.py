"""Block policies: what each does with a block's saved activations (the table), and the
paper's layout of a strip of ``keep``/``swap``/``checkpoint`` from its counts.

The planner's stream (memory_walk.py), grids, cost model and views (policy letters) read
the table; the executor runs a plan's policies as executor/activations.py says, and
needs none of it. No numpy and no torch (``protrain show`` and ``explain`` import it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    """What a block's saved activations do between its forward and its backward."""

    name: str
    letter: str
    """Its one-letter name in policy strips (``show``, ``diff``: ``SCCK``)."""
    doc: str
    held: str | None
    """The profile's bytes the block holds on the device after its forward: ``saved`` (all it
    saved), ``inputs`` (only its inputs), or None (nothing)."""
    moves: bool = False
    """Its saved bytes (``swapped``) go to the host after forward and come back before backward."""
    recomputes: bool = False
    """Its forward runs again in backward (its time, and its saved bytes at that moment)."""


KEEP = Policy("keep", "K", "saved activations stay on the device", held="saved")
SWAP = Policy("swap", "S", "saved activations go to host memory during forward and come back before the "
              "block's backward", held=None, moves=True)
CHECKPOINT = Policy("checkpoint", "C", "only the block's inputs are kept; its forward is recomputed in backward",
                    held="inputs", recomputes=True)

POLICIES: dict[str, Policy] = {p.name: p for p in (KEEP, SWAP, CHECKPOINT)}


def held_bytes(policy: str, saved: int, inputs: int) -> int:
    """Device bytes a block holds from its forward to its backward under ``policy``."""
    held = POLICIES[policy].held
    return saved if held == "saved" else inputs if held == "inputs" else 0


def block_policies(n_blocks: int, n_swap: int, n_checkpoint: int) -> list[str]:
    """The paper's layout (ProTrain, Fig. 2): swaps spread over the first ``n_swap +
    n_checkpoint`` blocks with checkpoints between them, keeps last (``S C C S C C K K``).

    Swap ``i`` sits at ``floor(i · L / n_swap)`` of the non-keep prefix of length ``L``, so
    swaps are as far apart as the prefix allows: each swap-out then has the checkpointed
    blocks after it to hide behind. Keep blocks go last because their activations are
    consumed first in backward, freeing memory for the swapped ones coming back.
    """
    assert 0 <= n_swap and 0 <= n_checkpoint and n_swap + n_checkpoint <= n_blocks, \
        f"{n_blocks=} {n_swap=} {n_checkpoint=}"
    length = n_swap + n_checkpoint
    out = [CHECKPOINT.name] * length + [KEEP.name] * (n_blocks - length)
    for i in range(n_swap):
        out[(i * length) // n_swap] = SWAP.name
    return out
