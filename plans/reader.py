"""Reading a plan file: bytes from disk, decoded (``plan.decode``), then checked.

This is the top of the contract's import order (errors < homes, bounds < migrate < plan <
validation < reader): ``load`` is the one way in for every reader of plans, the executor
and the plan tools alike, and it never returns a partly checked plan.
"""

from __future__ import annotations

from pathlib import Path

from .errors import PlanError
from .plan import MAX_PLAN_BYTES, Plan, decode
from .validation import validate


def load(source: str | Path | bytes) -> Plan:
    """Read and validate a plan: header → version window → migrate → strict decode → checks.

    Raises ``PlanError`` naming the file, the JSON path and the fix; never returns a
    partly checked plan. Loading never executes code (msgspec decodes into Structs).
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        data, where = bytes(source), "<plan bytes>"
    else:
        where = str(source)
        try:
            with open(source, "rb") as f:
                data = f.read(MAX_PLAN_BYTES + 1)
        except OSError as e:
            raise PlanError(
                f"{where}: cannot read the plan file ({e.strerror or e})",
                "check the path, or make a plan with `protrain plan`",
            ) from None
    if len(data) > MAX_PLAN_BYTES:
        raise PlanError(
            f"{where}: larger than {MAX_PLAN_BYTES >> 20} MiB; no plan is that big",
            "check the path: is this a plan file?",
        )
    plan = decode(data, where)
    validate(plan, where)
    return plan
