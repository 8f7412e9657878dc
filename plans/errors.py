"""User-facing errors of protrain.

Every error a user can cause (a bad plan file, a plan for another model, a budget
too small, a bad command-line value) is a ``ProtrainError``. Its message says what
went wrong, where (file, JSON path, parameter or block name), what was expected and
what was found, and ends with a ``HINT:`` line naming one command or change that
fixes it. The CLI prints the message as one paragraph and exits with status 1;
internal invariants use ``AssertionError`` instead.

No torch here: the plan tools (show, diff, validate) import this module.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ProtrainError(Exception):
    """Base class of every error a user can cause and fix."""

    def __init__(self, message: str, hint: str | None = None):
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\nHINT: {hint}")


class PlanError(ProtrainError):
    """A plan file is unreadable, of an unsupported version, or inconsistent."""


class FingerprintError(ProtrainError):
    """A plan was made for another model (parameter names, shapes, dtypes or blocks differ)."""


class BudgetError(ProtrainError):
    """A plan or request cannot fit the memory it is given."""


class HostMemoryError(BudgetError):
    """A plan cannot fit the host memory it may use (offloaded states, swapped activations)."""

    def __init__(self, message: str, hint: str | None = None, *, need: int = 0, available: int = 0):
        super().__init__(message, hint)
        self.need = need  # bytes per rank the least hungry configuration needs
        self.available = available  # bytes per rank it may use


class ConfigError(ProtrainError):
    """A bad user input other than a plan: unknown model name, bad data file, bad option value."""


class ProfileError(ConfigError):
    """A profile file is unreadable, of an unsupported version, or inconsistent."""


class NonFiniteLossError(ProtrainError):
    """The loss became NaN or infinite (without fp16 loss scaling, which skips such steps)."""


class NonFiniteGradientError(ProtrainError):
    """A gradient became NaN or infinite (without fp16 loss scaling, which skips such steps)."""

    def __init__(self, message: str, hint: str | None = None, *, partial: bool = True):
        super().__init__(message, hint)
        self.partial = partial  # some chunk had stepped this step: the state is not a whole step's


class CheckpointError(ProtrainError):
    """A checkpoint directory is missing, incomplete, corrupted, or for another model."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Return ' (did you mean X?)' for the closest of `choices`, or '' when none is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
