"""The row order of packed training: epochs, per-epoch shuffle, rank shards, held-out split."""

from __future__ import annotations

import numpy as np
import pytest

from protrain.planner.models.epochs import EMPTY, RowOrder, heldout_split
from protrain.plans.errors import ConfigError


def _epoch(order: RowOrder, epoch: int) -> np.ndarray:
    first = epoch * order.draws_per_epoch
    return np.concatenate(
        [order.global_rows_at(d) for d in range(first, first + order.draws_per_epoch)]
    )


@pytest.mark.parametrize("n_rows", [1, 7, 24, 25])
def test_every_epoch_is_each_row_once_then_empty_rows(n_rows):
    order = RowOrder(n_rows=n_rows, seed=3, micro_batch=2, grad_accum=2, world=3)
    assert order.steps_per_epoch == -(-n_rows // 12)
    for epoch in range(3):
        rows = _epoch(order, epoch)
        real = rows[rows != EMPTY]
        assert sorted(real.tolist()) == list(range(n_rows))  # each row once
        assert (rows[real.size :] == EMPTY).all()  # the fill comes last, in the last step
        assert rows.size % 12 == 0


def test_epochs_are_shuffled_differently_and_by_seed_alone():
    a = RowOrder(n_rows=50, seed=1, micro_batch=5, grad_accum=1)
    b = RowOrder(n_rows=50, seed=1, micro_batch=5, grad_accum=1)
    c = RowOrder(n_rows=50, seed=2, micro_batch=5, grad_accum=1)
    assert (_epoch(a, 0) != _epoch(a, 1)).any()
    assert (_epoch(a, 1) == _epoch(b, 1)).all()  # another object, same seed: the same order
    assert (_epoch(a, 0) != _epoch(c, 0)).any()
    # jumping to a draw equals drawing up to it (what a resume relies on)
    assert (a.global_rows_at(23) == _epoch(a, 2)[15:20]).all()


def test_ranks_take_disjoint_slices_whose_union_is_the_draw():
    world = 4
    orders = [
        RowOrder(n_rows=30, seed=0, micro_batch=3, grad_accum=2, world=world, rank=r)
        for r in range(world)
    ]
    for d in range(orders[0].draws_per_epoch * 2):
        mine = [o.rows_at(d) for o in orders]
        assert (np.concatenate(mine) == orders[0].global_rows_at(d)).all()
        real = np.concatenate(mine)
        real = real[real != EMPTY]
        assert len(set(real.tolist())) == real.size


def test_heldout_split_is_disjoint_seeded_and_refuses_extremes():
    train, held = heldout_split(100, 0.05, seed=7)
    assert held.size == 5 and train.size == 95
    assert sorted(np.concatenate([train, held]).tolist()) == list(range(100))
    t2, h2 = heldout_split(100, 0.05, seed=7)
    assert (h2 == held).all()
    assert (heldout_split(100, 0.05, seed=8)[1] != held).any()
    assert heldout_split(3, 0.01, seed=0)[1].size == 1  # at least one row
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ConfigError, match="--eval-split"):
            heldout_split(100, bad, seed=0)
    with pytest.raises(ConfigError, match="leaves none"):
        heldout_split(1, 0.5, seed=0)


def test_negative_seed_is_a_seed_too():
    a = RowOrder(n_rows=9, seed=-5, micro_batch=3, grad_accum=1)
    assert sorted(_epoch(a, 0).tolist()) == list(range(9))
    assert heldout_split(10, 0.2, seed=-1)[1].size == 2


def test_no_rows_refused():
    with pytest.raises(ConfigError, match="no training rows"):
        RowOrder(n_rows=0, seed=0, micro_batch=1, grad_accum=1)
