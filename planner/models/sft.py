"""Fine-tuning data as training rows: ``load_sft`` reads, tokenises (once, cached) and packs
instruction and chat data; ``micro_batch`` turns rows into what the engine takes.

The pipeline, one module a step: ``sft_records`` reads and checks records of the formats TRL
reads, ``sft_tokens`` renders and tokenises them with their loss masks, ``sft_cache`` keeps
the result memory-mapped on disk, and ``packing`` places examples into rows from their
lengths alone. The rows are TRL 1.16 ``SFTTrainer``'s ``train_dataset`` row for row
(tests/test_sft_trl.py), in its order (file order of the packing result).

[Note: SFT row convention]
A row here is in Hugging Face's convention, unshifted: ``labels[t]`` is the label of token t
itself (-100: no loss), as TRL's rows are. The label of each example's first token is -100,
as TRL's collator sets it (``labels[position_ids == 0] = -100``), so after the shift no
example's first token is the target of the previous example's last. ``position_ids`` count
from 0 at every example (TRL's ``seq_lengths``). ``micro_batch`` does the shift:
``targets[t] = labels[t + 1]`` (the token to predict after ``idx[t]``), the last -100, and
pads each row to ``seq_len`` with the pad id, targets -100 and position ids going on from 0
(the padding is an example of its own, attending only to itself).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from protrain.plans.errors import ConfigError

from .packing import PACKING, Packed, pack
from .sft_cache import Cached
from .sft_tokens import LOSS_ON

IGNORE = -100
"""The label of a token that is no target (Hugging Face's and PyTorch's ``ignore_index``)."""


@dataclass
class SFTRows:
    """Packed rows over one or more cached files. Row i: ``row(i)``; its trainable targets:
    ``supervised(i)``."""

    name: str  # the data files, as given
    caches: list[Cached]
    packed: Packed
    vocab_size: int
    pad_id: int
    fingerprint: str  # of the caches, seq_len and packing: names exactly these rows
    # Global example e is example e - first[k] of caches[k], where first[k] <= e < first[k+1].
    first: np.ndarray = field(repr=False)  # (K+1,) int64
    offsets: list[np.ndarray] = field(repr=False)  # per cache: (E_k+1,) token offsets

    @property
    def n_rows(self) -> int:
        return self.packed.n_rows

    @property
    def n_examples(self) -> int:
        return int(self.first[-1])

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input_ids, labels, position_ids) of row i, each (L,) int64 with L <= seq_len, no
        padding ([Note: SFT row convention])."""
        if not 0 <= i < self.n_rows:
            raise IndexError(f"row {i} of {self.n_rows}")
        ids, labels, pos = [], [], []
        for s in range(self.packed.row_ptr[i], self.packed.row_ptr[i + 1]):
            e, start, n = (
                int(self.packed.example[s]),
                int(self.packed.start[s]),
                int(self.packed.length[s]),
            )
            k = int(np.searchsorted(self.first, e, side="right")) - 1
            at = int(self.offsets[k][e - self.first[k]]) + start
            seg = self.caches[k].tokens[at : at + n].astype(np.int64)  # (n,)
            lab = np.where(self.caches[k].mask[at : at + n] != 0, seg, IGNORE)  # (n,)
            lab[0] = IGNORE  # no example's first token is a target of the one before
            ids.append(seg)
            labels.append(lab)
            pos.append(np.arange(n, dtype=np.int64))
        return np.concatenate(ids), np.concatenate(labels), np.concatenate(pos)

    def supervised(self, i: int) -> int:
        """The row's trainable targets after the shift: labels other than -100 past token 0."""
        return int(np.count_nonzero(self.row(i)[1][1:] != IGNORE))

    def supervised_counts(self) -> np.ndarray:
        """(n_rows,) int64: ``supervised(i)`` of every row, from the masks read in blocks
        ([Note: counting without mapping])."""
        p = self.packed
        seg_row = np.repeat(np.arange(self.n_rows), np.diff(p.row_ptr))  # (S,)
        k = np.searchsorted(self.first, p.example, side="right") - 1  # (S,) the cache of each
        out = np.zeros(self.n_rows, dtype=np.int64)
        for c, cache in enumerate(self.caches):
            on = k == c
            at = self.offsets[c][p.example[on] - self.first[c]] + p.start[on]  # (S_c,)
            # each segment's first token is no target: its labels past it
            counts = _range_sums(cache.mask, at + 1, at + p.length[on])
            np.add.at(out, seg_row[on], counts)
        return out


MASK_BLOCK = 1 << 22
"""Mask bytes read at a time when counting (``_range_sums``)."""


def _range_sums(mask: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """``[count_nonzero(mask[a:b]) for a, b in zip(starts, ends)]``, reading the mask file once
    in ``MASK_BLOCK`` blocks.

    [Note: counting without mapping]
    A cache's files are memory-mapped, and a mapped page that is read counts in the process's
    resident set until the kernel drops it: a pass over every row of a large file through the
    map (the supervised share, the rows that keep a label) would raise the RSS by the size of
    the cache. So such passes read the file in blocks (page cache, not RSS) and answer every
    range from prefix sums at its two ends, in one sweep over the sorted ends.
    """
    pos = np.concatenate([starts, ends]).astype(np.int64)  # (2R,)
    order = np.argsort(pos, kind="stable")
    sorted_pos = pos[order]
    prefix = np.empty_like(pos)  # ones in mask[:pos]
    base = lo = i = 0
    with open(mask.filename, "rb") as f:
        f.seek(mask.offset)
        while i < sorted_pos.size:
            block = np.frombuffer(f.read(MASK_BLOCK), dtype=np.uint8)  # (<= MASK_BLOCK,)
            c = np.zeros(block.size + 1, dtype=np.int64)
            np.cumsum(block != 0, out=c[1:])
            j = int(np.searchsorted(sorted_pos, lo + block.size, side="right"))
            prefix[order[i:j]] = base + c[sorted_pos[i:j] - lo]
            if block.size == 0 and j == i:
                raise ValueError(f"{mask.filename}: a range ends past the mask's end")
            i, base, lo = j, base + int(c[-1]), lo + block.size
    return prefix[starts.size :] - prefix[: starts.size]


def load_sft(
    paths: list[str],
    *,
    tokenizer_dir: str,
    seq_len: int,
    chat_template: str | None = None,
    text_field: str = "text",
    loss_on: str = "auto",
    packing: str = "bfd",
    cache_dir: str | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> SFTRows:
    """Read, tokenise (or find in the cache) and pack fine-tuning data into rows of at most
    ``seq_len`` tokens. Every record of every file is checked while tokenising, so a bad record
    is refused here, before any training step. ``progress(file, done, total)`` is called as a
    file is tokenised (bytes or rows; not at all on a cache hit)."""
    from . import sft_cache
    from .sft_tokens import Encoder

    if seq_len < 2:
        raise ConfigError(
            f"--seq {seq_len}: a row needs at least 2 tokens (one input and its target)",
            hint="pass --seq 2 or more",
        )
    if packing not in PACKING:
        raise ConfigError(
            f"--packing {packing!r} is not a strategy; strategies are {', '.join(PACKING)}",
            hint="pick one of them (see protrain data --help)",
        )
    if loss_on not in LOSS_ON:
        raise ConfigError(
            f"--loss-on {loss_on!r} is not a mode; modes are {', '.join(LOSS_ON)}",
            hint="pick one of them (see protrain data --help)",
        )
    if not paths:
        raise ConfigError("no data files", hint="pass one or more with --data")
    encoder = Encoder(tokenizer_dir, chat_template, text_field)
    caches = [sft_cache.load(p, encoder, loss_on, cache_dir, progress) for p in paths]
    lengths = np.concatenate([c.lengths for c in caches])  # (E,)
    first = np.concatenate([[0], np.cumsum([len(c.lengths) for c in caches])]).astype(np.int64)
    offsets = [np.concatenate([[0], np.cumsum(c.lengths)]).astype(np.int64) for c in caches]

    # ``none``: whether an example keeps a label in the tokens a row holds (counted in blocks:
    # [Note: counting without mapping])
    usable = None
    if packing == "none":
        labelled = np.concatenate(
            [
                _range_sums(c.mask, o[:-1], o[:-1] + np.minimum(c.lengths, seq_len)) > 0
                for c, o in zip(caches, offsets)
            ]
        )  # (E,)

        def usable(e: int, n: int) -> bool:  # (n: the example's tokens a row holds)
            return bool(labelled[e])

    packed = pack(lengths, seq_len, packing, usable)
    if packed.n_rows == 0:
        raise ConfigError(
            f"{', '.join(paths)}: no row to train on (every example is empty, or has no label "
            f"in its first {seq_len} tokens)",
            hint="check --loss-on, or raise --seq",
        )
    h = hashlib.blake2b(digest_size=16)
    for c in caches:
        h.update(c.meta["fingerprint"].encode())
    h.update(f"{seq_len}:{packing}".encode())
    return SFTRows(
        name=", ".join(str(Path(p)) for p in paths),
        caches=caches,
        packed=packed,
        vocab_size=encoder.vocab_size,
        pad_id=encoder.pad_id,
        fingerprint=h.hexdigest(),
        first=first,
        offsets=offsets,
    )


_NONE = np.zeros(0, dtype=np.int64)  # the tokens of a row of padding only


def micro_batch(rows: SFTRows, indices: list[int], seq_len: int):
    """(idx, targets, position_ids) of rows ``indices``, each (B, seq_len) int64 torch tensors,
    shifted and padded ([Note: SFT row convention]). A negative index (``epochs.EMPTY``) is a
    row of padding only: a row of no tokens, padded as any row's tail."""
    import torch

    b = len(indices)
    idx = np.full((b, seq_len), rows.pad_id, dtype=np.int64)  # (B, T)
    targets = np.full((b, seq_len), IGNORE, dtype=np.int64)  # (B, T)
    position_ids = np.zeros((b, seq_len), dtype=np.int64)  # (B, T)
    for j, i in enumerate(indices):
        ids, labels, pos = rows.row(i) if i >= 0 else (_NONE, _NONE, _NONE)  # (L,) each
        n = len(ids)
        if n > seq_len:
            raise ConfigError(
                f"row {i} of {rows.name} has {n} tokens, more than seq_len={seq_len}",
                hint="load the data with the plan's seq_len",
            )
        idx[j, :n] = ids
        targets[j, : max(n - 1, 0)] = labels[1:]  # the label of t + 1 is the target at t
        position_ids[j, :n] = pos
        position_ids[j, n:] = np.arange(seq_len - n)  # the padding: an example of its own
    return torch.from_numpy(idx), torch.from_numpy(targets), torch.from_numpy(position_ids)
