"""The tokenised examples of one fine-tuning file, on disk and memory-mapped.

A cache is a directory of four files:
- ``tokens.bin``: every example's token ids end to end, uint16 when the vocabulary fits,
  else uint32 (``data.token_width``);
- ``mask.bin``: one uint8 per token, 1 where the token is a label (``sft_tokens``);
- ``lengths.bin``: each example's token count, int64, in file order (the example index:
  offsets are its running sum);
- ``meta.json``: the format, counts, vocabulary and pad id, and the fingerprint.

Building one streams the records once (``sft_records.read``), tokenises each on its own and
appends it to the files, so memory is bounded by one record plus a write buffer, whatever the
file's size. Only ``lengths.bin`` is read whole afterwards (8 bytes an example): packing needs
nothing else; tokens and masks are mapped and paged in as rows are read.

[Note: SFT cache fingerprint]
The cache is found by a fingerprint of everything its bytes depend on: the data's identity,
the tokenizer's files, the chat template's text, ``--text-field``, ``--loss-on``, the
transformers and tokenizers versions, and ``CACHE_VERSION``. The data's identity is its size,
its mtime (ns) and a BLAKE2b of 16 blocks of 64 KiB spread evenly over it (first and last
included), not a hash of all of it: a cache hit must cost milliseconds, and a full hash of a
10 GB file costs a full read on every run. Size and mtime change with every ordinary rewrite;
the sampled blocks catch a file swapped for another of the same size with its mtime carried
over (``cp -p``, ``rsync -t`` of another version). An edit that keeps size and mtime and
touches no sampled block is missed: the one case we accept, and ``--cache-dir`` elsewhere or
deleting ``.protrain-cache`` rebuilds.

Writing is atomic: the files go to a temporary directory beside the final one, which is
renamed into place only when complete, so a killed run leaves a ``.tmp-*`` directory that is
never read (and is removed by the next build of the same fingerprint).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protrain.plans.errors import ConfigError

from .data import token_width
from .sft_records import read
from .sft_tokens import Encoder, loss_on_for, tokenizer_digest

CACHE_VERSION = 1
"""Bumped whenever the files' layout or how records are tokenised changes."""

CACHE_DIR_NAME = ".protrain-cache"
"""The directory created next to the data, holding one cache directory per fingerprint."""

_SAMPLES, _SAMPLE_BYTES = 16, 64 << 10
_FLUSH_TOKENS = 1 << 18  # tokens buffered before a write


def data_identity(path: Path) -> str:
    """[Note: SFT cache fingerprint]: size, mtime and sampled content of a file or of every file
    of a directory (a ``save_to_disk`` one)."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        st = f.stat()
        h.update(f"{f.relative_to(path) if path.is_dir() else f.name}:{st.st_size}:".encode())
        h.update(f"{st.st_mtime_ns}".encode())
        with open(f, "rb") as fh:
            step = max(st.st_size - _SAMPLE_BYTES, 0) / max(_SAMPLES - 1, 1)
            for i in range(_SAMPLES):
                fh.seek(int(i * step))
                h.update(fh.read(_SAMPLE_BYTES))
    return h.hexdigest()


def fingerprint(path: Path, encoder: Encoder, loss_on: str) -> str:
    import tokenizers
    import transformers

    parts = {
        "cache_version": CACHE_VERSION,
        "data": data_identity(path),
        "tokenizer": tokenizer_digest(encoder.tokenizer_dir),
        "template": encoder.template,
        "text_field": encoder.text_field,
        "loss_on": loss_on,
        "versions": [transformers.__version__, tokenizers.__version__],
    }
    blob = json.dumps(parts, sort_keys=True).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def cache_root(path: Path, cache_dir: str | None) -> Path:
    """Where caches of ``path`` live: ``cache_dir``, else ``.protrain-cache`` beside the data,
    else (that directory not writable) ``$XDG_CACHE_HOME/protrain/sft``."""
    if cache_dir is not None:
        return Path(cache_dir)
    beside = path.resolve().parent / CACHE_DIR_NAME
    if os.access(beside if beside.is_dir() else beside.parent, os.W_OK):
        return beside
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "protrain" / "sft"


@dataclass(frozen=True)
class Cached:
    """One built cache, mapped."""

    directory: Path
    meta: dict
    tokens: np.ndarray  # (N_tokens,) uint16/uint32, mapped
    mask: np.ndarray  # (N_tokens,) uint8, mapped
    lengths: np.ndarray  # (N_examples,) int64, in memory


def open_cache(directory: Path) -> Cached:
    meta = json.loads((directory / "meta.json").read_text())
    dtype = np.dtype(meta["token_dtype"])
    n = meta["n_tokens"]
    lengths = np.fromfile(directory / "lengths.bin", dtype=np.int64)
    assert len(lengths) == meta["n_examples"] and int(lengths.sum()) == n, (directory, meta)
    return Cached(
        directory=directory,
        meta=meta,
        tokens=_map(directory / "tokens.bin", dtype, n),
        mask=_map(directory / "mask.bin", np.uint8, n),
        lengths=lengths,
    )


def _map(path: Path, dtype, n: int) -> np.ndarray:
    if n == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,))


def load(
    path: str,
    encoder: Encoder,
    loss_on: str,
    cache_dir: str | None = None,
    progress=None,
) -> Cached:
    """The cache of ``path``: opened when one with its fingerprint exists, else built first."""
    source = Path(path)
    if not source.exists():
        raise ConfigError(f"data file {path!r} does not exist", hint="check the path")
    fp = fingerprint(source, encoder, loss_on)
    root = cache_root(source, cache_dir)
    final = root / f"{source.name}-{fp}"
    if (final / "meta.json").is_file():
        return open_cache(final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{source.name}-{fp}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for stale in root.glob(f".tmp-{source.name}-{fp}-*"):  # left by a killed run
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()
    try:
        _build(source, encoder, loss_on, tmp, fp, progress)
        try:
            os.rename(tmp, final)
        except OSError:  # another run finished the same cache first: theirs is as good
            if not (final / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return open_cache(final)


def _build(source: Path, encoder: Encoder, loss_on: str, out: Path, fp: str, progress) -> None:
    dtype = np.uint16 if token_width(encoder.vocab_size) == 2 else np.uint32
    ids_buf, mask_buf = [], []
    lengths = array("q")  # 8 bytes an example, not a Python int's 28
    buffered = n_tokens = 0
    fmt = loss = None
    with (
        open(out / "tokens.bin", "wb") as tokens_f,
        open(out / "mask.bin", "wb") as mask_f,
    ):

        def flush() -> None:
            if ids_buf:
                tokens_f.write(np.concatenate(ids_buf).astype(dtype).tobytes())
                mask_f.write(np.concatenate(mask_buf).tobytes())
                ids_buf.clear()
                mask_buf.clear()

        for i, record in enumerate(read(str(source), encoder.text_field)):
            if loss is None:  # the first record decides the file's format (sft_records)
                fmt = record.format
                loss = loss_on_for(loss_on, fmt, record.where)
                encoder.check(fmt, loss, record.where)
            ids, mask = encoder.encode(record, loss)  # (L,), (L,)
            if ids.size and int(ids.max()) >= encoder.vocab_size:
                raise ConfigError(
                    f"{record.where}: token id {int(ids.max())} is outside the tokenizer's "
                    f"vocabulary of {encoder.vocab_size}",
                    hint="the tokenizer directory is inconsistent: save it again",
                )
            ids_buf.append(ids)
            mask_buf.append(mask)
            lengths.append(len(ids))
            buffered += len(ids)
            n_tokens += len(ids)
            if buffered >= _FLUSH_TOKENS:
                flush()
                buffered = 0
            if progress is not None and i % 256 == 0:
                progress(str(source), *record.done)
        flush()
        tokens_f.flush()
        os.fsync(tokens_f.fileno())
        mask_f.flush()
        os.fsync(mask_f.fileno())
    np.frombuffer(lengths, dtype=np.int64).tofile(out / "lengths.bin")
    if progress is not None:
        progress(str(source), 1, 1)
    meta = {
        "cache_version": CACHE_VERSION,
        "fingerprint": fp,
        "source": str(source),
        "format": fmt.name,
        "loss_on": loss.name,
        "token_dtype": np.dtype(dtype).name,
        "n_examples": len(lengths),
        "n_tokens": n_tokens,
        "vocab_size": encoder.vocab_size,
        "pad_id": encoder.pad_id,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
