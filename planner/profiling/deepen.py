"""A deep model's profile from a shallow one's: the interior block repeated (``deepen``).

``protrain fit`` profiles dozens of sizes of models known to repeat one block; each is
profiled at ``REPLICA_BLOCKS`` blocks (``analytic.analytic_profile``) and extended here,
which tests/test_analytic.py holds equal, byte for byte, to profiling every block (with
LoRA's adapters too). Torch-free: it rewrites a Profile and a parameter signature.
"""

from __future__ import annotations

import math

import msgspec

from protrain.plans.plan import fingerprint

from .profile import Profile

REPLICA_BLOCKS = 4
"""Blocks of the shallow model ``deepen`` replicates: the first, two interior ones (which
must come out equal, the check that the interior is one block repeated) and the last."""


def _renamed(name: str, old: str, new: str) -> str:
    return new + name[len(old) :] if name.startswith(old + ".") else name


def deepen(
    shallow: Profile, signature: list[tuple], n_blocks: int
) -> tuple[Profile, list[tuple]] | None:
    """``shallow``, the analytic profile of a model with ``REPLICA_BLOCKS`` identical blocks,
    extended to the same model with ``n_blocks`` of them, and its parameter ``signature``
    (``check.model_signature`` of the shallow model) likewise; None where the shallow
    profile does not show the block structure this rests on (then profile the deep model).

    A block's counts depend on its own ops and on what its neighbours save and hand it, so
    the first block (after ``<pre>``) and the last (before ``<post>``) are kept as they are,
    and every block between them is the shallow model's second: its second and third must
    be equal to the byte, field by field, else None. Block paths must end in their index
    (``transformer.h.3``), each block's parameters must live under its path and be used by it
    alone, and nothing else may use or tie a block's parameters. ``<pre>`` and ``<post>``
    (embedding, head, loss) do not depend on the depth (tests/test_analytic.py compares
    the result with the deep model's own profile, field by field, for both families)."""
    blocks = shallow.model.blocks
    K = len(blocks)
    if K != REPLICA_BLOCKS or n_blocks < K:
        return None
    stem = blocks[0].removesuffix("0")
    if blocks != [f"{stem}{i}" for i in range(K)] or not stem.endswith("."):
        return None
    deep_blocks = [f"{stem}{i}" for i in range(n_blocks)]
    segs = shallow.segments  # <pre>, K blocks, <post>
    mid, twin = segs[2], segs[3]
    if msgspec.structs.replace(twin, segment=mid.segment) != mid:
        return None
    if any(b in " ".join(x for pair in shallow.model.tied for x in pair) for b in blocks):
        return None

    def owner(name: str) -> int | None:
        return next((i for i, b in enumerate(blocks) if name.startswith(b + ".")), None)

    # The parameters (execution order) and the signature (registration order) must each be
    # what comes before the blocks, then block 0's, 1's, ..., then what comes after.
    def split(names: list[str]) -> tuple[int, int, list[list[int]]] | None:
        owners = [owner(n) for n in names]
        inside = [i for i, o in enumerate(owners) if o is not None]
        if not inside:
            return None
        lo, hi = inside[0], inside[-1] + 1
        if owners[lo:hi] != sorted(owners[lo:hi]) or None in owners[lo:hi]:
            return None
        per = [[i for i in range(lo, hi) if owners[i] == b] for b in range(K)]
        shapes = [[names[i][len(blocks[b]) :] for i in per[b]] for b in range(K)]
        if any(s != shapes[1] for s in shapes) or not shapes[1]:
            return None
        return lo, hi, per

    params = shallow.params
    got_p, got_s = split([p.name for p in params]), split([n for n, _, _ in signature])
    if got_p is None or got_s is None:
        return None
    for p in params:
        o = owner(p.name)
        if (p.uses != [blocks[o]]) if o is not None else any(u in blocks for u in p.uses):
            return None
    # Deep block i comes from shallow block src[i]: the first, the second repeated, the last.
    src = [0] + [1] * (n_blocks - 2) + [K - 1]

    def extend(items: list, got, rename) -> list:
        lo, hi, per = got
        out = list(items[:lo])
        for i, b in enumerate(src):
            out += [rename(items[j], blocks[b], deep_blocks[i]) for j in per[b]]
        return out + list(items[hi:])

    deep_params = extend(
        params,
        got_p,
        lambda p, old, new: msgspec.structs.replace(p, name=_renamed(p.name, old, new), uses=[new]),
    )
    deep_sig = extend(signature, got_s, lambda s, old, new: (_renamed(s[0], old, new), *s[1:]))
    deep_segs = (
        [segs[0]]
        + [msgspec.structs.replace(segs[1 + b], segment=deep_blocks[i]) for i, b in enumerate(src)]
        + [segs[-1]]
    )
    counted = {n: math.prod(shape) for n, shape, _ in deep_sig}
    model = msgspec.structs.replace(
        shallow.model,
        fingerprint=fingerprint(deep_sig, deep_blocks),
        n_params=sum(counted.values()),
        blocks=deep_blocks,
    )
    return msgspec.structs.replace(
        shallow, model=model, segments=deep_segs, params=deep_params
    ), deep_sig
