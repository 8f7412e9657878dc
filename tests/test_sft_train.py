"""``protrain train`` on chat data (issue 40): packed rows with assistant-only loss, epochs, a
held-out split, a cosine schedule, against transformers' own model run example by example.

The reference is what a user of transformers would write: ``LlamaForCausalLM`` from the same
directory, each packed example run alone (its own forward: nothing attends across examples),
the step's loss the sum of its token losses over the step's supervised targets (Trainer's
``num_items_in_batch``), ``torch.optim.AdamW(fused=True)`` and
``get_cosine_schedule_with_warmup``, on the rows ``protrain data --plan … --json`` prints in
training order. Within 1e-4 relative: protrain's attention over a packed row is masked SDPA over
the whole row while each example alone runs the causal kernel over its own length, and the token
losses are summed in another order (test_packed.py states the same tolerance for the engine).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from protrain.planner.commands.cli import main
from tools.chatdata import chats, prompt_completions, tokenizer_dir, write_jsonl

transformers = pytest.importorskip("transformers")

LR, WARMUP = 2e-3, 2


def _invoke(*args) -> str:
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == 0, r.output + repr(r.exception)
    return r.output


def _model_dir(root: Path) -> Path:
    """A tiny llama (seeded weights) with a chat tokenizer whose template marks generations."""
    d = root / "llama"
    d.mkdir()
    config = transformers.LlamaConfig(
        vocab_size=384,  # more than the tokenizer's 365 ids, as real checkpoints pad it
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(5)
    transformers.LlamaForCausalLM(config).save_pretrained(d)
    tokenizer_dir(d)
    return d


def _plan(model: Path, out: Path, budget: str, seq: int = 64) -> Path:
    _invoke(
        "plan", "--hf-config", model, "--hardware", "cpu", "--dtype", "float32",
        "--batch", 2, "--seq", seq, "--grad-accum", 2, "--budget", budget, "-o", out,
    )  # fmt: skip
    return out


def _metrics(path: Path) -> list[dict]:
    return [
        r for r in map(json.loads, path.read_text().splitlines()) if "step" in r and "loss" in r
    ]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    model = _model_dir(root)
    data = write_jsonl(root / "chats.jsonl", chats(42))
    return root, model, data


def _reference_losses(model: Path, rows: list[dict], steps: int) -> list[float]:
    ref = transformers.LlamaForCausalLM.from_pretrained(model).float()
    opt = torch.optim.AdamW(
        ref.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True
    )
    sched = transformers.get_cosine_schedule_with_warmup(opt, WARMUP, steps)
    losses = []
    for step in range(1, steps + 1):
        mine = [r for r in rows if r["step"] == step]
        opt.zero_grad(set_to_none=True)
        summed, total = torch.zeros(()), 0
        for r in mine:
            ids, labels, pos = (torch.tensor(r[k]) for k in ("input_ids", "labels", "position_ids"))
            total += int((labels[1:] != -100).sum())
            starts = [*(pos == 0).nonzero().flatten().tolist(), len(ids)]
            for s, e in zip(starts, starts[1:]):  # each example alone, shifted within it
                if (labels[s + 1 : e] != -100).any():
                    logits = ref(input_ids=ids[None, s:e]).logits[0, :-1]  # (n-1, V)
                    summed = summed + F.cross_entropy(logits, labels[s + 1 : e], reduction="sum")
        (summed / total).backward()
        opt.step()
        sched.step()
        losses.append(summed.item() / total)
    return losses


@pytest.mark.slow  # two plans, two CLI runs, a transformers reference (~30 s on 2 cores)
@pytest.mark.parametrize("budget", ["1GiB", "900KiB"])  # the planner's; all offloaded, swap+ckpt
def test_packed_chat_training_equals_transformers_example_by_example(chat_run, budget):
    root, model, data = chat_run
    plan = _plan(model, root / f"plan-{budget}.json", budget, seq=128)
    if budget == "900KiB":  # the case is what it says: every chunk offloaded, swap and checkpoint
        p = json.loads(plan.read_text())
        assert set(p["placement"]["homes"]) == {"host"}
        assert {a["policy"] for a in p["activations"]} == {"swap", "checkpoint"}
    steps = 8  # 26 rows, 4 a step: 7 steps an epoch, the 7th filled with 2 empty rows
    common = ["--hf-config", model, "--data", data, "--loss-on", "assistant", "--steps", steps]
    shown = _invoke("data", "--plan", plan, *common, "--json")
    rows = [json.loads(line) for line in shown.splitlines()]
    assert len(rows) == steps * 2 * 2  # steps × grad_accum × micro_batch (one rank)
    # rows of several examples (what could attend across them), and an epoch's filled last step
    assert sum(r["position_ids"].count(0) > 1 for r in rows) >= 4
    assert any(r["input_ids"] == [] for r in rows)
    metrics = root / f"m-{budget}.jsonl"
    _invoke(
        "train", "--plan", plan, *common, "--lr", LR, "--lr-schedule", "cosine",
        "--warmup-steps", WARMUP, "--metrics", metrics, "--log-every", 100,
    )  # fmt: skip
    got = [r["loss"] for r in _metrics(metrics)]
    want = _reference_losses(model, rows, steps)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=0)


@pytest.mark.slow  # three CLI runs (~20 s)
def test_resuming_a_packed_cosine_run_continues_it_bit_for_bit(chat_run):
    root, model, data = chat_run
    plan = _plan(model, root / "plan-resume.json", "900KiB", seq=128)
    run = [
        "train", "--plan", plan, "--hf-config", model, "--data", data, "--loss-on", "assistant",
        "--steps", 8, "--lr", LR, "--lr-schedule", "cosine", "--warmup-steps", WARMUP,
        "--log-every", 100,
    ]  # fmt: skip
    _invoke(*run, "--metrics", root / "whole.jsonl")
    _invoke(*run, "--save-dir", root / "ck", "--save-every", 4, "--metrics", root / "first.jsonl")
    _invoke(*run, "--resume", root / "ck" / "step-00000004", "--metrics", root / "second.jsonl")
    whole = _metrics(root / "whole.jsonl")
    second = _metrics(root / "second.jsonl")
    assert [r["step"] for r in second] == [5, 6, 7, 8]
    assert [(r["loss"], r["lr"]) for r in second] == [(r["loss"], r["lr"]) for r in whole[4:]]


def test_chat_data_trains_in_epochs_with_a_held_out_split(chat_run, tmp_path):
    root, model, data = chat_run
    plan = _plan(model, tmp_path / "plan.json", "1GiB")
    metrics = tmp_path / "m.jsonl"
    out = _invoke(
        "train", "--plan", plan, "--hf-config", model, "--data", data, "--epochs", 2,
        "--eval-split", 0.1, "--eval-every", 3, "--metrics", metrics, "--log-every", 100,
    )  # fmt: skip
    # 42 examples a row each, 5 held out; 37 rows in steps of 4 rows: 10 steps an epoch
    assert "rows     37 train (10 steps an epoch of 4 rows)" in out
    assert "2 epochs = 20 steps" in out
    assert "held out 5 rows" in out
    records = _metrics(metrics)
    assert [r["step"] for r in records] == list(range(1, 21))
    assert all("heldout_loss" in r for r in records if r["step"] % 3 == 0)
    assert all(r["supervised_tokens"] > 0 for r in records)


def test_chat_data_is_not_read_as_raw_text(chat_run, tmp_path):
    # The defect a user met: `--data chats.jsonl` refused with "no string field 'text'".
    root, model, data = chat_run
    plan = _plan(model, tmp_path / "plan.json", "1GiB")
    out = _invoke("train", "--plan", plan, "--hf-config", model, "--data", data, "--steps", 1)
    assert "examples in" in out and "(packing bfd, loss on auto)" in out


def test_rows_flags_refused_where_they_mean_nothing(chat_run, tmp_path):
    root, model, data = chat_run
    plan = _plan(model, tmp_path / "plan.json", "1GiB")
    base = ["train", "--plan", plan, "--hf-config", model, "--data", data]
    for extra, words in (
        (["--epochs", 1, "--steps", 2], "--epochs and --steps"),
        (["--eval-split", 0.1], "nothing evaluates them"),
        (["--eval-split", 0.1, "--eval-data", data, "--eval-every", 2], "both name the held-out"),
    ):
        r = CliRunner().invoke(main, [str(a) for a in base + extra])
        assert r.exit_code != 0 and words in r.output, r.output


def test_resume_on_other_rows_is_refused(chat_run, tmp_path):
    root, model, data = chat_run
    plan = _plan(model, tmp_path / "plan.json", "1GiB")
    other = write_jsonl(tmp_path / "pc.jsonl", prompt_completions(30))
    base = ["train", "--plan", plan, "--hf-config", model, "--steps", 2, "--log-every", 100]
    _invoke(*base, "--data", data, "--save-dir", tmp_path / "ck")
    r = CliRunner().invoke(
        main, [str(a) for a in base + ["--data", other, "--resume", tmp_path / "ck", "--steps", 3]]
    )
    assert r.exit_code != 0 and "trained on other rows" in r.output, r.output


@pytest.mark.slow
@pytest.mark.dist  # two ranks under torchrun (gloo) against one process (~25 s)
def test_two_ranks_train_disjoint_rows_as_one_process_trains_their_union(chat_run, tmp_path):
    import shutil
    import subprocess

    from test_dist import _port

    root, model, data = chat_run
    two, one = tmp_path / "two.json", tmp_path / "one.json"
    plan = ["plan", "--hf-config", model, "--hardware", "cpu", "--dtype", "float32"]
    shape = ["--seq", 128, "--grad-accum", 2, "--budget", "1GiB"]
    _invoke(*plan, "--world-size", 2, "--batch", 1, *shape, "-o", two)
    _invoke(*plan, "--world-size", 1, "--batch", 2, *shape, "-o", one)
    run = ["--hf-config", model, "--data", data, "--loss-on", "assistant", "--epochs", 2,
           "--lr", LR, "--log-every", 100]  # fmt: skip
    _invoke("train", "--plan", one, *run, "--metrics", tmp_path / "one.jsonl")
    out = subprocess.run(
        [shutil.which("torchrun"), "--nproc-per-node", "2", "--master-port", str(_port()),
         "--no-python", "protrain", "train", "--plan", str(two), *map(str, run),
         "--metrics", str(tmp_path / "two.jsonl"), "--timeout", "60"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = _metrics(tmp_path / "one.jsonl"), _metrics(tmp_path / "two.jsonl")
    assert len(a) == len(b) == 14  # 26 rows, 4 a step (1 × 2 ranks × 2 draws): 7 an epoch, 2 epochs
    assert [r["supervised_tokens"] for r in a] == [r["supervised_tokens"] for r in b]
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in b]),
        torch.tensor([r["loss"] for r in a]),
        rtol=1e-5,
        atol=0,
    )
