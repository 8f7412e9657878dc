"""Plan schema migrations: one pure function per version step, on plain dicts.

``load`` decodes an old file to a dict, runs ``migrate`` and only then decodes the
result strictly as the current ``Plan``. A migration may rename, restructure or fill
a field whose old meaning is unambiguous; it must never invent a decision. When an
old file lacks information the current executor needs, raise ``PlanError`` asking
for the plan to be regenerated instead of guessing (shared/STYLE.md §4.3).

Version 1 is the only version so far, so ``MIGRATIONS`` is empty; the first bump
adds ``v1_to_v2`` here, registered as ``MIGRATIONS[1]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import PlanError

Migration = Callable[[dict[str, Any]], dict[str, Any]]

MIGRATIONS: dict[int, Migration] = {}
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
