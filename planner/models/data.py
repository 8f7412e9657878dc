"""Token sources and deterministic batching for training runs and parity tests.

A ``TokenSource`` is a whole corpus as one 1D tensor of token ids. The default
needs no download: the Python documentation topics that ship with every CPython
(``pydoc_data.topics``, about 0.5 MB of English), read as bytes, so any model with
a vocabulary of at least 256 can train on it. A text file or a local Hugging Face
tokenizer are the two ways to use something else.

Files: plain text (read as UTF-8; a file with NUL bytes or mostly invalid UTF-8 is
refused as binary, as the plan loader refuses one), JSON lines (``.jsonl``: one
object per line, the text under ``text_field``), or a token file written by
``protrain tokenize`` ([Note: token files]). With a tokenizer each document is
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

[Note: bounded memory]
No file is read whole. A data file is first probed (``_probe``: at most
``PROBE_BYTES``, 4 KiB at a time, stopping at a NUL byte, so ``/dev/zero`` or a disk
image is refused after 4 KiB). A token file, or a text file read byte-level, is then
memory-mapped as it is: its pages are read when a window touches them and the kernel
may drop them again, so the resident memory does not grow with the corpus. Anything
else (JSON lines, or text with a tokenizer) is tokenised a ``TEXT_PIECE_BYTES`` piece
at a time, a long line or document cut into pieces too ([Note: tokenizer pieces]), into
an unlinked temporary file, which is mapped the same way; for a corpus used more than
once, ``protrain tokenize`` does that once.
Windows are gathered from the mapped ids and widened to int64 (``gather``), so a
corpus gives the same batches whichever way it was stored. BENCHMARKS.md has the
peak RSS of a 20 MB and a 2 GB corpus, and ("Tokenising memory") of a 64 MiB one-line
text and a 1 GiB text through a BPE tokenizer.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from protrain.plans.errors import ConfigError
from protrain.plans.reader import special_file

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
    tokens: (
        torch.Tensor
    )  # (N,) CPU; int64, or a file's uint8/uint16/uint32 mapped (read with ``gather``)
    vocab_size: int  # every id in `tokens` is < vocab_size
    max_id: int | None = None  # the largest id, where it was read (a token file's, when opened)


def load_tokens(
    path: str | None = None, tokenizer: str | None = None, text_field: str = "text"
) -> TokenSource:
    """Load a corpus: the embedded one (``path=None``), a text, JSON-lines or token file.

    Without `tokenizer` the text is tokenised byte-level (vocab 256). With
    `tokenizer`, a local directory holding a Hugging Face tokenizer (``tokenizer.json``,
    read with the ``tokenizers`` library; nothing is downloaded), each document is
    encoded and the documents are packed (see the module docstring). A ``.jsonl``
    file's documents are its lines' `text_field`. A token file (``protrain tokenize``)
    is already tokenised: `tokenizer` and `text_field` do not apply to it. Whether the
    corpus is long enough is checked by ``batches``, which knows the sequence length.

    Memory stays bounded by a piece of the file, whatever its size (module docstring,
    [Note: bounded memory]): a token file and a byte-level text file are memory-mapped
    as they are; anything else is tokenised a piece at a time into an unlinked
    temporary file, which is then mapped.
    """
    if path is None:
        name = "embedded:pydoc-topics"
        if tokenizer is None:
            ids = torch.frombuffer(bytearray(embedded_corpus()), dtype=torch.uint8).to(
                torch.int64
            )  # (N,)
            return TokenSource(name=name, tokens=ids, vocab_size=BYTE_VOCAB_SIZE)
        encode, vocab_size, eos = _hf_tokenizer(tokenizer)
        stream = TokenStream(_encoded([embedded_corpus().decode("utf-8")], encode, eos), vocab_size)
    else:
        name, file = str(path), Path(path)
        if _probe(file) == "tokens":
            return _map_token_file(file)
        if tokenizer is None and not _is_jsonl(file):  # the file's bytes are its tokens
            return TokenSource(
                name=name,
                tokens=_map(file, np.uint8, 0, file.stat().st_size),
                vocab_size=BYTE_VOCAB_SIZE,
            )
        stream = token_stream(file, tokenizer, text_field)
    dtype = np.uint8 if tokenizer is None else np.int64
    import tempfile

    with tempfile.TemporaryFile(
        prefix="protrain-tokens-"
    ) as tmp:  # unlinked: gone with the process
        n = _write_pieces(tmp, stream.pieces, dtype)
        if n == 0 and tokenizer is not None:
            raise ConfigError(
                f"{name}: the tokenizer in {tokenizer} gives no tokens for this text",
                hint="check the file holds text, or use another --data file",
            )
        tmp.flush()
        # (an empty byte-level corpus, blank documents only, is refused by ``batches``)
        tokens = (
            torch.from_numpy(np.memmap(tmp, dtype=dtype, mode="c", shape=(n,)))
            if n
            else torch.zeros(0, dtype=torch.int64)
        )
    label = name if tokenizer is None else f"{name}@{tokenizer}"
    return TokenSource(name=label, tokens=tokens, vocab_size=stream.vocab_size)


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() in (".jsonl", ".ndjson")


@dataclass(frozen=True)
class TokenStream:
    """A corpus file's tokens as pieces (1D integer arrays) in order, and their vocabulary."""

    pieces: Iterator[np.ndarray]
    vocab_size: int


def token_stream(path: Path, tokenizer: str | None, text_field: str = "text") -> TokenStream:
    """The tokens of a text or JSON-lines file, a piece at a time (what ``load_tokens`` packs).

    Byte-level: the file's bytes, or a ``.jsonl`` file's documents joined by one newline.
    With a tokenizer: each document encoded and followed by the end-of-text token; a
    plain text file is one document. Text reaches the tokenizer in pieces of at most
    ``TEXT_PIECE_BYTES``, each encoded on its own ([Note: tokenizer pieces]).
    """
    docs = _jsonl_documents(path, str(path), text_field) if _is_jsonl(path) else None
    if tokenizer is None:
        if docs is None:
            return TokenStream(_byte_pieces(path), BYTE_VOCAB_SIZE)
        return TokenStream(_joined_document_bytes(docs), BYTE_VOCAB_SIZE)
    encode, vocab_size, eos = _hf_tokenizer(tokenizer)
    if docs is None:
        # errors="replace": a stray invalid byte should cost one token, not the run.
        text = (p.decode("utf-8", errors="replace") for p in _text_pieces(path))
        return TokenStream(_encoded(text, encode, None, eos_last=eos), vocab_size)
    return TokenStream(_encoded(docs, encode, eos), vocab_size)


TEXT_PIECE_BYTES = 64 << 10
"""Text goes to a tokenizer at most this many bytes (UTF-8) at a time ([Note: tokenizer pieces])."""

_READ_BYTES = 1 << 20  # bytes read at a time when the tokens are the bytes
_WHITESPACE = b" \t\n\r\x0b\x0c"

# [Note: tokenizer pieces]
# A Hugging Face tokenizer holds about 230 bytes of RAM per byte of the text it encodes
# (the Rust ``Encoding``: per-byte alignments of the normalised string, per-token
# strings, offsets and masks; measured with a byte-level BPE, BENCHMARKS.md "Tokenising
# memory"), and a 64 MiB line sent whole reached 11.9 GB before the Rust side aborted.
# So no text reaches ``encode`` in a piece of more than ``TEXT_PIECE_BYTES`` (64 KiB:
# ~15 MB inside the tokenizer, and faster per byte than bigger pieces, which fall out
# of cache). A piece is cut, in this order of preference, after the last newline in the
# window, else before its last whitespace byte (so a space stays with the word after it,
# as byte-level BPE and SentencePiece pre-tokenise), else at the last UTF-8 character
# boundary (never inside a multi-byte character). The cut depends on the bytes only, so
# the same file gives the same pieces and tokens on every run. Each piece is encoded on
# its own, so token boundaries can differ from encoding the whole text at the cut points
# only; a text of lines up to 64 KiB is cut at newlines only.


def _byte_pieces(path: Path) -> Iterator[np.ndarray]:
    with open(path, "rb") as f:
        while piece := f.read(_READ_BYTES):
            yield np.frombuffer(piece, dtype=np.uint8)


def _cut(window: bytes, limit: int) -> int:
    """Where to end a piece at the start of ``window`` (``limit`` + 1 bytes or more), in
    ``(0, limit]`` ([Note: tokenizer pieces])."""
    head = window[:limit]
    cut = head.rfind(b"\n") + 1
    if cut > 0:
        return cut
    cut = max(head.rfind(c, 1) for c in _WHITESPACE)
    if cut > 0:
        return cut
    # Back over UTF-8 continuation bytes (0b10xxxxxx) to the start of a character; more
    # than three in a row are not UTF-8, and any cut leaves them as invalid as they were.
    for cut in range(limit, limit - 4, -1):
        if window[cut] & 0xC0 != 0x80:
            return cut
    return limit


def _pieces_of(data: bytes, rest_is_final: bool) -> tuple[list[bytes], bytes]:
    """``data`` cut into pieces of at most ``TEXT_PIECE_BYTES``; (pieces, the unfinished tail)."""
    pieces, start = [], 0
    while len(data) - start > TEXT_PIECE_BYTES or (rest_is_final and start < len(data)):
        if len(data) - start <= TEXT_PIECE_BYTES:
            pieces.append(data[start:])
            return pieces, b""
        cut = _cut(data[start : start + TEXT_PIECE_BYTES + 1], TEXT_PIECE_BYTES)
        pieces.append(data[start : start + cut])
        start += cut
    return pieces, data[start:]


def _text_pieces(path: Path) -> Iterator[bytes]:
    """The file in pieces of at most ``TEXT_PIECE_BYTES`` ([Note: tokenizer pieces])."""
    rest = b""
    with open(path, "rb") as f:
        while block := f.read(_READ_BYTES):
            pieces, rest = _pieces_of(rest + block, rest_is_final=False)
            yield from pieces
    yield from _pieces_of(rest, rest_is_final=True)[0]


def _document_pieces(doc: str) -> Iterator[str]:
    """A document in pieces of at most ``TEXT_PIECE_BYTES`` of UTF-8 ([Note: tokenizer pieces])."""
    if len(doc) <= TEXT_PIECE_BYTES // 4:  # 4 bytes a character at most: one piece
        yield doc
        return
    # surrogatepass: a lone surrogate from JSON reaches the tokenizer as it did uncut.
    data = doc.encode("utf-8", errors="surrogatepass")
    for piece in _pieces_of(data, rest_is_final=True)[0]:
        yield piece.decode("utf-8", errors="surrogatepass")


def _joined_document_bytes(docs: Iterator[str]) -> Iterator[np.ndarray]:
    for i, doc in enumerate(docs):
        data = doc.encode("utf-8")
        yield np.frombuffer(data if i == 0 else b"\n" + data, dtype=np.uint8)


def _encoded(docs, encode, eos: int | None, *, eos_last: int | None = None) -> Iterator[np.ndarray]:
    """Each document's ids, followed by ``eos``; ``eos_last``: one end-of-text after all of them."""
    for doc in docs:
        for piece in _document_pieces(doc):
            yield np.asarray(encode(piece), dtype=np.int64)
        if eos is not None:
            yield np.asarray([eos], dtype=np.int64)
    if eos_last is not None:
        yield np.asarray([eos_last], dtype=np.int64)


def _write_pieces(f, pieces: Iterator[np.ndarray], dtype) -> int:
    """Write every piece to ``f`` as ``dtype``; returns the number of tokens written."""
    n = 0
    for piece in pieces:
        f.write(piece.astype(dtype, copy=False).tobytes())
        n += piece.size
    return n


def _map(path: Path, dtype, offset: int, count: int) -> torch.Tensor:
    """``count`` elements of ``dtype`` of the file from byte ``offset``, memory-mapped (read only
    in effect: mode "c" maps copy-on-write, so nothing can write the file)."""
    return torch.from_numpy(np.memmap(path, dtype=dtype, mode="c", offset=offset, shape=(count,)))


def _jsonl_documents(path: Path, name: str, field: str) -> Iterator[str]:
    """The `field` string of every non-blank line of a JSON-lines file, read a line at a time.

    Lines are those of ``str.splitlines`` on the decoded file (so also ``\\r``, ``\\x0c``,
    ``\\u2028`` … end a line), counted from 1 in error messages.
    """
    import json

    i = 0
    any_doc = False
    with open(path, "rb") as f:
        for raw in f:  # cut after b"\n": no UTF-8 sequence spans it, no line break but "\r\n" does
            for line in raw.decode("utf-8", errors="replace").splitlines():
                i += 1
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except (ValueError, RecursionError) as e:  # (a number past int's digit limit:
                    # ValueError; arrays nested past the interpreter's stack: RecursionError)
                    why = (
                        "nested too deeply"
                        if isinstance(e, RecursionError)
                        else getattr(e, "msg", str(e))
                    )
                    raise ConfigError(
                        f"{name}, line {i}: not JSON ({why})",
                        hint="a .jsonl file holds one JSON object per line; rename a plain "
                        "text file to .txt",
                    ) from None
                text = obj.get(field) if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    keys = ", ".join(sorted(obj)) if isinstance(obj, dict) else type(obj).__name__
                    raise ConfigError(
                        f"{name}, line {i}: no string field {field!r} (found: {keys})",
                        hint="name the field that holds the text with --text-field",
                    )
                if not text.isascii():  # a lone surrogate ("\\ud800") is no text to encode
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError as e:
                        raise ConfigError(
                            f"{name}, line {i}: field {field!r} holds a lone surrogate "
                            f"{text[e.start]!r} at character {e.start}, which is not Unicode text",
                            hint="fix that line (a surrogate pair, or the character itself, "
                            "escaped in JSON)",
                        ) from None
                any_doc = True
                yield text
    if not any_doc:
        raise ConfigError(
            f"{name}: no JSON lines", hint="pass a .jsonl file with one object per line"
        )


def looks_binary(data: bytes) -> str | None:
    """Why ``data`` is not text (None when it is): NUL bytes, or mostly invalid UTF-8."""
    head = data[:PROBE_BYTES]
    if b"\0" in head:
        return "it holds NUL bytes"
    text = head.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - head.decode("utf-8", errors="ignore").count("\ufffd")
    if bad > max(8, len(head) // 100):
        return f"{bad} of its first {len(head)} bytes are not UTF-8"
    return None


PROBE_BYTES = 1 << 16
"""A data file's first bytes that must look like text (``looks_binary``)."""

_PROBE_STEP = (
    4 << 10
)  # read 4 KiB at a time: a NUL byte (any binary file, /dev/zero) stops it there


def regular_file(path: str | os.PathLike, what: str, hint: str) -> None:
    """Refuse ``path`` unless it is a regular file, before it is opened (``reader.special_file``:
    a FIFO waits for a writer forever, a device reads without end, a directory cannot be read).
    Raises ``FileNotFoundError`` (and other ``OSError``) of the ``stat`` as they are."""
    kind = special_file(path)
    if kind is not None:
        raise ConfigError(f"{what} {str(path)!r} is {kind}, not a regular file", hint=hint)


def _probe(path: Path) -> str:
    """``"tokens"`` for a token file, ``"text"`` for a text file; refuse anything else.

    Reads at most ``PROBE_BYTES`` (a few KiB of a binary file: a NUL byte ends the
    reading), never the whole file: a disk image is refused at once, and anything but a
    regular file (``/dev/zero``, a FIFO, a directory) before it is opened.
    """
    head = b""
    try:
        regular_file(path, "data file", "save the text to a file and pass that with --data")
        with open(path, "rb") as f:
            while len(head) < PROBE_BYTES:
                piece = f.read(_PROBE_STEP)
                if not piece:
                    break
                head += piece
                if head.startswith(TOKENS_MAGIC):
                    return "tokens"
                if b"\0" in piece:
                    break
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
    if not head:
        raise ConfigError(
            f"data file {str(path)!r} is empty",
            hint="pass a non-empty text file with --data, or omit it for the embedded corpus",
        )
    why = looks_binary(head)
    if why is not None:
        raise ConfigError(
            f"data file {str(path)!r} is not text: {why}",
            hint="pass a UTF-8 text or .jsonl file with --data, or a token file written by "
            "`protrain tokenize` (protrain does not read other pre-tokenised or compressed files)",
        )
    return "text"


# ------------------------------------------------------------------ token files

TOKENS_MAGIC = b"PTTOKENS"
TOKENS_VERSION = 1
_HEADER = struct.Struct("<8sIIQQ")  # magic, version, bytes per token, token count, vocabulary size
_WIDTHS = {2: np.uint16, 4: np.uint32}
"""[Note: token files]
``protrain tokenize`` writes a corpus as one flat array of token ids after a 32-byte
little-endian header: the magic ``PTTOKENS``, the format version (1), the bytes per
token (2: uint16 when the vocabulary fits, else 4: uint32), the token count and the
vocabulary size. Training maps the array (nanoGPT's and llm.c's layout, with a header
that says how to read it); nothing is parsed per token."""


def token_width(vocab_size: int) -> int:
    """Bytes per token a token file uses for this vocabulary: 2 when every id fits uint16."""
    return 2 if vocab_size <= 1 << 16 else 4


def write_token_file(stream: TokenStream, output: Path) -> int:
    """Write ``stream`` as a token file at ``output`` (atomically); returns the token count."""
    width = token_width(stream.vocab_size)
    tmp = output.with_name(f".{output.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(TOKENS_MAGIC, TOKENS_VERSION, width, 0, stream.vocab_size))
            n = _write_pieces(f, stream.pieces, _WIDTHS[width])
            f.seek(0)
            f.write(_HEADER.pack(TOKENS_MAGIC, TOKENS_VERSION, width, n, stream.vocab_size))
            f.flush()
            os.fsync(f.fileno())
        if n == 0:
            raise ConfigError(
                f"{output}: the input gives no tokens", hint="check the file holds text"
            )
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    return n


def _map_token_file(path: Path) -> TokenSource:
    """A token file's ids, memory-mapped; refuses a header that does not describe the file."""
    with open(path, "rb") as f:
        header = f.read(_HEADER.size)
    size = path.stat().st_size
    fix = f"write it again: `protrain tokenize --data TEXT -o {path}`"
    if len(header) < _HEADER.size:
        raise ConfigError(
            f"token file {str(path)!r} is truncated: {size} bytes, shorter than its header", fix
        )
    magic, version, width, count, vocab = _HEADER.unpack(header)
    if version != TOKENS_VERSION:
        raise ConfigError(
            f"token file {str(path)!r} has format version {version}; this protrain reads "
            f"version {TOKENS_VERSION}",
            fix,
        )
    if width not in _WIDTHS or vocab < 1 or token_width(vocab) > width:
        raise ConfigError(
            f"token file {str(path)!r}: header says {width} bytes per token for a vocabulary "
            f"of {vocab}; expected 2 or 4, wide enough for the vocabulary",
            fix,
        )
    if count < 1 or size != _HEADER.size + count * width:
        raise ConfigError(
            f"token file {str(path)!r}: header says {count} tokens of {width} bytes, so "
            f"{_HEADER.size + count * width} bytes in all, but the file has {size}",
            fix,
        )
    tokens = _map(path, _WIDTHS[width], _HEADER.size, count)
    top = _largest_id(path, _WIDTHS[width], count)
    if top >= vocab:
        raise ConfigError(
            f"token file {str(path)!r} holds token id {top}, outside its vocabulary of {vocab} "
            f"(ids 0 to {vocab - 1}, its header says): a batch that drew it would fail in the "
            "embedding",
            fix,
        )
    return TokenSource(name=str(path), tokens=tokens, vocab_size=vocab, max_id=top)


_ID_BLOCK = 1 << 22
"""Token ids read at a time when a token file's largest id is found (8-16 MiB)."""


def _largest_id(path: Path, dtype, count: int) -> int:
    """The largest id of a token file, read a block at a time into one reused buffer (Issue 39
    item 10). Read, not mapped: a mapping's pages count in the process's resident set as it
    walks them, 4 GB for a 2 GB corpus's token file; read pages stay the kernel's cache."""
    block = np.empty(_ID_BLOCK, dtype=dtype)
    top = 0
    with open(path, "rb") as f:
        f.seek(_HEADER.size)
        for a in range(0, count, _ID_BLOCK):
            n = min(_ID_BLOCK, count - a)
            got = f.readinto(memoryview(block[:n]).cast("B"))
            assert got == n * block.itemsize, (path, a, got)
            top = max(top, int(block[:n].max()))
    return top


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
            raise ConfigError(
                "reading tokenizer.json needs the tokenizers package, which is not installed",
                hint='pip install -e ".[hf]"',
            ) from None
        try:
            tok = Tokenizer.from_file(str(f))
        except Exception as e:  # the Rust side raises a bare Exception for a malformed file
            raise ConfigError(
                f"cannot read {f}: {e}", hint="write it again with tokenizer.save_pretrained(DIR)"
            ) from None
        eos = _eos_id(Path(directory), tok.token_to_id)
        # encode_batch_fast (tokenizers >= 0.21) gives the same ids without tracking offsets:
        # 1.7x the MB/s of encode on a byte-level BPE, and less memory (BENCHMARKS.md).
        fast = getattr(tok, "encode_batch_fast", None)
        if fast is not None:
            return (
                (lambda text: fast([text], add_special_tokens=False)[0].ids),
                tok.get_vocab_size(with_added_tokens=True),
                eos,
            )
        return (
            (lambda text: tok.encode(text, add_special_tokens=False).ids),
            tok.get_vocab_size(with_added_tokens=True),
            eos,
        )
    tok = _transformers_tokenizer(directory)
    return (
        (lambda text: tok.encode(text, add_special_tokens=False, verbose=False)),
        len(tok),
        tok.eos_token_id,
    )


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
    if source.max_id is not None and source.max_id >= vocab_size:
        raise ConfigError(
            f"corpus {source.name!r} holds token id {source.max_id}, outside the model's "
            f"vocab_size={vocab_size} (ids 0 to {vocab_size - 1})",
            hint="tokenize the text with the model's own tokenizer: "
            "`protrain tokenize --data TEXT --tokenizer DIR -o FILE`",
        )
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
            hint=(
                "use a longer corpus (--data FILE), or a plan made with --seq "
                f"{max(n_tokens - 1, 1)} or less"
            ),
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
        window = gather(tokens, mine[:, None] + offsets)  # (B, T+1)
        # contiguous: callers flatten targets with .view(-1), which a strided slice refuses.
        yield window[:, :-1].contiguous(), window[:, 1:].contiguous()  # (B, T), (B, T)


# Unsigned dtypes read through their signed twin and a mask (older torch cannot index them).
_SIGNED = {torch.uint16: (torch.int16, 0xFFFF), torch.uint32: (torch.int32, 0xFFFF_FFFF)}


def gather(tokens: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tokens[index]`` as int64, whatever integer dtype the corpus is stored in."""
    signed = _SIGNED.get(tokens.dtype)
    if signed is None:
        return tokens[index].to(torch.int64)
    view, mask = signed
    return tokens.view(view)[index].to(torch.int64) & mask


HELDOUT_FRACTION = 0.05
"""Share of a corpus's tokens (its tail) held out from training for ``--eval-every``."""

HELDOUT_BATCHES = 4
"""Micro-batches of held-out windows one evaluation averages over."""


def split_heldout(
    source: TokenSource, seq_len: int, fraction: float = HELDOUT_FRACTION
) -> tuple[TokenSource, TokenSource]:
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
            f"corpus {source.name!r} has {n} tokens, too few to hold out {k} for evaluation and "
            f"still train on windows of seq_len + 1 = {seq_len + 1}",
            hint="use a longer corpus (--data FILE), or drop --eval-every",
        )
    train = TokenSource(
        name=f"{source.name}[:-{k}]", tokens=source.tokens[: n - k], vocab_size=source.vocab_size
    )
    heldout = TokenSource(
        name=f"{source.name}[-{k}:]", tokens=source.tokens[n - k :], vocab_size=source.vocab_size
    )
    return train, heldout


def heldout_batches(
    source: TokenSource,
    micro_batch: int,
    seq_len: int,
    n_batches: int = HELDOUT_BATCHES,
    *,
    rank: int = 0,
    world_size: int = 1,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n_batches`` fixed (x, y) micro-batches of ``source``, each (micro_batch, seq_len) int64.

    Window starts are evenly spaced over the source (no randomness: every evaluation
    reads the same tokens). As in ``batches``, each batch is a global batch of
    ``world_size * micro_batch`` windows and rank r keeps its slice, so the ranks'
    mean loss is the single-rank loss of the whole set.
    """
    tokens = source.tokens
    high = tokens.numel() - seq_len - 1  # the last valid start
    if high < 0:
        raise ConfigError(
            f"held-out corpus {source.name!r} has {tokens.numel()} tokens, too few for one "
            f"window of seq_len + 1 = {seq_len + 1}",
            hint="use a longer corpus (--data FILE)",
        )
    total = n_batches * world_size * micro_batch
    starts = torch.linspace(0, high, total).round().to(torch.int64)  # (n*W*B,)
    offsets = torch.arange(seq_len + 1)  # (T+1,)
    out = []
    for i in range(n_batches):
        glob = starts[i * world_size * micro_batch : (i + 1) * world_size * micro_batch]  # (W*B,)
        mine = glob[rank * micro_batch : (rank + 1) * micro_batch]  # (B,)
        window = gather(tokens, mine[:, None] + offsets)  # (B, T+1)
        out.append((window[:, :-1].contiguous(), window[:, 1:].contiguous()))  # (B, T), (B, T)
    return out


def tokenize(
    data_path: str, output: str, tokenizer: str | None = None, text_field: str = "text"
) -> TokenSource:
    """``protrain tokenize``: stream a text or JSON-lines file into a token file; returns it,
    mapped.

    The tokens are exactly those ``load_tokens(data_path, tokenizer, text_field)`` gives,
    so ``train --data OUTPUT`` draws the same batches as ``train --data DATA_PATH``.
    """
    path = Path(data_path)
    if Path(output).resolve() == path.resolve():
        raise ConfigError(
            f"-o {output} is the input file: writing it would destroy the text",
            hint=(
                f"write the tokens elsewhere: `protrain tokenize --data {data_path} -o "
                f"{path.stem}.tokens`"
            ),
        )
    if _probe(path) == "tokens":
        raise ConfigError(
            f"{data_path} is already a token file",
            hint=f"train on it: `protrain train --data {data_path} …`",
        )
    n = write_token_file(token_stream(path, tokenizer, text_field), Path(output))
    source = _map_token_file(Path(output))
    assert source.tokens.numel() == n
    return source
