"""Where the data files that ship with protrain are: ``plans/`` of a source checkout, or the
``protrain.plans`` package data of an installed wheel (``pyproject.toml``: package-data).

Standard library only: ``find_spec`` and ``show`` import it without torch."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SOURCE_PLANS = Path(__file__).resolve().parent.parent / "plans"


def plans_dir() -> Path:
    """The ``plans`` folder: hardware specs (``hardware/``), shipped configs (``configs/``)."""
    found = importlib.util.find_spec("protrain.plans")
    for where in (found.submodule_search_locations or []) if found else []:
        if (Path(where) / "hardware").is_dir():
            return Path(where)
    return SOURCE_PLANS


def shipped_config(name: str) -> Path | None:
    """``plans/configs/NAME``, a Hugging Face config shipped with protrain, if there is one."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    candidate = plans_dir() / "configs" / name
    return candidate if (candidate / "config.json").is_file() else None
