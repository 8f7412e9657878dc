"""protrain under TRL's SFTTrainer (planner/commands/hf_trainer.py): the script in
tests/fixtures/trainer/sft_plain.py and its protrain twin sft_protrain.py (4 marked lines) train
to the same per-step losses (1e-5 relative: the twin's loss is cross_entropy over the planned
logits, TRL's is its chunked log-softmax kernel, both fp32) under the planner's plan and an
offloaded plan with swap and checkpoint blocks, with LoRA, and resume from a Trainer checkpoint
bit for bit; so does plain Trainer on raw text (lm_plain.py / lm_protrain.py); Trainer options
a plan cannot honour are refused by name."""

from __future__ import annotations

import difflib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.chatdata import chats, texts, tokenizer_dir, write_jsonl

pytest.importorskip("trl")
pytest.importorskip("peft")

FIXTURES = Path(__file__).parent / "fixtures" / "trainer"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft")
    return {
        "tokenizer": tokenizer_dir(d / "tok"),
        "data": write_jsonl(d / "chat.jsonl", chats(200)),
        "held": write_jsonl(d / "held.jsonl", chats(240)[200:]),  # a held-out split
        "text": write_jsonl(d / "text.jsonl", texts(800)),  # 125 blocks: 20 steps in one epoch
    }


def _run(script: str, cfg: dict) -> list[float]:
    """The script's per-step losses (its last line)."""
    return _run_lines(script, cfg)[-1]


def _run_lines(script: str, cfg: dict) -> list:
    """Every JSON line the script printed."""
    out = subprocess.run(
        [sys.executable, str(FIXTURES / script), json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith(("[", '{"'))]
    return [json.loads(line) for line in lines]  # (Trainer prints its logs as Python dicts)


def _train(data: dict) -> dict:
    """The script's configuration for training alone (no after-training checks)."""
    return {k: v for k, v in data.items() if k != "held"}


def _offloaded_plan(
    cfg: dict, path: Path, lora: bool = False, cpu_adam: str | None = "after_backward"
) -> str:
    """A plan for the script's model with chunk 0 persistent, the rest offloaded through 2
    buffers, block 0 swapped and block 1 checkpointed, CPU steps after backward (clipping)."""
    import torch
    import transformers

    from protrain.planner.commands.hf_trainer import _meta_copy
    from protrain.planner.models.hf import from_model
    from protrain.planner.search.emit import emit
    from protrain.plans import plan as P
    from protrain.plans.plan import dump

    tok = transformers.AutoTokenizer.from_pretrained(cfg["tokenizer"])
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    if lora:
        import peft

        lc = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        model = peft.get_peft_model(_meta_copy(model), lc)
    adapted = from_model(model)
    training = P.Training(
        micro_batch=2,
        seq_len=64,
        compute_dtype="float32",
        master_dtype="float32",
        world_size=1,
        grad_accum=2,
    )
    plan = emit(
        adapted,
        name="llama-tiny",
        blocks=adapted.protrain_blocks(),
        training=training,
        chunk_numel=16384,
        persistent=[0],
        n_buffer=2,
        policies=["swap", "checkpoint"],
        cpu_adam=cpu_adam,
    )
    path.write_bytes(dump(plan))
    return str(path)


@pytest.mark.parametrize("script", ["sft", "lm"])
def test_scripts_differ_by_few_lines(script):
    plain = (FIXTURES / f"{script}_plain.py").read_text().splitlines()
    ours = (FIXTURES / f"{script}_protrain.py").read_text().splitlines()
    diff = [d for d in difflib.ndiff(plain, ours) if d[:2] in ("+ ", "- ") and d[2:].strip()]
    added = [d for d in diff if d.startswith("+")]
    assert len(added) <= 5 and len(diff) - len(added) <= 1, diff
    assert all(d.endswith("# protrain") for d in added), added


@pytest.mark.slow  # (each case ~35 s of two subprocesses: LoRA under the offloaded plan only)
@pytest.mark.parametrize(
    "plan,lora", [("planner", False), ("offloaded", False), ("offloaded", True)]
)
def test_sft_same_losses(data, tmp_path, plan, lora):
    cfg = {**_train(data), "out": str(tmp_path / "out"), "steps": 20, "lora": lora}
    ref = _run("sft_plain.py", cfg)
    if plan == "offloaded":
        cfg["plan"] = _offloaded_plan(cfg, tmp_path / "plan.json", lora)
    ours = _run("sft_protrain.py", cfg)
    assert len(ours) == len(ref) == 20
    for a, b in zip(ours, ref):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, ref)


@pytest.mark.slow  # (~26 s; the offloaded plan, the SFT cases cover the planner's)
@pytest.mark.parametrize("plan", ["offloaded"])
def test_trainer_raw_text_same_losses(data, tmp_path, plan):
    """Plain Trainer on raw text (fixed-length blocks, DataCollatorForLanguageModeling): the
    twin counts a step's supervised tokens as Trainer does for a causal LM (PlannedModel's
    loss_type), so each step's loss is divided by the same number."""
    cfg = {"tokenizer": data["tokenizer"], "data": data["text"], "out": str(tmp_path / "out")}
    cfg["steps"] = 20
    ref = _run("lm_plain.py", cfg)
    if plan == "offloaded":
        cfg["plan"] = _offloaded_plan(cfg, tmp_path / "plan.json")
    ours = _run("lm_protrain.py", cfg)
    assert len(ours) == len(ref) == 20
    for a, b in zip(ours, ref):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, ref)


@pytest.mark.slow
def test_resume_from_checkpoint_bit_for_bit(data, tmp_path):
    base = {**_train(data), "steps": 6}
    plan = _offloaded_plan(base, tmp_path / "plan.json")
    whole = _run("sft_protrain.py", {**base, "out": str(tmp_path / "a"), "plan": plan})
    cfg = {**base, "out": str(tmp_path / "b"), "plan": plan, "save_steps": 3}
    _run("sft_protrain.py", cfg)
    resumed = _run("sft_protrain.py", {**cfg, "resume": str(tmp_path / "b" / "checkpoint-3")})
    assert resumed[-3:] == whole[-3:]


def test_refusals_name_the_option(data, tmp_path):
    import trl

    from protrain.planner.commands.hf_trainer import refusals
    from protrain.plans.reader import load

    plan = load(Path(_offloaded_plan({**data}, tmp_path / "plan.json")))
    ok = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[])
    ok |= dict(per_device_train_batch_size=2, max_length=64, gradient_accumulation_steps=2)
    assert refusals(trl.SFTConfig(**ok), plan) == []
    for bad, named in [
        (dict(bf16=True), "bf16=True"),
        (dict(torch_compile=True), "torch_compile=True"),
        (dict(optim="adafactor"), "optim='adafactor'"),
        (dict(weight_decay=0.1), "weight_decay=0.1"),
        (dict(max_length=128), "max_length=128, but the plan was made for sequences of 64"),
        (dict(per_device_train_batch_size=4), "per_device_train_batch_size=4"),
        (dict(gradient_accumulation_steps=1), "gradient_accumulation_steps=1"),
        (dict(activation_offloading=True), "activation_offloading=True"),
    ]:
        found = refusals(trl.SFTConfig(**{**ok, **bad}), plan)
        assert len(found) == 1 and named in found[0][0], (bad, found)
    overlapped = load(Path(_offloaded_plan({**data}, tmp_path / "p2.json", cpu_adam=None)))
    found = refusals(trl.SFTConfig(**ok, max_grad_norm=1.0), overlapped)
    assert len(found) == 1 and "$.schedule.cpu_adam" in found[0][0]


@pytest.mark.slow
def test_after_training(data, tmp_path):
    """After 6 steps under the offloaded plan: trainer.evaluate() on a held-out split (eval
    batches of 8 packed rows, run in plan-shaped pieces), greedy generate of 20 tokens and
    trainer.save_model reloaded by from_pretrained give what the run without protrain gives."""
    cfg = {**data, "out": str(tmp_path / "ref"), "steps": 6}
    ref, ref_losses = _run_lines("sft_plain.py", cfg)
    cfg["plan"] = _offloaded_plan(cfg, tmp_path / "plan.json")
    ours, losses = _run_lines("sft_protrain.py", {**cfg, "out": str(tmp_path / "ours")})
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, ref_losses)
    assert abs(ours["eval_loss"] - ref["eval_loss"]) <= 1e-5 * ref["eval_loss"], (ours, ref)
    assert ours["tokens"] == ref["tokens"] and len(ours["tokens"]) > 20
    assert ours["reload_error"] <= 1e-5 and ref["reload_error"] == 0.0, (ours, ref)
    assert abs(ours["checksum"] - ref["checksum"]) <= 1e-5 * abs(ref["checksum"]), (ours, ref)


@pytest.mark.slow
def test_short_last_step(data, tmp_path):
    """The raw-text epoch holds 63 micro-batches (125 blocks of 2 rows, the last of 1): step 32
    is Trainer's short last step of one micro-batch, which the twin completes with an empty
    one ([Note: short last step]); step 33 starts the second epoch."""
    cfg = {"tokenizer": data["tokenizer"], "data": data["text"], "out": str(tmp_path / "out")}
    cfg["steps"] = 33
    ref = _run("lm_plain.py", cfg)
    cfg["plan"] = _offloaded_plan(cfg, tmp_path / "plan.json")
    ours = _run("lm_protrain.py", cfg)
    assert len(ours) == len(ref) == 33
    for a, b in zip(ours, ref):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, ref)
