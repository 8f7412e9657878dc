"""``--lora`` and its companions: the LoRA settings as plain data (no torch, no peft), so the
CLI's options import fast; planner/models/lora.py does the work."""

from __future__ import annotations

from dataclasses import dataclass

from protrain.executor.errors import ConfigError


@dataclass(frozen=True)
class LoraSpec:
    """``protrain plan/train --lora``'s settings (peft's ``LoraConfig`` fields)."""

    r: int = 16
    alpha: float = 32
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None
    """Module names (the last part of a path) to adapt; None: the family's attention projections."""

    def describe(self) -> str:
        targets = self.targets or ("the attention projections",)
        return (
            f"LoRA r={self.r} alpha={self.alpha:g} dropout={self.dropout:g} on {', '.join(targets)}"
        )


def click_options(f):
    """``--lora``, ``--lora-r``, ``--lora-alpha``, ``--lora-dropout``, ``--lora-targets``
    (passed to the command as keyword arguments; ``spec_from`` reads them)."""
    import click

    from .floats import FiniteFloatRange

    for opt in reversed(
        [
            click.option(
                "--lora",
                "lora",
                is_flag=True,
                help="LoRA fine-tuning through peft: adapters train, the base is frozen (values only).",
            ),
            click.option(
                "--lora-r",
                "lora_r",
                type=click.IntRange(1),
                default=16,
                show_default=True,
                help="LoRA rank (with --lora).",
            ),
            click.option(
                "--lora-alpha",
                "lora_alpha",
                type=FiniteFloatRange(min=0, min_open=True),
                default=32.0,
                show_default=True,
                help="LoRA alpha (scale alpha/r; with --lora).",
            ),
            click.option(
                "--lora-dropout",
                "lora_dropout",
                type=FiniteFloatRange(0, 1, max_open=True),
                default=0.0,
                show_default=True,
                help="Dropout on the adapters' input (with --lora).",
            ),
            click.option(
                "--lora-targets",
                "lora_targets",
                default=None,
                metavar="NAMES",
                help="Comma-separated module names to adapt [default: the family's attention projections].",
            ),
        ]
    ):
        f = opt(f)
    return f


def spec_from(
    lora: bool = False,
    lora_r: int = 16,
    lora_alpha: float = 32.0,
    lora_dropout: float = 0.0,
    lora_targets: str | None = None,
) -> LoraSpec | None:
    """The ``LoraSpec`` of ``click_options``' values, or None without ``--lora`` (whose
    companions are then refused, not ignored)."""
    if not lora:
        if lora_r != 16 or lora_alpha != 32.0 or lora_dropout != 0.0 or lora_targets is not None:
            raise ConfigError(
                "--lora-r, --lora-alpha, --lora-dropout and --lora-targets go with --lora",
                "add --lora",
            )
        return None
    targets = (
        tuple(t.strip() for t in lora_targets.split(",") if t.strip())
        if lora_targets is not None
        else None
    )
    if targets == ():
        raise ConfigError(
            f"--lora-targets {lora_targets!r} names no module",
            "name the modules to adapt, e.g. --lora-targets q_proj,v_proj, or drop the option "
            "for the family's attention projections",
        )
    return LoraSpec(r=lora_r, alpha=lora_alpha, dropout=lora_dropout, targets=targets)
