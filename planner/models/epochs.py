"""The order in which a run consumes packed rows: epochs, a shuffle per epoch, a slice per rank.

Rows (``sft.SFTRows``: one row is one ``seq_len`` sequence of packed examples) are consumed
in *draws*. A draw is one global micro-batch: ``micro_batch × world`` rows, of which rank r
keeps the slice ``[r·micro_batch, (r+1)·micro_batch)``, so the ranks' rows are disjoint and
their union is the draw. A step takes ``grad_accum`` draws.

[Note: epochs]
An epoch is every training row once, in a permutation drawn from ``(seed, epoch)`` alone
(numpy's ``default_rng([seed, epoch])``): any rank, any run, any resume computes the same
order without having drawn the epochs before it. An epoch is a whole number of steps:
``ceil(rows / rows_per_step)``. The last step of an epoch is filled up with *empty* rows
(``EMPTY``: padding only, every target -100), which carry no supervised token; since a
step's loss is normalised by its supervised tokens, the filled step trains exactly as a
shorter step would (as Trainer's last, smaller accumulation does), and no row is dropped or
seen twice within an epoch.

A position in the stream is the number of draws consumed (``draws``, saved in checkpoints):
``rows_at(draws)`` jumps there directly, so a resume costs nothing however far it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from protrain.plans.errors import ConfigError

EMPTY = -1
"""A row index that stands for a row of padding only (filling an epoch's last step)."""


@dataclass(frozen=True)
class RowOrder:
    n_rows: int  # training rows (after any held-out split)
    seed: int  # the run's --seed
    micro_batch: int  # rows per rank per draw (the plan's micro_batch)
    grad_accum: int  # draws per step (the plan's grad_accum)
    world: int = 1  # ranks
    rank: int = 0  # this rank
    # the last epoch's permutation ("epoch", "order"): derived, not part of the order's identity
    _kept: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.n_rows < 1:
            raise ConfigError(
                "the data has no training rows", "give more data (or a smaller --eval-split)"
            )

    @property
    def rows_per_draw(self) -> int:
        return self.micro_batch * self.world

    @property
    def draws_per_epoch(self) -> int:
        """Whole steps' worth of draws: the last step is filled with EMPTY rows."""
        return self.steps_per_epoch * self.grad_accum

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.n_rows / (self.rows_per_draw * self.grad_accum))

    def permutation(self, epoch: int) -> np.ndarray:
        """(n_rows,) int64: the order of epoch ``epoch`` (0-based); the last one asked for is
        kept, since every draw of an epoch reads it (an O(rows) shuffle otherwise per draw)."""
        kept = self._kept
        if kept.get("epoch") != epoch:
            # --seed is a signed 64-bit integer; numpy seeds with non-negative ones (same bits).
            rng = np.random.default_rng([self.seed % 2**64, epoch])
            kept.update(epoch=epoch, order=rng.permutation(self.n_rows))
        return kept["order"]

    def global_rows_at(self, draws: int) -> np.ndarray:
        """(micro_batch × world,) int64 row indices of draw number ``draws`` (0-based), every
        rank's; EMPTY where the epoch's last step is filled up."""
        epoch, k = divmod(draws, self.draws_per_epoch)
        perm = self.permutation(epoch)
        out = np.full(self.rows_per_draw, EMPTY, dtype=np.int64)  # (W*B,)
        take = perm[k * self.rows_per_draw : (k + 1) * self.rows_per_draw]
        out[: take.size] = take
        return out

    def rows_at(self, draws: int) -> np.ndarray:
        """(micro_batch,) int64: this rank's slice of draw ``draws``."""
        g = self.global_rows_at(draws)
        return g[self.rank * self.micro_batch : (self.rank + 1) * self.micro_batch]


def heldout_split(n_rows: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train, heldout)`` row indices, both sorted: ``ceil(fraction × n_rows)`` rows chosen by
    ``(seed, "heldout")`` are held out (at least one), the rest train; disjoint, and the same
    for every rank and every resume."""
    if not 0.0 < fraction < 1.0:
        raise ConfigError(
            f"--eval-split {fraction:g} is not a fraction between 0 and 1",
            "give the share of rows to hold out, such as --eval-split 0.05",
        )
    k = max(1, math.ceil(fraction * n_rows))
    if k >= n_rows:
        raise ConfigError(
            f"--eval-split {fraction:g} holds out {k} of the data's {n_rows} rows and leaves none "
            "to train on",
            "give a smaller --eval-split or more data (or --eval-data FILE)",
        )
    # 0x68656c64 ("held"): a second stream of the same seed, apart from every epoch's (epochs are
    # small non-negative integers).
    perm = np.random.default_rng([seed % 2**64, 0x68656C64]).permutation(n_rows)
    return np.sort(perm[k:]), np.sort(perm[:k])
