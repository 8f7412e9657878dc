"""Token sources and batching: the embedded corpus, files, determinism, rank slices, errors."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch

from protrain.executor.errors import ConfigError
from protrain.planner.data import (
    TokenSource,
    batches,
    embedded_corpus,
    load_tokens,
    vocab_check,
)


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
    with pytest.raises(ConfigError, match="cannot read"):
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
    from protrain.planner.data import HELDOUT_FRACTION, split_heldout

    src = _numbered(10_000)
    train, tail = split_heldout(src, seq_len=16)
    k = tail.tokens.numel()
    assert k == 10_000 * HELDOUT_FRACTION and torch.equal(torch.cat([train.tokens, tail.tokens]), src.tokens)
    split = train.tokens.numel()
    for _, y in _take(batches(train, 8, 16, seed=0), 200):
        assert int(y.max()) < split  # every window (inputs and targets) ends before the tail
    # At least one window is held out, even from a short corpus.
    train, tail = split_heldout(_numbered(100), seq_len=30)
    assert tail.tokens.numel() == 31 and train.tokens.numel() == 69


def test_split_heldout_refuses_a_corpus_too_short_for_both():
    from protrain.planner.data import split_heldout

    with pytest.raises(ConfigError, match="too few to hold out"):
        split_heldout(_numbered(50), seq_len=30)


def test_heldout_batches_are_fixed_and_sliced_by_rank():
    from protrain.planner.data import heldout_batches

    tail = _numbered(1000)
    one = heldout_batches(tail, 4, 16, 3)
    assert len(one) == 3 and all(x.shape == (4, 16) and y.shape == (4, 16) for x, y in one)
    assert all(torch.equal(x[:, 1:], y[:, :-1]) for x, y in one)
    again = heldout_batches(tail, 4, 16, 3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(one, again))  # no randomness
    assert int(one[0][0][0, 0]) == 0 and int(one[-1][1][-1, -1]) == 999  # spread over the whole tail
    # Two ranks of micro-batch 2 see the single-rank batch of 4, split in halves.
    r0 = heldout_batches(tail, 2, 16, 3, rank=0, world_size=2)
    r1 = heldout_batches(tail, 2, 16, 3, rank=1, world_size=2)
    for (x, _), (a, _), (b, _) in zip(one, r0, r1):
        assert torch.equal(torch.cat([a, b]), x)
