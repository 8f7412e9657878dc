"""protrain's executor: load a plan, check it against the model, replay it.

Public API: ``load``, ``dump``, ``wrap``, ``Engine``, ``StepResult``, ``AdamWConfig``,
``ProtrainError``. The plan-vs-model check is ``protrain.executor.check.check``: it
cannot be re-exported here, because importing the submodule ``check`` rebinds the
package attribute of that name to the module.
Everything that needs torch is resolved lazily (PEP 562 ``__getattr__``): Python
runs this file before any submodule, so an eager torch import here would make
``import protrain.executor.plan`` (used by ``protrain show``) import torch.
"""

from __future__ import annotations

from typing import Any

from .errors import ProtrainError
from .plan import dump, load

__all__ = ["AdamWConfig", "Engine", "ProtrainError", "StepResult", "dump", "load", "wrap"]

# name → the submodule that defines it
_LAZY = {"wrap": "engine", "Engine": "engine", "StepResult": "engine", "AdamWConfig": "optim"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
