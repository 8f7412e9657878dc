"""Packing fine-tuning examples into rows of at most ``seq_len`` tokens, as TRL 1.16 packs them.

Packing reads only the examples' lengths (an int array), never their tokens, so it costs
memory in the number of examples, not tokens. Its result is a list of rows, each a list of
segments: (example, first token, token count). ``PACKING`` is the one table of strategies
(CLI help, validation and code read it):

- ``bfd``: best-fit decreasing (TRL's ``packing_strategy="bfd"``). Each example longer than
  ``seq_len`` is cut to its first ``seq_len`` tokens; then, longest first (ties in file
  order), each goes into the open row with the least room that still fits it, else into a
  new row; among rows with equal room the oldest wins. Rows come out in the order they were
  opened, examples in each in the order they went in.
- ``wrapped``: the examples end to end, cut every ``seq_len`` tokens (TRL's ``wrapped``);
  nothing is dropped and an example may continue in the next row.
- ``none``: one example per row, cut to ``seq_len`` (TRL without packing, ``max_length``
  truncation keeping the start); an example left with no label by the cut is dropped, as
  TRL drops it.

[Note: TRL's batches of 1000]
TRL packs with ``Dataset.map(batched=True)``, whose default batch is 1000 examples, so both
``bfd`` and ``wrapped`` pack each run of 1000 consecutive examples on its own: a row never
mixes examples from two runs, and the last row of a run may be short. We keep that, so the
rows equal TRL's row for row (a global packing would fill rows a little better, and differ).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where it is used: ``protrain --help`` reads PACKING
    import numpy as np

TRL_BATCH = 1000
"""Examples packed together ([Note: TRL's batches of 1000])."""


@dataclass(frozen=True)
class Packed:
    """Rows as segments. Row r is segments ``row_ptr[r]:row_ptr[r+1]``; segment s is tokens
    ``[start[s], start[s] + length[s])`` of example ``example[s]``."""

    row_ptr: np.ndarray  # (R+1,) int64
    example: np.ndarray  # (S,) int64
    start: np.ndarray  # (S,) int64, a token index inside the example
    length: np.ndarray  # (S,) int64, >= 1

    @property
    def n_rows(self) -> int:
        return len(self.row_ptr) - 1


# Each strategy yields its rows a run of examples at a time (lists of (example, start, length)),
# which ``pack`` turns into arrays at once, so the Python objects alive are one run's.
Rows = Iterator[list[list[tuple[int, int, int]]]]


def _bfd(lengths: np.ndarray, seq_len: int, usable) -> Rows:
    import numpy as np

    for first in range(0, len(lengths), TRL_BATCH):
        ids = np.arange(first, min(first + TRL_BATCH, len(lengths)))
        ids = ids[lengths[ids] > 0]  # TRL drops empty examples before packing
        cut = np.minimum(lengths[ids], seq_len)
        # Longest first; a stable sort keeps equal lengths in file order.
        order = np.argsort(-cut, kind="stable")
        # rooms: the distinct free spaces of open rows, sorted; open_rows[room]: those rows,
        # oldest first. A new row is the room seq_len, always on offer (TRL's sentinel).
        rooms: list[int] = []
        open_rows: dict[int, deque] = {}
        batch_rows: list[list[tuple[int, int, int]]] = []
        for k in order:
            n = int(cut[k])
            i = bisect.bisect_left(rooms, n)  # the least room that fits
            if i < len(rooms):
                room = rooms[i]
                row = open_rows[room].popleft()
                if not open_rows[room]:
                    del open_rows[room], rooms[i]
            else:
                room, row = seq_len, []
                batch_rows.append(row)
            row.append((int(ids[k]), 0, n))
            left = room - n
            if left > 0:
                if left not in open_rows:
                    open_rows[left] = deque()
                    bisect.insort(rooms, left)
                open_rows[left].append(row)
        yield batch_rows


def _wrapped(lengths: np.ndarray, seq_len: int, usable) -> Rows:
    for first in range(0, len(lengths), TRL_BATCH):
        rows: list[list[tuple[int, int, int]]] = []
        row: list[tuple[int, int, int]] = []
        room = seq_len
        for e in range(first, min(first + TRL_BATCH, len(lengths))):
            at, n = 0, int(lengths[e])
            while at < n:  # the example fills what is left of the row, then goes on in the next
                take = min(room, n - at)
                row.append((e, at, take))
                at, room = at + take, room - take
                if room == 0:
                    rows.append(row)
                    row, room = [], seq_len
        if row:  # the run's last, short row
            rows.append(row)
        yield rows


def _none(lengths: np.ndarray, seq_len: int, usable) -> Rows:
    for first in range(0, len(lengths), TRL_BATCH):
        yield [
            [(e, 0, min(int(lengths[e]), seq_len))]
            for e in range(first, min(first + TRL_BATCH, len(lengths)))
            if lengths[e] > 0 and (usable is None or usable(e, min(int(lengths[e]), seq_len)))
        ]


@dataclass(frozen=True)
class Strategy:
    name: str
    pack: Callable
    help: str


PACKING = {
    s.name: s
    for s in (
        Strategy("bfd", _bfd, "best-fit decreasing, examples cut to --seq (TRL's bfd)"),
        Strategy("wrapped", _wrapped, "end to end, cut every --seq tokens (TRL's wrapped)"),
        Strategy("none", _none, "one example per row, cut to --seq (TRL without packing)"),
    )
}
"""``--packing``: how examples become rows (module docstring)."""


def pack(lengths: np.ndarray, seq_len: int, strategy: str, usable=None) -> Packed:
    """Pack examples of ``lengths`` (N,) into rows of at most ``seq_len`` tokens.

    ``usable(example, kept_tokens) -> bool``: whether an example cut to ``kept_tokens`` still
    has a label (``none`` drops it otherwise, as TRL does).
    """
    import numpy as np

    assert seq_len >= 1, seq_len
    sizes, parts = [], []
    for rows in PACKING[strategy].pack(np.asarray(lengths, dtype=np.int64), seq_len, usable):
        sizes.append(np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows)))
        parts.append(np.array([s for r in rows for s in r], dtype=np.int64).reshape(-1, 3))
    sizes = np.concatenate([np.zeros(0, np.int64), *sizes])  # (R,)
    segs = np.concatenate([np.zeros((0, 3), np.int64), *parts])  # (S, 3)
    return Packed(
        row_ptr=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        example=segs[:, 0].copy(),
        start=segs[:, 1].copy(),
        length=segs[:, 2].copy(),
    )
