"""Same rows as TRL: ``protrain data --json`` equals TRL 1.16 ``SFTTrainer``'s prepared
``train_dataset`` row for row (issue 40's first acceptance point).

TRL's row is turned into ours as its collator turns it into a batch: labels from its
``labels`` column (its assistant/completion masks applied) with -100 at each packed example's
first token, position ids from ``seq_lengths`` (counting from 0 per example)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from protrain.planner.commands.cli import main
from tools.chatdata import chats, prompt_completions, texts, tokenizer_dir, write_jsonl

pytest.importorskip("trl")
pytest.importorskip("datasets")


def _trl_rows(tok_dir, records, *, max_length, packing, strategy="bfd", **loss):
    import datasets
    import transformers
    import trl

    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    args = trl.SFTConfig(
        output_dir=str(tok_dir) + "-out",
        max_length=max_length,
        packing=packing,
        packing_strategy=strategy,
        report_to=[],
        bf16=False,
        use_cpu=True,
        **loss,
    )
    trainer = trl.SFTTrainer(
        model=transformers.LlamaForCausalLM(config),
        args=args,
        train_dataset=datasets.Dataset.from_list(records),
        processing_class=tok,
    )
    out = []
    for row in trainer.train_dataset:
        ids, labels = list(row["input_ids"]), list(row["labels"])
        lengths = row.get("seq_lengths", [len(ids)])
        pos = [p for n in lengths for p in range(n)]
        labels = [-100 if p == 0 else x for p, x in zip(pos, labels, strict=True)]
        out.append({"input_ids": ids, "labels": labels, "position_ids": pos})
    return out


def _ours(tok_dir, data, *flags):
    result = CliRunner().invoke(
        main, ["data", "--hf-config", tok_dir, "--data", data, "--json", *flags]
    )
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.output.splitlines()]


CASES = {
    # name: (records, our flags, TRL settings)
    "chat bfd assistant": (
        chats(2100),
        ["--packing", "bfd", "--loss-on", "assistant"],
        dict(packing=True, assistant_only_loss=True),
    ),
    "chat bfd all": (chats(1200), ["--packing", "bfd"], dict(packing=True)),
    "prompt/completion bfd": (prompt_completions(1500), ["--packing", "bfd"], dict(packing=True)),
    "conversational p/c bfd": (
        prompt_completions(300, conversational=True),
        ["--packing", "bfd", "--loss-on", "assistant"],
        dict(packing=True, assistant_only_loss=True),
    ),
    # rows of 36: some examples keep no assistant token after the cut, and both drop them
    "chat none assistant, cut short": (
        chats(300),
        ["--packing", "none", "--loss-on", "assistant"],
        dict(packing=False, assistant_only_loss=True),
    ),
    "chat none assistant": (
        chats(300),
        ["--packing", "none", "--loss-on", "assistant"],
        dict(packing=False, assistant_only_loss=True),
    ),
    "p/c none": (prompt_completions(300), ["--packing", "none"], dict(packing=False)),
    "text bfd": (texts(400), ["--packing", "bfd"], dict(packing=True)),
    "text wrapped": (texts(1100), ["--packing", "wrapped"], dict(packing=True, strategy="wrapped")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rows_equal_trl(tmp_path, case):
    records, flags, trl_settings = CASES[case]
    seq = 36 if "cut short" in case else 48 if "none" in case else 256
    tok_dir = tokenizer_dir(tmp_path / "tok")
    data = write_jsonl(tmp_path / "data.jsonl", records)
    ours = _ours(tok_dir, data, "--seq", str(seq), *flags)
    theirs = _trl_rows(tok_dir, records, max_length=seq, **trl_settings)
    if "wrapped" in case:
        # TRL's wrapped rows carry no seq_lengths: its positions count across examples and
        # examples attend to each other. Ours restart at each example (the contract), so the
        # label of each example's first token is -100 in ours: the same ids, and TRL's labels
        # once masked where our positions restart.
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            b["labels"] = [-100 if p == 0 else x for p, x in zip(a["position_ids"], b["labels"])]
            b["position_ids"] = a["position_ids"]
    if "cut short" in case:
        assert len(ours) < len(records), "the case must drop examples"
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a == b, f"row {i}"
