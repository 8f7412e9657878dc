"""LoRA from the command line (issue 30): ``plan --lora``, ``train --lora``, the exports.

The round trip a user makes: a tiny LLaMA directory with its tokenizer (as in
tests/test_workflow.py) -> ``protrain plan --hf-config DIR --lora`` -> ``protrain train
--lora --export A --export-merged M`` -> peft loads A onto the base and transformers
loads M, with the logits protrain's trained model gives.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from protrain.planner.commands.cli import main

pytest.importorskip("peft")


def _invoke(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r


def test_zoo_plan_and_train_with_lora(tmp_path):
    plan = tmp_path / "p.json"
    r = _invoke(
        "plan",
        "--model",
        "llama-tiny",
        "--lora",
        "--lora-r",
        4,
        "--hardware",
        "cpu",
        "--batch",
        2,
        "--seq",
        32,
        "--budget",
        "2MiB",
        "-o",
        plan,
    )
    assert r.exit_code == 0, r.output
    assert (
        "lora     LoRA r=4" in r.output
        and "tokens/s" in r.output
        and "full     training" in r.output
    )
    r = _invoke(
        "train", "--plan", plan, "--model", "llama-tiny", "--lora", "--lora-r", 4, "--steps", 2
    )
    assert r.exit_code == 0, r.output
    r = _invoke("train", "--plan", plan, "--model", "llama-tiny", "--steps", 1)
    assert r.exit_code == 1 and "made for a LoRA model" in r.output and "--lora" in r.output
    r = _invoke(
        "train",
        "--plan",
        "plans/gpt2-tiny/example.json",
        "--model",
        "gpt2-tiny",
        "--lora",
        "--steps",
        1,
    )
    assert r.exit_code == 1 and "not LoRA" in r.output
    r = _invoke(
        "plan",
        "--model",
        "llama-tiny",
        "--lora-r",
        4,
        "--hardware",
        "cpu",
        "--batch",
        2,
        "--seq",
        32,
        "-o",
        tmp_path / "q.json",
    )
    assert r.exit_code == 1 and "go with --lora" in r.output


@pytest.mark.slow
def test_round_trip_peft_adapter_and_merged_export(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    import peft
    import transformers
    from test_workflow import CONFIGS, SENTENCES, _checkpoint

    from protrain.planner.models import hf
    from protrain.planner.models.data import load_tokens
    from protrain.planner.models.lora import ADAPTER, LoraSpec, inject

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model_dir = tmp_path / "llama"
    _checkpoint(model_dir, CONFIGS["llama"])
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"body": SENTENCES[i % 4]}) + "\n" for i in range(200)))
    plan, a, m = tmp_path / "plan.json", tmp_path / "A", tmp_path / "M"
    lora = ["--lora", "--lora-r", 4, "--lora-alpha", 8]
    r = _invoke(
        "plan",
        "--hf-config",
        model_dir,
        *lora,
        "--hardware",
        "cpu",
        "--dtype",
        "float32",
        "--batch",
        2,
        "--seq",
        16,
        "--budget",
        "1MiB",
        "-o",
        plan,
    )
    assert r.exit_code == 0, r.output
    r = _invoke(
        "train",
        "--plan",
        plan,
        "--hf-config",
        model_dir,
        *lora,
        "--data",
        data,
        "--text-field",
        "body",
        "--steps",
        4,
        "--lr",
        "1e-2",
        "--export",
        a,
        "--export-merged",
        m,
    )
    assert r.exit_code == 0, r.output
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
        p.name for p in a.iterdir()
    }
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in m.iterdir()}

    idx = (
        load_tokens(str(data), tokenizer=str(model_dir), text_field="body").tokens[:32].view(2, 16)
    )
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        plain = base(input_ids=idx).logits
    peft_model = peft.PeftModel.from_pretrained(base, a).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(m).eval()
    # protrain's model: the base, peft's adapters injected, the exported adapter's values
    ours = inject(hf.build(model_dir, seed=0), LoraSpec(r=4, alpha=8)).eval()
    from safetensors.torch import load_file

    adapter = load_file(str(a / "adapter_model.safetensors"))
    state = {
        k.removeprefix("base_model.model.").replace(".weight", f".{ADAPTER}.weight"): v
        for k, v in adapter.items()
    }
    missing = ours.load_state_dict(state, strict=False)
    assert not missing.unexpected_keys
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # it trained
    with torch.no_grad():
        via_peft, via_merged, mine = (
            peft_model(input_ids=idx).logits,
            merged(input_ids=idx).logits,
            ours(idx),
        )
    torch.testing.assert_close(via_peft, mine, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(via_merged, via_peft, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain, via_peft)  # the adapter changes the model
