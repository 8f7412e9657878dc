"""``--lora`` and its companions: the LoRA settings as plain data (no torch, no peft), so the
CLI's options import fast; planner/models/lora.py does the work."""

from __future__ import annotations

from protrain.plans.errors import ConfigError

from ..models.lora_spec import LoraSpec


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
                help=(
                    "LoRA fine-tuning through peft: adapters train, the base is frozen (values "
                    "only)."
                ),
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
                help=(
                    "Comma-separated module names to adapt [default: the family's attention "
                    "projections]."
                ),
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


def closing_note(plan, lora: LoraSpec, host_budget: int | None = None) -> str:
    """What ``protrain plan --lora`` says last: trainable share, predicted tokens/s, and what
    full training of the same model would need on the host (the least a plan without the
    disk keeps per parameter: a homeless chunk's master and moments, homes.HOMELESS)."""
    from protrain.plans import homes as H

    from ..hardware.units import human_bytes
    from ..search import memory_walk

    t = plan.training
    n_all = plan.model.n_params
    n_train = sum(p.numel for c in plan.chunks.items for p in c.params if not p.frozen)
    iter_us = plan.prediction.iter_time_us
    tok = (
        t.micro_batch * t.seq_len * t.grad_accum * t.world_size / (iter_us / 1e6)
        if iter_us
        else 0.0
    )
    walk = memory_walk.walk(plan)
    su = H.Setup(t.compute_dtype, t.grad_accum)
    per = min(
        H.HOMELESS.per_elem(su, "host")
        if H.HOMELESS.refusal(su, "during_backward") is None
        else H.HOST.per_elem(su, "host"),
        H.HOST.per_elem(su, "host"),
    )
    full = n_all * per // t.world_size
    fits = (
        ""
        if host_budget is None
        else (
            " (fits the host budget)"
            if full <= host_budget
            else f" - more than the {human_bytes(host_budget)} host budget: "
            "full training needs the NVMe tier (--nvme) or more ranks"
        )
    )
    return (
        f"lora     {lora.describe()}: {n_train:,} of {n_all:,} parameters train "
        f"({100 * n_train / n_all:.2f}%); predicted {tok:,.0f} tokens/s, host "
        f"{human_bytes(walk.host_bytes)} ({walk.host_bytes / max(1, n_all - n_train):.2f} B per "
        "frozen parameter)\n"
        f"full     training all {n_all:,} parameters would keep at least {per} B each on the host: "
        f"{human_bytes(full)} per rank{fits}"
    )
