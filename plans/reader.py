"""Reading a plan file: bytes from disk, decoded (``plan.decode``), then checked.

This is the top of the contract's import order (errors < homes, bounds < migrate < plan <
validation < reader): ``load`` is the one way in for every reader of plans, the executor
and the plan tools alike, and it never returns a partly checked plan.
"""

from __future__ import annotations

import os
import stat
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
            # Asked before the file is opened (issue 39 item 11): see ``special_file``.
            if (kind := special_file(source)) is not None:
                raise PlanError(
                    f"{where}: is {kind}, not a regular file; a plan is a JSON file",
                    "give the path of a plan file (`protrain plan … -o FILE` writes one)",
                )
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


def special_file(path: str | os.PathLike) -> str | None:
    """What ``path`` is when it is not a regular file ("a FIFO (named pipe)", "a device", ...),
    else None: asked before a file is opened, since opening a FIFO waits for a writer (forever)
    and a device reads without end. The ``stat``'s own ``OSError`` propagates."""
    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a socket" if stat.S_ISSOCK(mode) else "not a regular file"
