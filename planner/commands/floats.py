"""Float options that must be finite: click's ``FloatRange`` lets ``nan`` through every bound
(each comparison with NaN is false) and ``inf`` through an open upper one, so ``--eps inf``
trained nothing and ``--lora-alpha nan`` poisoned the adapters (issue 39 item 11)."""

from __future__ import annotations

import math

import click


class FiniteFloatRange(click.FloatRange):
    """A ``click.FloatRange`` that refuses ``nan`` and ``±inf`` as a usage error."""

    def convert(self, value, param, ctx):
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(number, param, ctx)
