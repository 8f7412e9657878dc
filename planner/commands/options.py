"""The command line's shared option types and options: dtypes, seeds, learning rates and
betas that refuse what trains nothing, and the model options (``--model`` or
``--hf-config``/``--blocks``) that several commands take. No torch here: ``protrain --help``
imports this module."""

from __future__ import annotations

import click

from .floats import FiniteFloatRange

EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C: 128 + SIGINT."""


DTYPES = click.Choice(["float32", "bfloat16", "float16"])


SEED = click.IntRange(-(2**63), 2**63 - 1)
"""What torch's generators take: an int64."""


class _LearningRate(click.ParamType):
    """A positive, finite float (nan, inf and negative rates train nothing useful)."""

    name = "float"

    def convert(self, value, param, ctx):
        import math

        rate = click.FLOAT.convert(value, param, ctx)
        if not (math.isfinite(rate) and rate > 0):
            self.fail(f"{value!r} is not a positive finite number (e.g. 3e-3)", param, ctx)
        return rate


LEARNING_RATE = _LearningRate()


BETA = FiniteFloatRange(min=0, max=1, max_open=True)
"""One of AdamW's betas: torch.optim.AdamW takes [0, 1)."""


def hf_options(f):
    """``--hf-config PATH`` and ``--blocks PATH``: a Hugging Face model instead of ``--model``."""
    f = click.option(
        "--blocks",
        metavar="PATH",
        default=None,
        help="Module path of the HF block list, e.g. model.layers [default: found automatically].",
    )(f)
    return click.option(
        "--hf-config",
        "hf_config",
        metavar="PATH",
        default=None,
        help="Hugging Face config.json or its directory (weights: model.safetensors "
        "there), instead of --model; read locally, never downloaded. A name "
        "such as mixtral-8x7b that is no path is a config shipped with protrain "
        "(plans/configs).",
    )(f)


REPROBE_HELP = (
    "Measure this machine again instead of reading its cached probe "
    "(~/.cache/protrain; without --hardware, a measured profile uses it)."
)


def model_option(model_name, hf_config, blocks, *, required: bool) -> str | None:
    from ..models.hf import model_name_option

    name = model_name_option(model_name, hf_config, blocks)
    if name is None and required:
        raise click.UsageError("give --model NAME (a zoo model) or --hf-config PATH")
    return name
