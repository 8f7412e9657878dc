"""The paper's per-block policy layout: a strip of ``keep``/``swap``/``checkpoint`` from its counts.

No numpy and no torch (``protrain show`` and ``explain`` import it); the policies
themselves are declared in plans/homes.py (``POLICIES``).
"""

from __future__ import annotations

from protrain.plans import homes as H


def block_policies(n_blocks: int, n_swap: int, n_checkpoint: int) -> list[str]:
    """The paper's layout (ProTrain, Fig. 2): swaps spread over the first ``n_swap +
    n_checkpoint`` blocks with checkpoints between them, keeps last (``S C C S C C K K``).

    Swap ``i`` sits at ``floor(i · L / n_swap)`` of the non-keep prefix of length ``L``, so
    swaps are as far apart as the prefix allows: each swap-out then has the checkpointed
    blocks after it to hide behind. Keep blocks go last because their activations are
    consumed first in backward, freeing memory for the swapped ones coming back.
    """
    assert 0 <= n_swap and 0 <= n_checkpoint and n_swap + n_checkpoint <= n_blocks, (
        f"{n_blocks=} {n_swap=} {n_checkpoint=}"
    )
    length = n_swap + n_checkpoint
    out = [H.CHECKPOINT.name] * length + [H.KEEP.name] * (n_blocks - length)
    for i in range(n_swap):
        out[(i * length) // n_swap] = H.SWAP.name
    return out
