"""Plan schema migrations: one pure function per version step, on plain dicts.

``load`` decodes an old file to a dict, runs ``migrate`` and only then decodes the
result strictly as the current ``Plan``. A migration may rename, restructure or fill
a field whose old meaning is unambiguous; it must never invent a decision. When an
old file lacks information the current executor needs, raise ``PlanError`` asking
for the plan to be regenerated instead of guessing.

A migration sees whatever JSON the old file holds, so it touches only what it
changes and leaves every other value (well-formed or not) for the strict decode to
judge: a malformed old file fails with the same JSON-path error as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import PlanError
from .homes import homes_of

REGENERATE = "regenerate the plan with `protrain plan`"
"""The fix of every refusal of a plan file as it stands (plan.py, validation.py use it too)."""


def _add(doc: dict[str, Any], section: str, fields: dict[str, Any], version: int) -> dict[str, Any]:
    """``doc`` with ``fields`` added to its ``section``: pure (the caller's dicts stay as they
    were), and touching only what it adds. A malformed or missing section is left for the
    strict decode to report; a field already there is refused, because the old version's
    binding sections forbid unknown fields and a migration must not make an invalid old
    file valid by accident."""
    body = doc.get(section)
    if not isinstance(body, dict):
        return dict(doc)
    _refuse_new_fields(body, section, fields, version)
    return {**doc, section: {**body, **fields}}


def _refuse_new_fields(body: dict[str, Any], section: str, keys, version: int) -> None:
    """Refuse a version-``version`` ``section`` that already holds one of ``keys``, fields its
    next version adds: the file was probably written for that version, or is invalid."""
    for key in keys:
        if key in body:
            raise PlanError(
                f"plan schema {version} has no `{section}.{key}` (added in schema {version + 1}) "
                f"- at `$.{section}.{key}`",
                f"set `schema_version` to {version + 1} if the file was written for it, or "
                f"{REGENERATE}",
            )


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
    training = doc.get("training")
    dtype = training.get("compute_dtype") if isinstance(training, dict) else None
    return _add(
        doc,
        "schedule",
        {"cpu_adam": "after_backward" if dtype == "float16" else "during_backward"},
        1,
    )


def v2_to_v3(doc: dict[str, Any]) -> dict[str, Any]:
    """Add ``placement.shard_persistent_states = false``: the v2 executor replicated every
    persistent chunk's master and moments on every rank, whatever the world size, so
    that is what a v2 plan was made (and predicted) for."""
    return _add(doc, "placement", {"shard_persistent_states": False}, 2)


def v3_to_v4(doc: dict[str, Any]) -> dict[str, Any]:
    """Add ``placement.homeless = []`` and ``placement.n_host_slots = 0``: the v3 executor
    kept every offloaded chunk's home on the host."""
    return _add(doc, "placement", {"homeless": [], "n_host_slots": 0}, 3)


def v4_to_v5(doc: dict[str, Any]) -> dict[str, Any]:
    """Add ``placement.device_homed = []``: the v4 executor kept every offloaded chunk's
    master and moments on the host."""
    return _add(doc, "placement", {"device_homed": []}, 4)


def v5_to_v6(doc: dict[str, Any]) -> dict[str, Any]:
    """Add ``placement.nvme = []``: the v5 executor kept every offloaded chunk's master and
    moments in host memory (or on the device)."""
    return _add(doc, "placement", {"nvme": []}, 5)


V6_LISTS = ("persistent", "offloaded", "homeless", "device_homed", "nvme")
"""Schema 6's placement id lists, which schema 7's ``placement.homes`` replaces."""


def v6_to_v7(doc: dict[str, Any]) -> dict[str, Any]:
    """Replace the five id lists of ``placement`` by ``placement.homes``, one home per chunk.

    The lists must describe one home per chunk, as the v6 executor required: ``persistent``
    and ``offloaded`` partition the chunk ids; ``homeless``, ``device_homed`` and ``nvme`` are
    offloaded ids; a device-homed chunk is neither homeless nor on disk. A chunk on disk and
    homeless is ``nvme_homeless``. A file whose lists say anything else is refused here,
    naming the list (the v6 validation's checks), since no home would say what it meant.
    """
    placement, chunks = doc.get("placement"), doc.get("chunks")
    items = chunks.get("list") if isinstance(chunks, dict) else None
    if not isinstance(placement, dict) or not isinstance(items, list):
        return doc  # malformed: left to the strict decode
    _refuse_new_fields(placement, "placement", ("homes",), 6)
    n, ids = len(items), {}
    for key in V6_LISTS:
        value = placement.get(key, [])
        if (
            not isinstance(value, list)
            or not all(type(c) is int and 0 <= c < n for c in value)
            or value != sorted(set(value))
        ):
            raise PlanError(
                f"plan schema 6: `placement.{key}` must list chunk ids (0..{n - 1}), ascending "
                f"and unique - at `$.placement.{key}`",
                REGENERATE,
            )
        ids[key] = set(value)

    both = sorted(ids["persistent"] & ids["offloaded"])
    neither = sorted(set(range(n)) - ids["persistent"] - ids["offloaded"])
    if both or neither:
        raise PlanError(
            f"plan schema 6: chunks {both or neither} are "
            f"{'both persistent and offloaded' if both else 'neither persistent nor offloaded'} "
            "- at `$.placement.offloaded`",
            REGENERATE,
        )
    homes = homes_of(
        n, ids["persistent"], ids["homeless"], ids["device_homed"], ids["nvme"], "plan schema 6: "
    )
    # (Key order matters to no one: the strict decode reads any, and `dump` writes the Plan's own.)
    return {
        **doc,
        "placement": {**{k: v for k, v in placement.items() if k not in V6_LISTS}, "homes": homes},
    }


def v7_to_v8(doc: dict[str, Any]) -> dict[str, Any]:
    """Nothing to write: schema 8's ``Param.frozen`` defaults to false, so a schema 7 plan
    (made for training every parameter) says every parameter trains, as it was made for."""
    return doc


MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    1: v1_to_v2,
    2: v2_to_v3,
    3: v3_to_v4,
    4: v4_to_v5,
    5: v5_to_v6,
    6: v6_to_v7,
    7: v7_to_v8,
}
"""``MIGRATIONS[v]`` turns a version-``v`` plan dict into a version-``v + 1`` one."""

SCHEMA_VERSION = max(MIGRATIONS) + 1
"""The version ``plan.dump`` writes: one past the last migration, so a bump without its
migration cannot happen."""


def migrate(doc: dict[str, Any], version: int, target: int | None = None) -> dict[str, Any]:
    """Apply the migrations from ``version`` up to ``target`` (default: the current version)."""
    target = SCHEMA_VERSION if target is None else target
    for v in range(version, target):
        step = MIGRATIONS.get(v)
        if step is None:
            raise PlanError(f"no migration from plan schema {v} to {v + 1}", REGENERATE)
        doc = {**step(doc), "schema_version": v + 1}  # (a copy: the caller's dict stays as it was)
    return doc
