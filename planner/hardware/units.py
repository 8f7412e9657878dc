"""Quantities as people read them: bytes in binary units, counts in k/M/B.

At the bottom of the planner (hardware holds the machine's quantities), so the search's
refusals, the views and the commands all print sizes the same way.
"""

from __future__ import annotations


def human_bytes(n: int) -> str:
    """``n`` bytes in GiB, MiB or KiB with two decimals (``1.50 GiB``), else ``n B``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def human_count(n: int) -> str:
    """A count with a decimal suffix (``1.50B`` parameters, ``12.00M``), else the number."""
    for unit, size in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
