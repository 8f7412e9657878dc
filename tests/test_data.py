"""Token sources and batching: the embedded corpus, files, determinism, rank slices, errors."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch

from protrain.planner.models.data import (
    TokenSource,
    batches,
    embedded_corpus,
    load_tokens,
    vocab_check,
)
from protrain.plans.errors import ConfigError


def _take(it, n):
    return list(itertools.islice(it, n))


def test_embedded_corpus_is_nonempty_english_and_deterministic():
    data = embedded_corpus()
    assert len(data) > 100_000
    assert b"assignment" in data  # a pydoc topic key: the text is the Python docs
    assert data == embedded_corpus()
    data.decode("utf-8")  # valid UTF-8


def test_default_source_is_byte_level_embedded_corpus():
    src = load_tokens()
    assert src.vocab_size == 256
    assert src.tokens.dtype == torch.int64 and src.tokens.dim() == 1
    assert src.tokens.device.type == "cpu"
    assert src.tokens.numel() == len(embedded_corpus())
    assert bytes(src.tokens[:200].to(torch.uint8).tolist()) == embedded_corpus()[:200]


def test_batches_shape_shift_and_determinism():
    src = load_tokens()
    a = _take(batches(src, micro_batch=4, seq_len=32, seed=7), 3)
    b = _take(batches(src, micro_batch=4, seq_len=32, seed=7), 3)
    c = _take(batches(src, micro_batch=4, seq_len=32, seed=8), 3)
    for (xa, ya), (xb, yb), (xc, _) in zip(a, b, c):
        assert xa.shape == ya.shape == (4, 32)
        assert xa.dtype == ya.dtype == torch.int64
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert not torch.equal(xa, xc)
        assert torch.equal(xa[:, 1:], ya[:, :-1])  # y is x shifted by one token
        assert ya.view(-1).numel() == 4 * 32  # contiguous: .view(-1) works
    assert not torch.equal(a[0][0], a[1][0])  # successive steps differ


def test_windows_are_real_corpus_slices():
    src = TokenSource(name="ramp", tokens=torch.arange(1000) % 256, vocab_size=256)
    x, y = next(batches(src, micro_batch=3, seq_len=10, seed=0))
    # On a ramp every window counts up by one.
    assert torch.all(torch.diff(x, dim=1) % 256 == 1)
    assert torch.equal(y, (x + 1) % 256)


def test_batches_do_not_touch_global_rng():
    before = torch.get_rng_state()
    _take(batches(load_tokens(), micro_batch=2, seq_len=8, seed=0), 2)
    assert torch.equal(torch.get_rng_state(), before)


def test_rank_slices_concatenate_to_the_single_rank_batch():
    src = load_tokens()
    whole = batches(src, micro_batch=6, seq_len=16, seed=3)
    r0 = batches(src, micro_batch=3, seq_len=16, seed=3, rank=0, world_size=2)
    r1 = batches(src, micro_batch=3, seq_len=16, seed=3, rank=1, world_size=2)
    for _ in range(4):
        (xw, yw), (x0, y0), (x1, y1) = next(whole), next(r0), next(r1)
        assert torch.equal(torch.cat([x0, x1]), xw)
        assert torch.equal(torch.cat([y0, y1]), yw)
        assert not torch.equal(x0, x1)


def test_file_source(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_bytes("héllo wörld\n".encode() * 10)
    src = load_tokens(str(path))
    assert src.name == str(path)
    assert src.vocab_size == 256
    assert src.tokens.tolist() == list(path.read_bytes())
    x, y = next(batches(src, micro_batch=2, seq_len=8, seed=0))
    assert x.shape == (2, 8) and torch.equal(x[:, 1:], y[:, :-1])


def test_missing_file_is_a_config_error(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(ConfigError, match="nope.txt") as info:
        load_tokens(str(missing))
    assert info.value.hint is not None


def test_empty_file_is_a_config_error(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")
    with pytest.raises(ConfigError, match="empty"):
        load_tokens(str(path))


def test_directory_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not a regular file"):
        load_tokens(str(tmp_path))


def test_too_short_corpus_is_a_config_error(tmp_path):
    path = tmp_path / "short.txt"
    path.write_bytes(b"0123456789")  # 10 tokens: one window of seq_len 9 fits, 10 does not
    src = load_tokens(str(path))
    x, y = next(batches(src, micro_batch=2, seq_len=9, seed=0))
    assert x.tolist() == [list(b"012345678")] * 2 and y.tolist() == [list(b"123456789")] * 2
    with pytest.raises(ConfigError, match="too few") as info:
        batches(src, micro_batch=1, seq_len=10, seed=0)  # raises at the call, not at next()
    assert "--seq 9" in info.value.hint and "--seq-len" not in info.value.hint


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(micro_batch=0, seq_len=8), "micro_batch=0"),
        (dict(micro_batch=2, seq_len=0), "seq_len=0"),
        (dict(micro_batch=2, seq_len=8, rank=2, world_size=2), "rank=2"),
        (dict(micro_batch=2, seq_len=8, rank=-1), "rank=-1"),
    ],
)
def test_bad_batch_arguments_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        batches(load_tokens(), seed=0, **kwargs)


def test_vocab_check():
    src = load_tokens()
    vocab_check(src, 256)
    vocab_check(src, 50257)
    with pytest.raises(ConfigError, match="vocab_size=100") as info:
        vocab_check(src, 100)
    assert "byte-level" in info.value.hint


def test_tokenizer_without_transformers_is_a_config_error(monkeypatch, tmp_path):
    # A None entry in sys.modules makes `import transformers` raise ImportError.
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ConfigError) as info:
        load_tokens(tokenizer=str(tmp_path))
    assert info.value.hint == 'pip install -e ".[hf]"'


# ------------------------------------------------------------------ held-out split


def _numbered(n: int) -> TokenSource:
    """Token i at position i: a window's values say where it was cut from."""
    return TokenSource(name="numbered", tokens=torch.arange(n), vocab_size=n)


def test_split_heldout_is_a_fixed_tail_never_trained_on():
    from protrain.planner.models.data import HELDOUT_FRACTION, split_heldout

    src = _numbered(10_000)
    train, tail = split_heldout(src, seq_len=16)
    k = tail.tokens.numel()
    assert k == 10_000 * HELDOUT_FRACTION and torch.equal(
        torch.cat([train.tokens, tail.tokens]), src.tokens
    )
    split = train.tokens.numel()
    for _, y in _take(batches(train, 8, 16, seed=0), 200):
        assert int(y.max()) < split  # every window (inputs and targets) ends before the tail
    # At least one window is held out, even from a short corpus.
    train, tail = split_heldout(_numbered(100), seq_len=30)
    assert tail.tokens.numel() == 31 and train.tokens.numel() == 69


def test_split_heldout_refuses_a_corpus_too_short_for_both():
    from protrain.planner.models.data import split_heldout

    with pytest.raises(ConfigError, match="too few to hold out"):
        split_heldout(_numbered(50), seq_len=30)


def test_heldout_batches_are_fixed_and_sliced_by_rank():
    from protrain.planner.models.data import heldout_batches

    tail = _numbered(1000)
    one = heldout_batches(tail, 4, 16, 3)
    assert len(one) == 3 and all(x.shape == (4, 16) and y.shape == (4, 16) for x, y in one)
    assert all(torch.equal(x[:, 1:], y[:, :-1]) for x, y in one)
    again = heldout_batches(tail, 4, 16, 3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(one, again))  # no randomness
    assert (
        int(one[0][0][0, 0]) == 0 and int(one[-1][1][-1, -1]) == 999
    )  # spread over the whole tail
    # Two ranks of micro-batch 2 see the single-rank batch of 4, split in halves.
    r0 = heldout_batches(tail, 2, 16, 3, rank=0, world_size=2)
    r1 = heldout_batches(tail, 2, 16, 3, rank=1, world_size=2)
    for (x, _), (a, _), (b, _) in zip(one, r0, r1):
        assert torch.equal(torch.cat([a, b]), x)


# ------------------------------------------------------------------ bounded memory, token files
# (data.py [Note: bounded memory], [Note: token files])


def _traced_peak(fn) -> int:
    """Peak bytes Python allocated while ``fn()`` ran (a whole-file read is one such allocation)."""
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_binary_input_is_refused_after_a_few_kib(tmp_path):
    # 64 MiB of zeros (a sparse file: nothing written): refused after its first 4 KiB, not read
    # whole.
    path = tmp_path / "zeros.bin"
    with open(path, "wb") as f:
        f.truncate(64 << 20)

    def load():
        with pytest.raises(ConfigError, match="NUL bytes") as info:
            load_tokens(str(path))
        assert "protrain tokenize" in info.value.hint

    assert _traced_peak(load) < 1 << 20


def test_dev_zero_is_refused():
    import os

    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    with pytest.raises(ConfigError, match="'/dev/zero' is a device, not a regular file"):
        load_tokens("/dev/zero")


def test_text_and_jsonl_files_are_not_read_whole(tmp_path):
    import json

    text = tmp_path / "big.txt"
    text.write_bytes(b"the planner writes a plan\n" * (1 << 19))  # 13 MiB
    src = _traced_peak(lambda: load_tokens(str(text)))
    assert src < 1 << 20
    lines = tmp_path / "big.jsonl"
    lines.write_text(
        "".join(json.dumps({"text": f"document {i} " * 200}) + "\n" for i in range(2000))
    )  # ~5 MiB
    assert _traced_peak(lambda: load_tokens(str(lines))) < 1 << 20
    source = load_tokens(str(lines))
    first = b"document 0 " * 200 + b"\n" + b"document 1 " * 200
    assert bytes(source.tokens[: len(first)].tolist()) == first  # documents joined by one newline
    x, y = next(batches(source, micro_batch=2, seq_len=64, seed=0))
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])


def _tiny_tokenizer(directory, vocab_size=300):
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    directory.mkdir()
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(
        ["the planner writes a plan", "chunks move between host and device"], trainer
    )
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return str(directory)


@pytest.mark.parametrize("kind", ["txt", "jsonl", "txt+tokenizer", "jsonl+tokenizer"])
def test_tokenize_gives_the_batches_of_the_text(tmp_path, kind):
    import json

    from click.testing import CliRunner

    from protrain.planner.commands.cli import main

    pytest.importorskip("tokenizers")
    sentences = [
        "the planner writes a plan",
        "chunks move between hést and device\r\nagain",
        "plan\u2028it",
    ]
    if kind.startswith("txt"):
        data = tmp_path / "c.txt"
        data.write_text("\n".join(sentences * 40), encoding="utf-8")
    else:
        data = tmp_path / "c.jsonl"
        data.write_text(
            "".join(json.dumps({"body": s}) + "\n" for s in sentences * 40), encoding="utf-8"
        )
    tok = _tiny_tokenizer(tmp_path / "tok") if kind.endswith("tokenizer") else None
    out = tmp_path / "c.tokens"
    args = ["tokenize", "--data", str(data), "--text-field", "body", "-o", str(out)]
    r = CliRunner().invoke(main, args + (["--tokenizer", tok] if tok else []))
    assert r.exit_code == 0, r.output
    assert "uint16" in r.output and "protrain train --data" in r.output
    text, tokens = load_tokens(str(data), tokenizer=tok, text_field="body"), load_tokens(str(out))
    assert tokens.vocab_size == text.vocab_size and tokens.tokens.dtype == torch.uint16
    assert tokens.tokens.tolist() == text.tokens.tolist()
    for (xa, ya), (xb, yb) in zip(
        _take(batches(text, 3, 16, 5), 3), _take(batches(tokens, 3, 16, 5), 3)
    ):
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and xb.dtype == torch.int64
    # A token file is not tokenised again, and the input is never the output.
    r = CliRunner().invoke(
        main, ["tokenize", "--data", str(out), "-o", str(tmp_path / "again.tokens")]
    )
    assert r.exit_code == 1 and "already a token file" in r.output
    r = CliRunner().invoke(main, ["tokenize", "--data", str(data), "-o", str(data)])
    assert r.exit_code == 1 and "is the input file" in r.output and data.stat().st_size > 0


def test_token_file_of_a_big_vocabulary_is_uint32(tmp_path):
    import numpy as np

    from protrain.planner.models.data import TokenStream, write_token_file

    ids = np.array([0, 65_535, 65_536, 99_999, 7], dtype=np.int64)
    path = tmp_path / "big.tokens"
    assert write_token_file(TokenStream(iter([ids[:2], ids[2:]]), 100_000), path) == 5
    src = load_tokens(str(path))
    assert src.tokens.dtype == torch.uint32 and src.vocab_size == 100_000
    x, y = next(batches(src, micro_batch=1, seq_len=4, seed=0))
    assert x.tolist() == [ids[:4].tolist()] and y.tolist() == [ids[1:].tolist()]


def test_damaged_token_files_are_refused(tmp_path):
    import numpy as np

    from protrain.planner.models.data import TokenStream, write_token_file

    path = tmp_path / "c.tokens"
    write_token_file(TokenStream(iter([np.arange(100)]), 256), path)
    data = path.read_bytes()
    path.write_bytes(data[:-3])
    with pytest.raises(ConfigError, match="header says 100 tokens") as info:
        load_tokens(str(path))
    assert "protrain tokenize" in info.value.hint
    path.write_bytes(data[:8] + (9).to_bytes(4, "little") + data[12:])
    with pytest.raises(ConfigError, match="format version 9"):
        load_tokens(str(path))


@pytest.mark.slow
def test_a_large_corpus_trains_in_the_memory_of_a_small_one(tmp_path, monkeypatch):
    # tools/bench/corpus.py end to end on 2 MB and 2 GB generated corpora (as BENCHMARKS.md's
    # 20 MB against 2 GB): tokenize, train on the token file, train on the text, each a process
    # of its own; the big corpus may not raise any of their peak RSS by more than 48 MiB (the
    # old whole-file read of 2 GB needed tens of gigabytes: a 47 MB text peaked at 700 MB).
    # The 2 GB text and its 4 GB token file need 6 GB of disk at once.
    import shutil

    if shutil.disk_usage(tmp_path).free < 8 << 30:
        pytest.skip("needs 8 GiB free for a 2 GB corpus and its token file")
    from tools.bench import corpus as bench_corpus

    small = bench_corpus.measure(tmp_path, 2_000_000, steps=2)
    big = bench_corpus.measure(tmp_path, 2_000_000_000, steps=2)
    for key in ("tokenize_rss", "train_tokens_rss", "train_text_rss"):
        assert big[key] - small[key] < 48 << 20, (key, small[key], big[key])


@pytest.mark.slow
def test_train_on_a_token_file_is_train_on_its_text(tmp_path):
    from pathlib import Path

    from protrain.planner.commands.train import train
    from protrain.planner.models.data import tokenize

    text = tmp_path / "c.txt"
    text.write_bytes(embedded_corpus()[:200_000])
    tokenize(str(text), str(tmp_path / "c.tokens"))
    plan = str(Path(__file__).resolve().parent.parent / "plans" / "gpt2-tiny" / "example.json")
    quiet = dict(steps=2, echo=lambda _: None, progress=False, device="cpu", eval_every=1)
    assert train(plan, "gpt2-tiny", data_path=str(tmp_path / "c.tokens"), **quiet) == train(
        plan, "gpt2-tiny", data_path=str(text), **quiet
    )


def test_a_long_line_reaches_the_tokenizer_in_bounded_pieces(tmp_path, monkeypatch):
    # Issue 39 item 9: a file of one long line was one piece, whatever its size (a 64 MiB line
    # reached 11.9 GB inside the Rust tokenizer). Pieces are cut after a newline, else before
    # whitespace, else at a UTF-8 character boundary, never above TEXT_PIECE_BYTES, and the
    # same bytes are cut the same way however the file is read.
    from protrain.planner.models import data

    monkeypatch.setattr(data, "TEXT_PIECE_BYTES", 64)
    monkeypatch.setattr(data, "_READ_BYTES", 100)  # reads that do not fall on piece boundaries
    cases = {
        "spaces": ("plan héllo wörld " * 50).encode(),
        "no-space": ("é€𝄞a" * 200).encode(),  # 2-, 3- and 4-byte characters, no whitespace
        "lines": b"".join(b"line %d of the text\n" % i for i in range(100)),
    }
    for name, raw in cases.items():
        (tmp_path / name).write_bytes(raw)
        pieces = list(data._text_pieces(tmp_path / name))
        assert b"".join(pieces) == raw, name
        assert all(0 < len(p) <= 64 for p in pieces), (name, [len(p) for p in pieces])
        for p in pieces:
            p.decode("utf-8")  # no character cut in two
        assert pieces == data._pieces_of(raw, rest_is_final=True)[0]  # read size does not matter
    spaced = list(data._text_pieces(tmp_path / "spaces"))
    assert all(p.startswith(b" ") for p in spaced[1:])  # a space stays with the word after it
    assert all(p.endswith(b"\n") for p in data._text_pieces(tmp_path / "lines"))
    # A .jsonl document is cut the same way.
    doc = ("é€𝄞a" * 200) + " tail"
    assert "".join(data._document_pieces(doc)) == doc
    assert all(len(p.encode()) <= 64 for p in data._document_pieces(doc))
    # Cut at newlines, a byte-level BPE gives the ids of the whole text (end-of-text after).
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    tok = _tiny_tokenizer(tmp_path / "tok")
    whole = Tokenizer.from_file(tok + "/tokenizer.json").encode(cases["lines"].decode()).ids
    eos = Tokenizer.from_file(tok + "/tokenizer.json").token_to_id("<|endoftext|>")
    assert load_tokens(str(tmp_path / "lines"), tokenizer=tok).tokens.tolist() == [*whole, eos]


_TOKENIZE_PEAK = """
import resource, sys
from protrain.planner.models.data import load_tokens
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
src = load_tokens(sys.argv[1], tokenizer=sys.argv[2])
print(src.tokens.numel(), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.slow
def test_tokenising_a_one_line_file_takes_bounded_memory(tmp_path):
    # Issue 39 item 9: a Hugging Face tokenizer holds ~230 bytes per byte of what it encodes,
    # and a one-line file went to it whole: this 4 MiB line took ~900 MB more (a 64 MiB one
    # 11.9 GB). In pieces of TEXT_PIECE_BYTES it takes ~20 MB. A process of its own, its
    # address space capped at 3 GiB, so the old behaviour fails without taking the box down.
    import random
    import resource
    import subprocess

    pytest.importorskip("tokenizers")
    tok = _tiny_tokenizer(tmp_path / "tok")
    words = "the planner writes a plan and chunks move between hést and device".split()
    rng = random.Random(0)
    text = tmp_path / "one-line.txt"
    text.write_text(" ".join(rng.choice(words) for _ in range(700_000))[: 4 << 20], "utf-8")

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    r = subprocess.run(
        [sys.executable, "-c", _TOKENIZE_PEAK, str(text), tok],
        capture_output=True,
        text=True,
        preexec_fn=cap,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    tokens, grew = map(int, r.stdout.split())
    assert tokens > 1_000_000 and grew < 100 << 20, grew
