"""Token sources and deterministic batching for training runs and parity tests.

A ``TokenSource`` is a whole corpus as one 1D tensor of token ids. The default
needs no download: the Python documentation topics that ship with every CPython
(``pydoc_data.topics``, about 0.5 MB of English), read as bytes, so any model with
a vocabulary of at least 256 can train on it. A text file or a local Hugging Face
tokenizer are the two ways to use something else.

``batches`` draws random windows from the corpus with a generator seeded once, so
a run is reproducible from its seed alone, and every rank of a data-parallel run
draws the same global batch and keeps its own slice of it. Both properties are
what the lock-step parity tests rely on: a reference model and a planned model fed
from two ``batches`` with one seed see the same tokens.

Held-out data (``protrain train --eval-every``): ``split_heldout`` cuts a fixed tail
of the corpus off (``HELDOUT_FRACTION`` of its tokens, at least one window), the
training loop draws only from the rest, and ``heldout_batches`` reads the same
evenly spaced windows of the tail at every evaluation, so successive held-out
losses are comparable and no held-out token is ever trained on.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from protrain.executor.errors import ConfigError

BYTE_VOCAB_SIZE = 256  # byte-level tokens: one token per byte, ids 0..255


@functools.cache
def embedded_corpus() -> bytes:
    """The pydoc topics of this CPython, joined in sorted-key order, UTF-8 encoded."""
    # Imported here: the module holds ~0.5 MB of strings we need only when training.
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


@dataclass(frozen=True)
class TokenSource:
    name: str  # where the tokens came from, e.g. "embedded:pydoc-topics" or a file path
    tokens: torch.Tensor  # (N,) int64, CPU
    vocab_size: int  # every id in `tokens` is < vocab_size


def load_tokens(path: str | None = None, tokenizer: str | None = None) -> TokenSource:
    """Load a corpus: the embedded one (``path=None``) or a text file.

    Without `tokenizer` the text is tokenised byte-level (vocab 256). With
    `tokenizer`, a local directory holding a Hugging Face tokenizer, the text is
    decoded as UTF-8 and encoded by it (needs the ``hf`` extra; nothing is
    downloaded). Whether the corpus is long enough is checked by ``batches``,
    which knows the sequence length.
    """
    if path is None:
        name, data = "embedded:pydoc-topics", embedded_corpus()
    else:
        name, data = str(path), _read_file(Path(path))

    if tokenizer is None:
        # bytearray: frombuffer wants a writable buffer; the copy is the corpus size.
        ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)  # (N,)
        return TokenSource(name=name, tokens=ids, vocab_size=BYTE_VOCAB_SIZE)

    tok = _hf_tokenizer(tokenizer)
    # errors="replace": a stray invalid byte should cost one token, not the run.
    text = data.decode("utf-8", errors="replace")
    # verbose=False: the tokenizer would warn that the corpus is longer than its
    # model_max_length, which is true and irrelevant; batches cuts the windows.
    ids = torch.tensor(tok.encode(text, add_special_tokens=False, verbose=False))  # (N,)
    return TokenSource(name=f"{name}@{tokenizer}", tokens=ids.to(torch.int64), vocab_size=len(tok))


def _read_file(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"data file {str(path)!r} does not exist",
            hint="check the path, or omit --data to train on the embedded corpus",
        ) from None
    except OSError as e:
        raise ConfigError(
            f"cannot read data file {str(path)!r}: {e.strerror}",
            hint="pass a readable text file with --data, or omit it for the embedded corpus",
        ) from None
    if not data:
        raise ConfigError(
            f"data file {str(path)!r} is empty",
            hint="pass a non-empty text file with --data, or omit it for the embedded corpus",
        )
    return data


def _hf_tokenizer(directory: str):
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "--tokenizer needs the Hugging Face transformers package, which is not installed",
            hint='pip install -e ".[hf]"',
        ) from None
    if not Path(directory).is_dir():
        raise ConfigError(
            f"tokenizer directory {directory!r} does not exist",
            hint="pass a local directory saved with tokenizer.save_pretrained(); "
            "nothing is downloaded",
        )
    try:
        return transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"cannot load a tokenizer from {directory!r}: {e}",
            hint="the directory must hold tokenizer.json or tokenizer_config.json "
            "(as written by tokenizer.save_pretrained())",
        ) from None


def vocab_check(source: TokenSource, vocab_size: int) -> None:
    """Refuse a corpus whose token ids could fall outside the model's embedding table."""
    if source.vocab_size > vocab_size:
        raise ConfigError(
            f"corpus {source.name!r} has a vocabulary of {source.vocab_size} tokens, "
            f"more than the model's vocab_size={vocab_size}",
            hint="use a byte-level corpus (omit --tokenizer) or a model with a bigger vocabulary",
        )


def batches(
    source: TokenSource,
    micro_batch: int,
    seq_len: int,
    seed: int,
    *,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (x, y) micro-batches forever, each (micro_batch, seq_len) int64, y = x shifted by one.

    Every step draws ``world_size * micro_batch`` window starts from one generator
    seeded with `seed`; rank r keeps starts ``[r*micro_batch, (r+1)*micro_batch)``.
    So all ranks draw the same global batch, each trains on its own slice, and the
    concatenation of the ranks' batches equals the single-rank batch of
    ``world_size * micro_batch`` with the same seed.
    """
    n_tokens = source.tokens.numel()
    if micro_batch < 1 or seq_len < 1:
        raise ConfigError(
            f"micro_batch={micro_batch} and seq_len={seq_len} must both be at least 1",
            hint="pass positive values to --micro-batch and --seq-len",
        )
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(
            f"rank={rank} is not in 0..{world_size - 1} (world_size={world_size})",
            hint="launch with torchrun, which sets RANK and WORLD_SIZE consistently",
        )
    if n_tokens < seq_len + 1:
        raise ConfigError(
            f"corpus {source.name!r} has {n_tokens} tokens, too few for one window of "
            f"seq_len + 1 = {seq_len + 1} tokens (inputs plus the shifted targets)",
            hint=f"use a longer corpus, or --seq-len {max(n_tokens - 1, 1)} or less",
        )
    return _windows(source.tokens, micro_batch, seq_len, seed, rank, world_size)


def _windows(
    tokens: torch.Tensor, micro_batch: int, seq_len: int, seed: int, rank: int, world_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    # A separate generator function, so that batches() checks its arguments when
    # called rather than at the first next().
    gen = torch.Generator(device="cpu").manual_seed(seed)
    offsets = torch.arange(seq_len + 1)  # (T+1,)
    # The last valid start leaves room for seq_len + 1 tokens; randint's high is exclusive.
    high = tokens.numel() - seq_len
    while True:
        starts = torch.randint(0, high, (world_size * micro_batch,), generator=gen)  # (W*B,)
        mine = starts[rank * micro_batch : (rank + 1) * micro_batch]  # (B,)
        window = tokens[mine[:, None] + offsets]  # (B, T+1)
        # contiguous: callers flatten targets with .view(-1), which a strided slice refuses.
        yield window[:, :-1].contiguous(), window[:, 1:].contiguous()  # (B, T), (B, T)


HELDOUT_FRACTION = 0.05
"""Share of a corpus's tokens (its tail) held out from training for ``--eval-every``."""

HELDOUT_BATCHES = 4
"""Micro-batches of held-out windows one evaluation averages over."""


def split_heldout(source: TokenSource, seq_len: int,
                  fraction: float = HELDOUT_FRACTION) -> tuple[TokenSource, TokenSource]:
    """``(train, heldout)``: the corpus without its tail, and the tail.

    The tail is ``fraction`` of the tokens, and at least one window (``seq_len + 1``
    tokens) so it can be evaluated at all. A window drawn from ``train`` ends before
    the tail starts, so training never sees a held-out token. Refuses a corpus too
    short to leave a window on both sides.
    """
    n = source.tokens.numel()
    k = max(math.ceil(n * fraction), seq_len + 1)
    if n - k < seq_len + 1:
        raise ConfigError(
            f"corpus {source.name!r} has {n} tokens, too few to hold out {k} for evaluation and still "
            f"train on windows of seq_len + 1 = {seq_len + 1}",
            hint="use a longer corpus (--data FILE), or drop --eval-every",
        )
    train = TokenSource(name=f"{source.name}[:-{k}]", tokens=source.tokens[: n - k], vocab_size=source.vocab_size)
    heldout = TokenSource(name=f"{source.name}[-{k}:]", tokens=source.tokens[n - k:], vocab_size=source.vocab_size)
    return train, heldout


def heldout_batches(source: TokenSource, micro_batch: int, seq_len: int, n_batches: int = HELDOUT_BATCHES,
                    *, rank: int = 0, world_size: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n_batches`` fixed (x, y) micro-batches of ``source``, each (micro_batch, seq_len) int64.

    Window starts are evenly spaced over the source (no randomness: every evaluation
    reads the same tokens). As in ``batches``, each batch is a global batch of
    ``world_size * micro_batch`` windows and rank r keeps its slice, so the ranks'
    mean loss is the single-rank loss of the whole set.
    """
    tokens = source.tokens
    high = tokens.numel() - seq_len - 1  # the last valid start
    if high < 0:
        raise ConfigError(f"held-out corpus {source.name!r} has {tokens.numel()} tokens, too few for one "
                          f"window of seq_len + 1 = {seq_len + 1}", hint="use a longer corpus (--data FILE)")
    total = n_batches * world_size * micro_batch
    starts = torch.linspace(0, high, total).round().to(torch.int64)  # (n*W*B,)
    offsets = torch.arange(seq_len + 1)  # (T+1,)
    out = []
    for i in range(n_batches):
        glob = starts[i * world_size * micro_batch: (i + 1) * world_size * micro_batch]  # (W*B,)
        mine = glob[rank * micro_batch: (rank + 1) * micro_batch]  # (B,)
        window = tokens[mine[:, None] + offsets]  # (B, T+1)
        out.append((window[:, :-1].contiguous(), window[:, 1:].contiguous()))  # (B, T), (B, T)
    return out
