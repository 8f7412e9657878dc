"""What a plan names: its segments and the fingerprint of the model it was made for.

Plain functions of a plan's data (no torch), below ``plan.py`` so that its companions
(``validation``, ``check``) use them without importing the schema module that uses them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import Plan

PRE = "<pre>"
"""Segment name of everything the model runs before its first block."""

POST = "<post>"
"""Segment name of everything the model runs after its last block (head and loss)."""


def fingerprint(params: Iterable[tuple[str, Sequence[int], str]], blocks: Sequence[str]) -> str:
    """Hash of the sorted (name, shape, dtype) list plus the block list.

    The executor computes it from the live model (``check.py``) and refuses a plan
    whose fingerprint differs. Canonical JSON keeps it identical on every machine.
    """
    entries = sorted([name, [int(s) for s in shape], str(dtype)] for name, shape, dtype in params)
    payload = json.dumps({"params": entries, "blocks": list(blocks)}, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(payload.encode()).hexdigest()


def plan_fingerprint(plan: Plan) -> str:
    """The fingerprint recomputed from the parameters listed in the plan's chunks."""
    params = [(p.name, p.shape, p.dtype) for c in plan.chunks.items for p in c.params]
    return fingerprint(params, plan.model.blocks)


def segments(plan: Plan) -> list[str]:
    """Forward segment order: ``<pre>``, the blocks, ``<post>``."""
    return [PRE, *plan.model.blocks, POST]
