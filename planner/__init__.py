"""protrain's planner: profile a model, search a memory plan, write the plan file.

The planner is organised by concern, one sub-package each:

- ``models``: the plain-PyTorch zoo, Hugging Face configs (``hf``), mixture-of-experts
  charging (``moe``), and the token data training reads (``data``);
- ``hardware``: the spec format (``spec``), datasheet cards, and the probes that measure
  a machine (``probe``) and its disk;
- ``profiling``: the execution graph, the Profile (``profile``: measured), and analytic
  profiles from a hardware spec (``analytic``);
- ``search``: the cost model, host tiers, the exhaustive and MILP searches, chunk layout,
  and emission of the plan (``planning.make_plan`` ties them together);
- ``views``: ``show``/``explain``, ``diff``, traces and memory plots;
- ``commands``: the ``protrain`` click group and the work behind its commands.

This module is the public face: the names below are what tools and users call. They are
imported on first use, not here, so ``protrain --help``, ``show`` and ``validate`` start
without torch, networkx or scipy::

    from protrain.planner import analytic_profile, build, find_spec, make_plan
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    # models
    "ZOO": "models.zoo",
    "build": "models.zoo",
    "block_paths": "models.zoo",
    "describe": "models.zoo",
    "GPT2Config": "models.zoo",
    "LlamaConfig": "models.zoo",
    "materialize": "models.zoo",
    "lm_loss": "models.zoo",
    "from_model": "models.hf",
    "load_config": "models.hf",
    "load_tokens": "models.data",
    "batches": "models.data",
    "tokenize": "models.data",
    # hardware
    "HardwareSpec": "hardware.spec",
    "find_spec": "hardware.spec",
    "load_spec": "hardware.spec",
    "dump_spec": "hardware.spec",
    "default_host_budget": "hardware.spec",
    "host_budget_per_rank": "hardware.spec",
    "probe": "hardware.probe",
    # profiling
    "Profile": "profiling.profile",
    "measure": "commands.measure",
    "load_profile": "profiling.profile",
    "dump_profile": "profiling.profile",
    "analytic_profile": "profiling.analytic",
    # search
    "make_plan": "search.planning",
    "parse_budget": "search.planning",
    "emit": "search.emit",
    # views
    "render_show": "views.show",
    "render_explain": "views.show",
    "render_diff": "views.diff",
    "predicted_trace": "views.trace",
    "record_trace": "views.trace",
    # commands
    "train": "commands.train",
    "largest_fitting": "commands.fit",
    "fit_model": "commands.fit_config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """Import the sub-module that defines ``name`` on first use (PEP 562)."""
    try:
        where = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
