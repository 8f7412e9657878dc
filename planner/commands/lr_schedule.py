"""Learning-rate schedules for ``protrain train``: ``--lr-schedule constant|linear|cosine`` with a
linear warm-up (``--warmup-steps N`` or ``--warmup-ratio R``) and, for cosine, a floor
(``--min-lr-rate F``, a fraction of the peak).

Each schedule is one entry of ``SCHEDULES``; the help text, the validation and the rate all read
it. The rates are transformers' (``get_scheduler``), bit for bit as Python floats, because
people compare a protrain run with the Trainer run they know: the factor functions below copy
the arithmetic of ``transformers.optimization``'s ``lr_lambda`` functions expression for
expression (an equal formula in another order can differ in the last bit), and ``rate``
multiplies as ``torch.optim.lr_scheduler.LambdaLR`` does, ``base_lr * lambda(index)``. LambdaLR
gives optimizer step k (1-based) the rate of index k - 1: the first step of a warm-up runs at
rate 0, as in the Trainer. transformers is not imported here (tests/test_lr_schedule.py compares
against it).

A run's settings (``LrSchedule``) go into its checkpoints (``Engine.save(lr_schedule=…)``); a
resumed run continues the saved schedule: a flag left out takes the saved value, a flag given
with another value is refused, but for ``--lr`` (a new peak, e.g. after a divergence) and, for
a schedule that does not decay, ``--steps`` (a constant run may be extended, as before
schedules existed). ``resolve`` does all of that.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

from protrain.plans.errors import CheckpointError, ConfigError

DEFAULT_LR = 3e-3
"""The peak rate of a new run without ``--lr``."""


# -- the factor of the peak at LambdaLR index i (optimizer step i + 1), as transformers computes it


def _constant(i: int, warmup: int, total: int, min_rate: float) -> float:
    # _get_constant_schedule_with_warmup_lr_lambda (total and min_rate unused)
    if i < warmup:
        return float(i) / float(max(1.0, warmup))
    return 1.0


def _linear(i: int, warmup: int, total: int, min_rate: float) -> float:
    # _get_linear_schedule_with_warmup_lr_lambda
    if i < warmup:
        return float(i) / float(max(1, warmup))
    return max(0.0, float(total - i) / float(max(1, total - warmup)))


def _cosine(i: int, warmup: int, total: int, min_rate: float) -> float:
    # _get_cosine_schedule_with_warmup_lr_lambda with num_cycles 0.5 (get_scheduler's default):
    # transformers >= 4.x defines it with min_lr_rate, and plain "cosine" is min_lr_rate 0.0,
    # where `factor * 1.0 + 0.0` is factor itself.
    if i < warmup:
        return float(i) / float(max(1, warmup))
    progress = float(i - warmup) / float(max(1, total - warmup))
    factor = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))
    factor = factor * (1 - min_rate) + min_rate
    return max(0, factor)


@dataclass(frozen=True)
class Shape:
    """One schedule of ``--lr-schedule``."""

    factor: Callable[[int, int, int, float], float]
    """(LambdaLR index, warm-up steps, total steps, min rate) -> the peak's multiplier."""
    decays: bool
    """Whether the total steps shape it (a resume must then keep the total)."""
    floor: bool
    """Whether it takes ``--min-lr-rate``."""
    transformers: str
    """The name ``transformers.get_scheduler`` knows it by (min_lr_rate as its
    ``scheduler_specific_kwargs`` where ``floor``)."""
    words: str
    """What the rate does after the warm-up, for the help and the run's header."""


SCHEDULES: dict[str, Shape] = {
    "constant": Shape(_constant, False, False, "constant_with_warmup", "stays at the peak"),
    "linear": Shape(_linear, True, False, "linear", "falls in a straight line to 0 at the end"),
    "cosine": Shape(
        _cosine, True, True, "cosine_with_min_lr", "falls along a half cosine to the floor"
    ),
}


def help_text() -> str:
    """``--lr-schedule``'s help: every entry of the table."""
    each = "; ".join(f"{name}: {s.words}" for name, s in SCHEDULES.items())
    return (
        f"How the rate moves after the warm-up (--warmup-steps/--warmup-ratio): {each} (the "
        "floor: --min-lr-rate × --lr); transformers' get_scheduler rates, step for step "
        "[default: constant; on --resume the checkpoint's]."
    )


@dataclass(frozen=True)
class LrSchedule:
    """A run's schedule: what a checkpoint saves and a resume continues."""

    name: str
    """A key of ``SCHEDULES``."""
    peak_lr: float
    """The rate after the warm-up (``--lr``): LambdaLR's ``base_lr``."""
    total_steps: int
    """Optimizer steps of the whole run, resumed parts included (``--steps``)."""
    warmup_steps: int = 0
    """Steps of the linear warm-up from 0 (step 1 runs at rate 0, as in transformers)."""
    min_lr_rate: float = 0.0
    """cosine: the floor as a fraction of ``peak_lr`` (0: transformers' plain cosine)."""

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            near = difflib.get_close_matches(str(self.name), SCHEDULES, n=1)
            raise ConfigError(
                f"learning-rate schedule {self.name!r} is not one of {', '.join(SCHEDULES)}",
                f"did you mean --lr-schedule {near[0]}?" if near else "pick one of them",
            )
        for field, value, least in (
            ("total_steps", self.total_steps, 1),
            ("warmup_steps", self.warmup_steps, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(
                    f"the schedule's {field} is {value!r}; it must be an integer >= {least}",
                    "give a whole number of steps",
                )
        if not _number(self.peak_lr) or not 0 < self.peak_lr < math.inf:
            raise ConfigError(
                f"the peak learning rate is {self.peak_lr!r}; it must be positive and finite",
                "give --lr a positive number such as 3e-4",
            )
        if not _number(self.min_lr_rate) or not 0 <= self.min_lr_rate <= 1:
            raise ConfigError(
                f"--min-lr-rate {self.min_lr_rate!r} is not a fraction of the peak in [0, 1]",
                "give e.g. --min-lr-rate 0.1 (the floor is 10% of --lr)",
            )
        if self.min_lr_rate and not SCHEDULES[self.name].floor:
            raise ConfigError(
                f"--min-lr-rate {self.min_lr_rate:g} sets the floor of a cosine schedule; "
                f"--lr-schedule {self.name} has none",
                "use --lr-schedule cosine, or drop --min-lr-rate",
            )

    def rate(self, step: int) -> float:
        """The rate of optimizer step ``step`` (1-based: ``Engine.steps_done + 1``)."""
        shape = SCHEDULES[self.name]
        return self.peak_lr * shape.factor(
            step - 1, self.warmup_steps, self.total_steps, self.min_lr_rate
        )

    def saved(self) -> dict[str, str | int | float]:
        """The settings as a checkpoint's manifest stores them (``from_saved`` reads them)."""
        return asdict(self)

    @classmethod
    def from_saved(cls, saved: dict, where: str) -> LrSchedule:
        """The settings a checkpoint's manifest holds; a damaged record is refused."""
        names = {f.name for f in fields(cls)}
        try:
            if not names >= saved.keys() >= {"name", "peak_lr", "total_steps"}:
                raise ConfigError(f"fields {sorted(saved)}, expected {sorted(names)}", "")
            return cls(**saved)
        except ConfigError as e:
            raise CheckpointError(
                f"{where}: the manifest's lr_schedule is not one protrain writes ({e.message})",
                "resume from another checkpoint, or restore its manifest.json",
            ) from None

    def describe(self) -> str:
        """The run header's words: ``cosine, peak 0.003, warm-up 2 of 8 steps, floor 0.1×…``."""
        shape = SCHEDULES[self.name]
        warm = f", warm-up {self.warmup_steps} steps" if self.warmup_steps else ""
        floor = f", floor {self.min_lr_rate:g}× the peak" if shape.floor else ""
        over = f" over {self.total_steps} steps" if shape.decays else ""
        return f"{self.name} schedule{over}, peak {self.peak_lr:g}{warm}{floor}"


def _number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


@dataclass(frozen=True)
class Flags:
    """What the user gave (None: left out), before a checkpoint's settings fill the gaps."""

    name: str | None = None
    lr: float | None = None
    warmup_steps: int | None = None
    warmup_ratio: float | None = None
    min_lr_rate: float | None = None

    def check(self) -> None:
        """What is wrong whatever a checkpoint holds: both warm-up flags, a ratio out of [0, 1]."""
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            raise ConfigError(
                f"--warmup-steps {self.warmup_steps} and --warmup-ratio {self.warmup_ratio:g} both "
                "set the warm-up",
                "give one of them",
            )
        if self.warmup_ratio is not None and not (
            _number(self.warmup_ratio) and 0 <= self.warmup_ratio <= 1
        ):
            raise ConfigError(
                f"--warmup-ratio {self.warmup_ratio!r} is not a fraction of the run in [0, 1]",
                "give e.g. --warmup-ratio 0.03 (3% of the steps), or --warmup-steps N",
            )

    def warmup(self, total_steps: int) -> int | None:
        """The warm-up in steps; a ratio as transformers resolves it (``math.ceil``)."""
        if self.warmup_ratio is not None:
            return math.ceil(self.warmup_ratio * total_steps)
        return self.warmup_steps


def resolve(
    flags: Flags,
    total_steps: int,
    saved: dict | None = None,
    *,
    where: str = "the checkpoint",
    total_flag: str = "--steps",
) -> LrSchedule:
    """The schedule of a run of ``total_steps`` optimizer steps: from ``flags`` alone (a new
    run, or a checkpoint saved before schedules were), or continuing ``saved`` (a checkpoint's
    ``lr_schedule``), where a left-out flag takes the saved value and a different one is refused
    (module docstring). ``total_flag``: what set ``total_steps``, for the messages."""
    flags.check()
    warmup = flags.warmup(total_steps)
    old = LrSchedule.from_saved(saved, where) if saved else None
    name = flags.name or (old.name if old else "constant")
    if flags.min_lr_rate is not None and not SCHEDULES.get(name, SCHEDULES["cosine"]).floor:
        raise ConfigError(
            f"--min-lr-rate sets the floor of a cosine schedule; --lr-schedule {name} has none"
            + ("" if flags.name else f" (the schedule of {where})"),
            "use --lr-schedule cosine, or drop --min-lr-rate",
        )
    if old is None:
        if warmup is not None and warmup > total_steps:
            raise ConfigError(
                f"the warm-up ({warmup} steps) is longer than the run ({total_flag} "
                f"{total_steps}): the rate would never reach --lr",
                f"give --warmup-steps at most {total_steps}, or a longer run",
            )
        return LrSchedule(
            name=name,
            peak_lr=DEFAULT_LR if flags.lr is None else flags.lr,
            total_steps=total_steps,
            warmup_steps=warmup or 0,
            min_lr_rate=flags.min_lr_rate or 0.0,
        )
    decays = SCHEDULES[old.name].decays
    warmup_flag = "--warmup-steps" if flags.warmup_ratio is None else "--warmup-ratio"
    for flag, given, kept in (
        ("--lr-schedule", flags.name, old.name),
        (warmup_flag, warmup, old.warmup_steps),
        ("--min-lr-rate", flags.min_lr_rate, old.min_lr_rate),
        (total_flag, total_steps if decays else None, old.total_steps),
    ):
        if given is not None and given != kept:
            shown = _show(given)
            if flag == "--warmup-ratio":
                shown = f"{flags.warmup_ratio:g} (= {given} steps of {total_steps})"
                kept = f"{kept} steps: --warmup-steps {kept}"
            raise ConfigError(
                f"{flag} {shown}, but {where} continues a {old.describe()}, saved with "
                f"{flag} {_show(kept)}",
                f"leave {flag} out (a resumed run continues the checkpoint's schedule) or give "
                f"{_show(kept)}; to change the schedule, start a new run without --resume",
            )
    return LrSchedule(
        name=old.name,
        peak_lr=old.peak_lr if flags.lr is None else flags.lr,  # a new peak: module docstring
        total_steps=old.total_steps if decays else total_steps,
        warmup_steps=old.warmup_steps,
        min_lr_rate=old.min_lr_rate,
    )


def _show(x: object) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)
