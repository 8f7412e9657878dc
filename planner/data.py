"""Token sources and deterministic batching for training runs and parity tests.

A ``TokenSource`` is a whole corpus as one 1D tensor of token ids. The default
needs no download: the Python documentation topics that ship with every CPython
(``pydoc_data.topics``, about 0.5 MB of English), read as bytes, so any model with
a vocabulary of at least 256 can train on it. A text file or a local Hugging Face
tokenizer are the two ways to use something else.

Files: plain text (read as UTF-8; a file with NUL bytes or mostly invalid UTF-8 is
refused as binary, as the plan loader refuses one), or JSON lines (``.jsonl``: one
object per line, the text under ``text_field``). With a tokenizer each document is
encoded on its own and followed by the tokenizer's end-of-text token when it has
one, and the documents are packed end to end into one stream, which ``batches`` cuts
into windows of the plan's sequence length (no padding: protrain's attention is
causal over the whole window).

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


def load_tokens(path: str | None = None, tokenizer: str | None = None,
                text_field: str = "text") -> TokenSource:
    """Load a corpus: the embedded one (``path=None``), a text file or a JSON-lines file.

    Without `tokenizer` the text is tokenised byte-level (vocab 256). With
    `tokenizer`, a local directory holding a Hugging Face tokenizer (``tokenizer.json``,
    read with the ``tokenizers`` library; nothing is downloaded), each document is
    encoded and the documents are packed (see the module docstring). A ``.jsonl``
    file's documents are its lines' `text_field`. Whether the corpus is long enough
    is checked by ``batches``, which knows the sequence length.
    """
    if path is None:
        name, data = "embedded:pydoc-topics", embedded_corpus()
    else:
        name, data = str(path), _read_file(Path(path))
    jsonl = path is not None and Path(path).suffix.lower() in (".jsonl", ".ndjson")
    docs = _jsonl_documents(data, name, text_field) if jsonl else None

    if tokenizer is None:
        if docs is not None:  # byte-level documents, one newline between them
            data = "\n".join(docs).encode("utf-8")
        # bytearray: frombuffer wants a writable buffer; the copy is the corpus size.
        ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)  # (N,)
        return TokenSource(name=name, tokens=ids, vocab_size=BYTE_VOCAB_SIZE)

    encode, vocab_size, eos = _hf_tokenizer(tokenizer)
    if docs is None:
        # errors="replace": a stray invalid byte should cost one token, not the run.
        docs = [data.decode("utf-8", errors="replace")]
    ids: list[int] = []
    for doc in docs:
        ids += encode(doc)
        if eos is not None:
            ids.append(eos)
    if not ids:
        raise ConfigError(f"{name}: the tokenizer in {tokenizer} gives no tokens for this text",
                          hint="check the file holds text, or use another --data file")
    return TokenSource(name=f"{name}@{tokenizer}", tokens=torch.tensor(ids, dtype=torch.int64),
                       vocab_size=vocab_size)


def _jsonl_documents(data: bytes, name: str, field: str) -> list[str]:
    """The `field` string of every non-blank line of a JSON-lines file."""
    import json

    docs = []
    for i, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{name}, line {i}: not JSON ({e.msg})",
                              hint="a .jsonl file holds one JSON object per line; rename a plain "
                              "text file to .txt") from None
        text = obj.get(field) if isinstance(obj, dict) else None
        if not isinstance(text, str):
            keys = ", ".join(sorted(obj)) if isinstance(obj, dict) else type(obj).__name__
            raise ConfigError(f"{name}, line {i}: no string field {field!r} (found: {keys})",
                              hint="name the field that holds the text with --text-field")
        docs.append(text)
    if not docs:
        raise ConfigError(f"{name}: no JSON lines", hint="pass a .jsonl file with one object per line")
    return docs


def looks_binary(data: bytes) -> str | None:
    """Why ``data`` is not text (None when it is): NUL bytes, or mostly invalid UTF-8."""
    head = data[:1 << 16]
    if b"\0" in head:
        return "it holds NUL bytes"
    text = head.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - head.decode("utf-8", errors="ignore").count("\ufffd")
    if bad > max(8, len(head) // 100):
        return f"{bad} of its first {len(head)} bytes are not UTF-8"
    return None


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
    why = looks_binary(data)
    if why is not None:
        raise ConfigError(
            f"data file {str(path)!r} is not text: {why}",
            hint="pass a UTF-8 text or .jsonl file with --data (protrain tokenises text; "
            "it does not read pre-tokenised or compressed files)",
        )
    return data


def _hf_tokenizer(directory: str):
    """(encode, vocab size, end-of-text id or None) of a local tokenizer.

    ``tokenizer.json`` is read with the ``tokenizers`` library (a dependency of
    transformers; no model code, no download); other layouts through
    ``transformers.AutoTokenizer`` with ``local_files_only``.
    """
    f = Path(directory) / "tokenizer.json"
    if f.is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("reading tokenizer.json needs the tokenizers package, which is not installed",
                              hint='pip install -e ".[hf]"') from None
        try:
            tok = Tokenizer.from_file(str(f))
        except Exception as e:  # the Rust side raises a bare Exception for a malformed file
            raise ConfigError(f"cannot read {f}: {e}",
                              hint="write it again with tokenizer.save_pretrained(DIR)") from None
        eos = _eos_id(Path(directory), tok.token_to_id)
        return ((lambda text: tok.encode(text, add_special_tokens=False).ids),
                tok.get_vocab_size(with_added_tokens=True), eos)
    tok = _transformers_tokenizer(directory)
    return ((lambda text: tok.encode(text, add_special_tokens=False, verbose=False)), len(tok),
            tok.eos_token_id)


def _eos_id(directory: Path, token_to_id) -> int | None:
    """The end-of-text id: tokenizer_config.json's ``eos_token``, else a usual name."""
    import json

    names = []
    cfg = directory / "tokenizer_config.json"
    if cfg.is_file():
        try:
            eos = json.loads(cfg.read_text(encoding="utf-8")).get("eos_token")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            eos = None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            names.append(eos)
    for name in [*names, "<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"]:
        i = token_to_id(name)
        if i is not None:
            return i
    return None


def _transformers_tokenizer(directory: str):
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
            hint="make the plan with positive values: `protrain plan --batch N --seq T`",
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
            hint=f"use a longer corpus (--data FILE), or a plan made with --seq {max(n_tokens - 1, 1)} "
            "or less",
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
