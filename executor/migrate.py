"""Plan schema migrations: one pure function per version step, on plain dicts.

``load`` decodes an old file to a dict, runs ``migrate`` and only then decodes the
result strictly as the current ``Plan``. A migration may rename, restructure or fill
a field whose old meaning is unambiguous; it must never invent a decision. When an
old file lacks information the current executor needs, raise ``PlanError`` asking
for the plan to be regenerated instead of guessing (shared/STYLE.md §4.3).

A migration sees whatever JSON the old file holds, so it touches only what it
changes and leaves every other value (well-formed or not) for the strict decode to
judge: a malformed old file fails with the same JSON-path error as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import PlanError

Migration = Callable[[dict[str, Any]], dict[str, Any]]


def v1_to_v2(doc: dict[str, Any]) -> dict[str, Any]:
    """Add ``schedule.cpu_adam``: what the v1 executor did for this plan without clipping.

    The v1 executor chose at run time: it deferred every CPU AdamW step until after
    backward for fp16 (the loss scaler's overflow check needs every gradient first) or
    when clipping was configured, and overlapped them with backward otherwise. fp16 →
    ``after_backward`` is a fact of the plan; for the rest the v1 plan was predicted
    (cost model) and replayed as ``during_backward``. A run that wants clipping on such
    a plan is refused by the executor with the fix (replan with ``--max-grad-norm``),
    so nothing here guesses the user's clipping.
    """
    doc = dict(doc)  # pure: the caller's dict (and its nested ones) stay as they were
    schedule = doc.get("schedule")
    if not isinstance(schedule, dict):
        return doc  # the strict decode reports the missing or malformed section
    if "cpu_adam" in schedule:
        # v1 binding sections forbid unknown fields: do not let a migration make an
        # invalid v1 file valid by accident.
        raise PlanError("plan schema 1 has no `schedule.cpu_adam` (added in schema 2) - at `$.schedule.cpu_adam`",
                        "set `schema_version` to 2 if the file was written for it, or regenerate the plan "
                        "with `protrain plan`")
    training = doc.get("training")
    dtype = training.get("compute_dtype") if isinstance(training, dict) else None
    doc["schedule"] = {**schedule, "cpu_adam": "after_backward" if dtype == "float16" else "during_backward"}
    return doc


def v2_to_v3(doc: dict[str, Any]) -> dict[str, Any]:
    """Add ``placement.shard_persistent_states = false``: the v2 executor replicated every
    persistent chunk's master and moments on every rank, whatever the world size, so
    that is what a v2 plan was made (and predicted) for."""
    doc = dict(doc)  # pure, as v1_to_v2
    placement = doc.get("placement")
    if not isinstance(placement, dict):
        return doc  # the strict decode reports the missing or malformed section
    if "shard_persistent_states" in placement:  # as in v1_to_v2: no accidental validity
        raise PlanError("plan schema 2 has no `placement.shard_persistent_states` (added in schema 3) - "
                        "at `$.placement.shard_persistent_states`",
                        "set `schema_version` to 3 if the file was written for it, or regenerate the plan "
                        "with `protrain plan`")
    doc["placement"] = {**placement, "shard_persistent_states": False}
    return doc


MIGRATIONS: dict[int, Migration] = {1: v1_to_v2, 2: v2_to_v3}
"""``MIGRATIONS[v]`` turns a version-``v`` plan dict into a version-``v + 1`` one."""


def migrate(doc: dict[str, Any], version: int, target: int | None = None) -> dict[str, Any]:
    """Apply the migrations from ``version`` up to ``target`` (default: the current version)."""
    from .plan import SCHEMA_VERSION

    target = SCHEMA_VERSION if target is None else target
    for v in range(version, target):
        step = MIGRATIONS.get(v)
        if step is None:
            raise PlanError(
                f"no migration from plan schema {v} to {v + 1}",
                "regenerate the plan with `protrain plan`",
            )
        doc = step(doc)
        doc["schema_version"] = v + 1
    return doc
