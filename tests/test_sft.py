"""Fine-tuning data: every refusal (file, line, field and fix), the sources, the cache (reuse,
invalidation, atomic writes), packing on its own, ``micro_batch``'s shift and padding, and
bounded memory on a multi-MB chat file."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from protrain.planner.models import sft_cache
from protrain.planner.models.packing import pack
from protrain.planner.models.sft import IGNORE, load_sft, micro_batch
from protrain.plans.errors import ConfigError
from tools.chatdata import (
    CHATML_PLAIN,
    chats,
    prompt_completions,
    texts,
    tokenizer_dir,
    write_jsonl,
)

pytest.importorskip("transformers")


@pytest.fixture
def tok(tmp_path):
    return tokenizer_dir(tmp_path / "tok")


def _load(paths, tok, **kw):
    kw.setdefault("seq_len", 128)
    return load_sft([str(p) for p in paths], tokenizer_dir=tok, **kw)


def _refused(tmp_path, tok, records, match, name="d.jsonl", **kw):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    with pytest.raises(ConfigError, match=match) as e:
        _load([path], tok, **kw)
    assert e.value.hint, "every refusal says how to fix it"
    return str(e.value)


# ---------------------------------------------------------------- refusals

GOOD = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}


@pytest.mark.parametrize(
    "bad, match",
    [
        ("[1, 2]", r"d\.jsonl, line 2: the record is a JSON list, not an object"),
        ("{not json", r"d\.jsonl, line 2: not JSON"),
        ({"messages": "hi"}, r"line 2, field 'messages': a string, not a list of messages"),
        ({"messages": []}, r"line 2, field 'messages': an empty list"),
        (
            {"messages": [{"role": "asistant", "content": "x"}]},
            r"line 2, field 'messages'\[0\]\.role: 'asistant' is not a role \(did you mean "
            r"'assistant'\?\)",
        ),
        ({"messages": [{"role": "user", "content": 3}]}, r"'messages'\[0\]\.content: a number"),
        ({"prompt": "p"}, r"line 2: field 'completion' is missing"),
        ({"prompt": "p", "completion": ["x"]}, r"line 2: field 'prompt' is a string and"),
        ({"body": "x"}, r"line 2: no field of a known format \(found: body\)"),
        ({"text": "x"}, r"line 2: a text record in a file of messages records"),
    ],
)
def test_a_malformed_record_is_refused_with_file_line_and_field(tmp_path, tok, bad, match):
    _refused(tmp_path, tok, [GOOD, bad], match)


def test_a_mistyped_text_field_and_the_text_field_flag(tmp_path, tok):
    _refused(tmp_path, tok, [{"text": 3}], r"line 1: field 'text' is a number, not a string")
    path = write_jsonl(tmp_path / "b.jsonl", [{"body": "the plan"}])
    assert _load([path], tok, text_field="body").n_rows == 1


def test_conversational_data_without_a_template_is_refused(tmp_path):
    bare = tokenizer_dir(tmp_path / "bare", template=None)
    msg = _refused(tmp_path, bare, [GOOD], "need a chat template")
    assert "pass one with --chat-template FILE.jinja" in msg
    (tmp_path / "t.jinja").write_text(CHATML_PLAIN)
    path = write_jsonl(tmp_path / "c.jsonl", [GOOD])
    assert _load([path], bare, chat_template=str(tmp_path / "t.jinja")).n_rows == 1


def test_assistant_loss_needs_generation_markers(tmp_path, tok):
    (tmp_path / "plain.jinja").write_text(CHATML_PLAIN)
    _refused(
        tmp_path,
        tok,
        [GOOD],
        r"--loss-on assistant needs a chat template with \{% generation %\} markers",
        loss_on="assistant",
        chat_template=str(tmp_path / "plain.jinja"),
    )


@pytest.mark.parametrize(
    "records, kw, match",
    [
        (texts(2), {"loss_on": "assistant"}, "does not apply to text records"),
        (chats(2), {"loss_on": "completion"}, "does not apply to messages records"),
        (texts(2), {"loss_on": "everything"}, "'everything' is not a mode"),
        (texts(2), {"packing": "ffd"}, "'ffd' is not a strategy"),
        (texts(2), {"seq_len": 1}, "a row needs at least 2 tokens"),
    ],
)
def test_bad_flag_combinations_are_refused(tmp_path, tok, records, kw, match):
    _refused(tmp_path, tok, records, match, **kw)


def test_unknown_sources_are_refused(tmp_path, tok):
    _refused(tmp_path, tok, ["x"], r"cannot read \.csv", name="d.csv")
    (tmp_path / "dir").mkdir()
    with pytest.raises(ConfigError, match="not one `datasets` wrote"):
        _load([tmp_path / "dir"], tok)
    with pytest.raises(ConfigError, match="does not exist"):
        _load([tmp_path / "nope.jsonl"], tok)


def test_an_example_with_no_assistant_token_is_refused(tmp_path, tok):
    only_user = {"messages": [{"role": "user", "content": "a"}]}
    _refused(
        tmp_path,
        tok,
        [GOOD, only_user],
        r"line 2: --loss-on assistant and this record",
        loss_on="assistant",
    )


# ---------------------------------------------------------------- sources


def test_every_source_gives_the_rows_of_json_lines(tmp_path, tok, monkeypatch):
    from protrain.planner.models import sft_records

    records = chats(40) + [{"messages": GOOD["messages"], "tools": None}]
    jsonl = write_jsonl(tmp_path / "d.jsonl", records[:40])
    want = _rows(_load([jsonl], tok))
    # .json: one list, parsed a record at a time through a window smaller than a record
    (tmp_path / "d.json").write_text(json.dumps(records[:40], indent=2))
    monkeypatch.setattr(sft_records, "_JSON_READ_BYTES", 100)
    assert _rows(_load([tmp_path / "d.json"], tok)) == want
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(records[:40]), tmp_path / "d.parquet", row_group_size=7)
    assert _rows(_load([tmp_path / "d.parquet"], tok)) == want
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(records[:40]).save_to_disk(str(tmp_path / "saved"))
    assert _rows(_load([tmp_path / "saved"], tok)) == want


def test_a_json_record_error_names_record_and_line(tmp_path, tok):
    (tmp_path / "d.json").write_text('[\n{"text": "a"},\n{"text": 5}\n]')
    with pytest.raises(
        ConfigError, match=r"d\.json, record 2 \(line 3\): field 'text' is a number"
    ):
        _load([tmp_path / "d.json"], tok)


def _rows(rows):
    return [tuple(a.tolist() for a in rows.row(i)) for i in range(rows.n_rows)]


# ---------------------------------------------------------------- cache


def test_the_cache_is_reused_and_rebuilt_when_an_input_changes(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", chats(20))
    calls = []
    first = _rows(_load([path], tok, progress=lambda *a: calls.append(a)))
    assert calls, "the first load tokenises"
    calls.clear()
    assert _rows(_load([path], tok, progress=lambda *a: calls.append(a))) == first
    assert calls == [], "the second load reads the cache"
    root = tmp_path / sft_cache.CACHE_DIR_NAME
    assert len(list(root.iterdir())) == 1
    (tmp_path / "t.jinja").write_text(CHATML_PLAIN.replace("<|im_start|>", "<|im_start|> "))
    changed = _rows(_load([path], tok, chat_template=str(tmp_path / "t.jinja")))
    assert changed != first and len(list(root.iterdir())) == 2, "a new template, a new cache"
    _load([path], tok, loss_on="assistant")
    assert len(list(root.iterdir())) == 3, "another loss mode, another cache"
    write_jsonl(tmp_path / "d.jsonl", chats(21))
    assert len(_load([path], tok).caches[0].lengths) == 21, "new data, a new cache"


def test_a_killed_build_leaves_nothing_that_is_read(tmp_path, tok, monkeypatch):
    from protrain.planner.models import sft_tokens

    path = write_jsonl(tmp_path / "d.jsonl", chats(20))
    real = sft_tokens.Encoder.encode
    seen = []

    def dying(self, record, loss):
        seen.append(1)
        if len(seen) == 10:
            raise KeyboardInterrupt
        return real(self, record, loss)

    monkeypatch.setattr(sft_tokens.Encoder, "encode", dying)
    with pytest.raises(KeyboardInterrupt):
        _load([path], tok)
    root = tmp_path / sft_cache.CACHE_DIR_NAME
    assert list(root.iterdir()) == [], "no half cache"
    monkeypatch.setattr(sft_tokens.Encoder, "encode", real)
    assert _load([path], tok).n_examples == 20


def test_an_unwritable_data_directory_caches_in_the_user_cache(tmp_path, tok, monkeypatch):
    data = tmp_path / "ro"
    data.mkdir()
    path = write_jsonl(data / "d.jsonl", chats(3))
    monkeypatch.setattr(sft_cache.os, "access", lambda p, mode: False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    _load([path], tok)
    assert not (data / sft_cache.CACHE_DIR_NAME).exists()
    assert len(list((tmp_path / "xdg" / "protrain" / "sft").iterdir())) == 1


# ---------------------------------------------------------------- rows and micro-batches


def test_rows_mark_example_starts_and_restart_positions(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", texts(50))
    rows = _load([path], tok, seq_len=64)
    for i in range(rows.n_rows):
        ids, labels, pos = rows.row(i)
        assert len(ids) <= 64 and ids.dtype == labels.dtype == pos.dtype == np.int64
        starts = pos == 0
        assert starts[0] and (labels[starts] == IGNORE).all()
        assert (labels[~starts] == ids[~starts]).all(), "text: every other token is a label"
        assert rows.supervised(i) == int((~starts).sum())


def test_micro_batch_shifts_and_pads(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", prompt_completions(30))
    rows = _load([path], tok, seq_len=64)
    idx, targets, pos = micro_batch(rows, [1, 0], 64)
    assert idx.shape == targets.shape == pos.shape == (2, 64)
    assert idx.dtype == targets.dtype == pos.dtype == torch.int64
    for j, i in enumerate([1, 0]):
        ids, labels, p = rows.row(i)
        n = len(ids)
        assert idx[j, :n].tolist() == ids.tolist() and (idx[j, n:] == rows.pad_id).all()
        assert targets[j, : n - 1].tolist() == labels[1:].tolist()
        assert (targets[j, n - 1 :] == IGNORE).all(), "the last token and the padding: no target"
        assert pos[j, :n].tolist() == p.tolist() and pos[j, n:].tolist() == list(range(64 - n))
        assert int((targets[j] != IGNORE).sum()) == rows.supervised(i)
    with pytest.raises(ConfigError, match="more than seq_len=8"):
        micro_batch(rows, [0], 8)
    # EMPTY (-1): a row of padding only, which fills an epoch's last step (models/epochs.py)
    idx, targets, pos = micro_batch(rows, [0, -1], 64)
    assert (idx[1] == rows.pad_id).all() and (targets[1] == IGNORE).all()
    assert (
        pos[1].tolist() == list(range(64))
        and idx[0].tolist() == micro_batch(rows, [0], 64)[0][0].tolist()
    )


def test_bfd_packs_best_fit_decreasing_in_runs_of_a_thousand():
    # lengths 5, 3, 4, 2, 0 into rows of 6: 5 opens row 0; 4 opens row 1; 3 opens row 2;
    # 2 best-fits row 1 (room 2, less than row 2's room 3); the empty example is dropped.
    p = pack(np.array([5, 3, 4, 2, 0]), 6, "bfd")
    assert p.row_ptr.tolist() == [0, 1, 3, 4]
    assert p.example.tolist() == [0, 2, 3, 1] and p.length.tolist() == [5, 4, 2, 3]
    cut = pack(np.array([9, 1]), 6, "bfd")
    assert cut.length.tolist() == [6, 1], "9 is cut to the row; 1 cannot join a full row"
    assert cut.example.tolist() == [0, 1] and cut.row_ptr.tolist() == [0, 1, 2]
    # 1001 examples of 2 into rows of 6: one run would fill 334 rows; TRL's runs of 1000 give
    # 334 for the first run (its last row holds one example) and a row for the 1001st alone.
    runs = pack(np.full(1001, 2), 6, "bfd")
    assert runs.n_rows == 335 and runs.example[runs.row_ptr[-2] :].tolist() == [1000]
    wrapped = pack(np.array([4, 4, 4]), 5, "wrapped")
    assert wrapped.row_ptr.tolist() == [0, 2, 4, 5]
    assert wrapped.start.tolist() == [0, 0, 1, 0, 2] and wrapped.length.tolist() == [4, 1, 3, 2, 2]


# ---------------------------------------------------------------- bounded memory

_RSS = textwrap.dedent(
    """
    import resource, sys
    from protrain.planner.models.sft import load_sft
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = load_sft([sys.argv[1]], tokenizer_dir=sys.argv[2], seq_len=256, loss_on="assistant")
    for i in range(0, rows.n_rows, 97):
        rows.row(i)
    print(rows.n_examples, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
    """
)


@pytest.mark.slow  # tokenises a multi-MB chat file in a subprocess (~6 s)
def test_tokenising_a_multi_mb_chat_file_stays_in_bounded_memory(tmp_path, tok):
    """Peak RSS growth (KiB) while a ~6 MB chat JSONL is tokenised, cached and packed, measured
    after transformers is imported: it must not grow with the file (the whole file as Python
    objects would be ~10x its size)."""
    path = tmp_path / "big.jsonl"
    one = chats(300)
    with open(path, "w") as f:
        for _ in range(60):
            f.write("".join(json.dumps(r) + "\n" for r in one))
    size = path.stat().st_size
    assert size > 5 << 20
    warm = "import transformers, numpy, tokenizers; transformers.AutoTokenizer\n"
    out = subprocess.run(
        [sys.executable, "-c", warm + _RSS, str(path), tok],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    n_examples, grew_kib = int(out[0]), int(out[1])
    assert n_examples == 18000
    assert grew_kib * 1024 < size, (grew_kib, size)


# ---------------------------------------------------------------- protrain data


def test_protrain_data_shows_the_rows_and_marks_what_trains(tmp_path, tok):
    from click.testing import CliRunner

    from protrain.planner.commands.cli import main

    path = write_jsonl(tmp_path / "d.jsonl", chats(12))
    args = ["data", "--hf-config", tok, "--data", path, "--seq", "256", "--loss-on", "assistant"]
    result = CliRunner().invoke(main, [*args, "--limit", "1"])
    assert result.exit_code == 0, result.output
    rows = _load([path], tok, seq_len=256, loss_on="assistant")
    head, row0 = result.output.splitlines()[0], result.output.split("── row 1")[0]
    assert f"{rows.n_rows} rows of 256 from 12 examples (0 dropped, 0 truncated)" in head
    supervised = sum(rows.supervised(i) for i in range(rows.n_rows))
    assert f"{supervised} supervised targets" in head
    # the assistant's answers train, the user's turns do not
    assert "⟦" + chats(12)[0]["messages"][2]["content"] + "<|im_end|>⟧" in row0
    assert "⟦" + chats(12)[0]["messages"][1]["content"] not in row0
    assert "── row 1" not in result.output, "--limit 1"
    short = CliRunner().invoke(main, [*args, "--seq", "64", "--packing", "wrapped", "--limit", "0"])
    assert "(0 dropped, 0 truncated)" in short.output, "wrapped splits examples, cuts none"
    cut = CliRunner().invoke(main, [*args, "--seq", "64", "--limit", "0"])
    n_long = int((_load([path], tok, seq_len=256).caches[0].lengths > 64).sum())
    assert n_long and f"(0 dropped, {n_long} truncated)" in cut.output
    bad = CliRunner().invoke(main, [*args[:-2], "--loss-on", "completion"])
    assert bad.exit_code == 1 and "does not apply to messages records" in bad.output


@pytest.mark.parametrize("packing", ["bfd", "wrapped", "none"])
def test_supervised_counts_read_in_blocks_equal_each_rows_count(tmp_path, monkeypatch, packing):
    # [Note: counting without mapping]: the counts come from the mask file read in blocks
    # (small blocks here, so ranges straddle them), and equal each row's own count.
    from protrain.planner.models import sft

    monkeypatch.setattr(sft, "MASK_BLOCK", 97)
    tok = tokenizer_dir(tmp_path / "tok")
    data = write_jsonl(tmp_path / "c.jsonl", chats(60))
    rows = sft.load_sft(
        [data], tokenizer_dir=tok, seq_len=48, loss_on="assistant", packing=packing,
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    counts = rows.supervised_counts()
    assert counts.tolist() == [rows.supervised(i) for i in range(rows.n_rows)]
    assert counts.sum() > 0
