"""protrain's executor: load a plan, check it against the model, replay it.

Public API: ``load``, ``dump``, ``wrap``, ``Engine``, ``StepResult``, ``AdamWConfig``,
``ProtrainError``. The plan-vs-model check is ``protrain.executor.check.check``: it
cannot be re-exported here, because importing the submodule ``check`` rebinds the
package attribute of that name to the module.
``load`` and ``dump`` are the plan contract's (``protrain.plans``), re-exported.
Everything that needs torch is resolved lazily (PEP 562 ``__getattr__``): Python
runs this file before any submodule, so an eager torch import here would make
``import protrain.executor.events`` (read by the planner's trace) import torch.
"""

from __future__ import annotations

from typing import Any

from protrain.plans import dump, load
from protrain.plans.errors import ProtrainError

__all__ = ["AdamWConfig", "Engine", "ProtrainError", "StepResult", "dump", "load", "wrap"]

# name → the submodule that defines it
_LAZY = {"wrap": "engine", "Engine": "engine", "StepResult": "engine", "AdamWConfig": "optim"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
