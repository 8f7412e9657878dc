"""What ``protrain train`` feeds the engine from fine-tuning rows: the rows of each step, their
micro-batches, the step's supervised-target count, and the held-out rows.

Two ways to read data, chosen here (``wants_rows``): raw text (a text or token file, or JSON
lines of ``{"text"}`` records without fine-tuning flags) is one token stream sampled at random
windows (``data.batches``); instruction and chat data (``messages`` or ``prompt``/``completion``
records, a ``.json``/``.parquet``/``save_to_disk`` source, or any data with one of the
fine-tuning flags) is read as packed rows (``sft.load_sft``) and consumed in epochs
(``epochs.RowOrder``: a seeded shuffle per epoch, disjoint rank slices).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protrain.plans.errors import ConfigError

from ..models.epochs import EMPTY, RowOrder, heldout_split
from ..models.sft import micro_batch

ROW_KEYS = ("messages", "prompt", "completion")
"""Fields whose presence in a JSON-lines record means fine-tuning rows, not raw text."""


@dataclass(frozen=True)
class SFTFlags:
    """The fine-tuning flags of ``protrain train`` (None: not given)."""

    packing: str | None = None  # --packing (default bfd)
    loss_on: str | None = None  # --loss-on (default auto)
    chat_template: str | None = None  # --chat-template FILE
    epochs: int | None = None  # --epochs N
    eval_split: float | None = None  # --eval-split R
    eval_data: str | None = None  # --eval-data FILE

    def given(self) -> list[str]:
        names = {
            "packing": "--packing",
            "loss_on": "--loss-on",
            "chat_template": "--chat-template",
            "epochs": "--epochs",
            "eval_split": "--eval-split",
            "eval_data": "--eval-data",
        }
        return [flag for field, flag in names.items() if getattr(self, field) is not None]


def wants_rows(data_path: str | None, flags: SFTFlags) -> bool:
    """Whether the run reads packed rows (module docstring) rather than a token stream."""
    if flags.given():
        return True
    if data_path is None:
        return False
    path = Path(data_path)
    if path.is_dir() or path.suffix.lower() in (".json", ".parquet"):
        return True
    if path.suffix.lower() not in (".jsonl", ".ndjson") or not path.is_file():
        return False
    from ..models.sft_records import first_object

    try:
        obj = first_object(path)
    except ConfigError:  # not JSON: the raw-text reader names what is wrong with it
        return False
    return isinstance(obj, dict) and any(k in obj for k in ROW_KEYS)


def check_flags(flags: SFTFlags, *, steps_given: bool, eval_every: int | None) -> None:
    """Refuse flag combinations that cannot mean anything, before anything is built."""
    if flags.epochs is not None and steps_given:
        raise ConfigError(
            "--epochs and --steps both give the run's length",
            "pass one: --epochs N (passes over the rows) or --steps N (optimizer steps)",
        )
    if flags.eval_split is not None and flags.eval_data is not None:
        raise ConfigError(
            "--eval-split and --eval-data both name the held-out rows",
            "pass one: --eval-split R (a share of --data) or --eval-data FILE",
        )
    if (flags.eval_split is not None or flags.eval_data is not None) and eval_every is None:
        raise ConfigError(
            "--eval-split/--eval-data name held-out rows, but nothing evaluates them",
            "add --eval-every K (steps between evaluations)",
        )


class RowFeed:
    """The training rows of a run and the order it consumes them in ([Note: epochs] in
    models/epochs.py); ``step(d)`` gives the micro-batches of the step starting at draw ``d``.
    """

    def __init__(self, rows, train: np.ndarray, order: RowOrder, seq_len: int):
        self.rows = rows  # sft.SFTRows: every row of --data
        self.train = train  # (n_train,) int64: the rows that train (all but the held-out)
        self.order = order  # over 0..n_train-1
        self.seq_len = seq_len
        # (n_rows,) int64: each row's supervised targets, counted once without mapping the cache
        self.counts = rows.supervised_counts()

    def _rows(self, order_idx: np.ndarray) -> np.ndarray:
        """Row indices of the order's indices over the training rows (EMPTY stays EMPTY)."""
        return np.where(order_idx == EMPTY, EMPTY, self.train[np.maximum(order_idx, 0)])

    def step(self, first_draw: int) -> tuple[Iterator[tuple], int]:
        """The step's micro-batches (drawn one at a time, as the engine runs them) and this
        rank's supervised-target count (the engine's ``num_items``)."""
        k = self.order.grad_accum
        draws = [self._rows(self.order.rows_at(d)) for d in range(first_draw, first_draw + k)]
        n = sum(supervised(self.counts, d) for d in draws)
        return (micro_batch(self.rows, d, self.seq_len) for d in draws), n

    def global_supervised(self, first_draw: int) -> int:
        """The step's supervised targets over every rank (the loss's denominator N)."""
        draws = range(first_draw, first_draw + self.order.grad_accum)
        return sum(supervised(self.counts, self._rows(self.order.global_rows_at(d))) for d in draws)


def supervised(counts: np.ndarray, rows: np.ndarray) -> int:
    """The supervised targets of rows ``rows`` (EMPTY: none), from ``SFTRows.supervised_counts``."""
    return int(counts[rows[rows != EMPTY]].sum())


def heldout_batches(
    rows, counts: np.ndarray, indices: np.ndarray, micro_batch_size: int, seq_len: int, world, rank
):
    """Every held-out row once, in draws of ``micro_batch × world`` rows (the last filled with
    EMPTY): a list of ``(this rank's micro-batch, the draw's global supervised count)``.
    ``counts``: ``rows.supervised_counts()``, which the caller may already hold."""
    per_draw = micro_batch_size * world
    out = []
    for d in range(math.ceil(len(indices) / per_draw)):
        glob = np.full(per_draw, EMPTY, dtype=np.int64)
        take = indices[d * per_draw : (d + 1) * per_draw]
        glob[: take.size] = take
        n = supervised(counts, glob)
        if n == 0:
            continue  # nothing to score (the loss of no target is no information)
        mine = glob[rank * micro_batch_size : (rank + 1) * micro_batch_size]
        out.append((micro_batch(rows, mine, seq_len), n))
    return out


def heldout_loss(engine, batches) -> float:
    """The held-out rows' loss: sum of token losses over their supervised targets (each draw's
    evaluate is its own token mean over all ranks; weighted by its count)."""
    total = sum(n for _, n in batches)
    return sum(engine.evaluate(b) * n for b, n in batches) / total


def split(rows, flags: SFTFlags, seed: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(training rows, held-out rows of --data or None)."""
    if flags.eval_split is None:
        return np.arange(rows.n_rows, dtype=np.int64), None
    return heldout_split(rows.n_rows, flags.eval_split, seed)


def summary(feed: RowFeed) -> tuple[int, float]:
    """(supervised targets of the training rows, their share of the rows' positions)."""
    n = int(feed.counts[feed.train].sum())
    return n, n / max(1, feed.train.size * feed.seq_len)


def rows_json(rows, i: int, **extra) -> str:
    """One row as ``protrain data --json`` prints it (an EMPTY row: empty lists)."""
    if i == EMPTY:
        ids = labels = pos = []
    else:
        a, b, c = rows.row(int(i))
        ids, labels, pos = a.tolist(), b.tolist(), c.tolist()
    obj = {"input_ids": ids, "labels": labels, "position_ids": pos, **extra}
    return json.dumps(obj, separators=(",", ":"))


def load_rows(data_path, sft, tok_dir, text_field, seq_len, echo):
    """(training rows of --data, held-out rows of --eval-data or None), loaded (and tokenised
    once into the cache) before the model is built, so a bad record fails first."""
    from ..models.sft import load_sft

    if data_path is None or tok_dir is None:
        raise ConfigError(
            "fine-tuning rows ("
            + (", ".join(sft.given()) or "chat or instruction data")
            + ") need "
            + ("--data FILE" if data_path is None else "a tokenizer with its chat template"),
            "pass --data FILE and a model directory holding its tokenizer (--hf-config DIR), "
            "or --tokenizer DIR",
        )

    from .progress import TokenisingBar

    def load(path):
        with TokenisingBar() as bar:  # (shown only on a terminal)
            return load_sft(
                [path],
                tokenizer_dir=tok_dir,
                seq_len=seq_len,
                chat_template=sft.chat_template,
                text_field=text_field,
                loss_on=sft.loss_on or "auto",
                packing=sft.packing or "bfd",
                progress=bar.update,
            )

    rows = load(data_path)
    echo(
        f"data     {rows.name}: {rows.n_examples:,} examples in {rows.n_rows:,} rows of "
        f"{seq_len} (packing {sft.packing or 'bfd'}, loss on {sft.loss_on or 'auto'}), "
        f"tokenizer {tok_dir} (vocab {rows.vocab_size})"
    )
    heldout = None if sft.eval_data is None else load(sft.eval_data)
    return rows, heldout


def check_vocab(rows, vocab: int, tok_dir: str) -> None:
    if rows.vocab_size > vocab:
        raise ConfigError(
            f"the tokenizer {tok_dir} has {rows.vocab_size:,} ids, more than the model's "
            f"{vocab:,} output rows",
            "train with the model's own tokenizer (--tokenizer DIR or its --hf-config directory)",
        )
