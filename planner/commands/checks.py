"""Checks of what a command is given, before anything runs: training flags, checkpoint roots.

The executor never sees a flag or a directory before ``wrap``; these checks, moved here
from it, refuse a command's inputs with the executor's own limits and names: the bounds
of plans/bounds.py (the same a plan's fields are held to) and the names a checkpoint
root holds (executor/checkpoint.py [Note: one run per root]).
"""

from __future__ import annotations

from pathlib import Path

from protrain.executor.checkpoint import OWN_NAMES, STEP_DIR
from protrain.plans.bounds import TRAINING_LIMITS, training_excess
from protrain.plans.errors import CheckpointError, ConfigError


def check_flags(**values: int | None) -> None:
    """Refuse command-line training values (``micro_batch=``, ``seq_len=``, …) over their limits."""
    for field, value, limit, what in training_excess(
        {k: v for k, v in values.items() if v is not None}
    ):
        if field == "tokens":
            raise ConfigError(
                f"--batch {values['micro_batch']} --seq {values['seq_len']}: {value:,} {what} is "
                f"more than protrain can allocate or iterate (at most {limit:,})",
                f"give a --batch and --seq whose product is at most {limit}",
            )
        flag = TRAINING_LIMITS[field][1]
        raise ConfigError(
            f"{flag} {value}: {value:,} {what} is more than protrain can allocate or "
            f"iterate (at most {limit:,})",
            f"give {flag} {limit} or less",
        )


def check_root(root: str | Path, flag: str = "--save-dir") -> None:
    """Refuse a non-empty directory that holds no checkpoint (not a root a run saved into):
    pruning and sweeping would share it with files that are not protrain's."""
    root = Path(root)
    if not root.is_dir():
        return
    names = [p.name for p in root.iterdir()]
    if names and not any(STEP_DIR.fullmatch(n) or n == "latest" for n in names):
        foreign = sorted(n for n in names if not OWN_NAMES.fullmatch(n))
        if foreign:
            raise CheckpointError(
                f"{flag} {root} holds {', '.join(foreign[:3])}{' …' if len(foreign) > 3 else ''} "
                "and no checkpoint: a checkpoint root is protrain's alone (old checkpoints are "
                "deleted there)",
                f"give {flag} a new or empty directory, e.g. --save-dir {root / 'checkpoints'}",
            )


def other_run(root: str | Path, overwrite: bool, flag: str = "--save-dir") -> list[str]:
    """The checkpoints (``step-N`` directories) another run left in ``root``, which a run that
    does not resume may not train beside: its ``latest`` would move and its ``--keep`` pruning
    delete them ([Note: one run per root]). Refused unless ``overwrite``; returned then (the
    new run deletes them once it has saved its first checkpoint)."""
    root = Path(root)
    if not root.is_dir():
        return []
    names = sorted(p.name for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and p.is_dir())
    if (names or (root / "latest").exists()) and not overwrite:
        shown = ", ".join(names[-2:]) if names else "latest"
        raise CheckpointError(
            f"{flag} {root} holds another run's checkpoints ({shown}): a run that does not resume "
            "would train beside them, move `latest` and delete them when pruning (--keep)",
            f"continue that run with `protrain train … --resume {root} --save-dir {root}`, or add "
            "--overwrite to start over (its checkpoints are deleted once this run has saved one)",
        )
    return names
