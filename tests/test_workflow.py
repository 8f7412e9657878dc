"""A user's job end to end: fine-tune a local Hugging Face model on their own data, load it back.

The test writes what a user has on disk — a tiny LLaMA and a tiny GPT-2 as
``config.json`` + ``model.safetensors`` + ``tokenizer.json`` (a BPE tokenizer trained
here on a few sentences with the ``tokenizers`` library) — and a JSON-lines corpus,
then runs the commands a user would: ``protrain plan --hf-config DIR`` and ``protrain
train --hf-config DIR --data FILE.jsonl --text-field body --eval-every 2 --export OUT``.
The exported directory must load in ``transformers.AutoModelForCausalLM`` with logits
equal to protrain's own model built from it, and its loss on the held-out windows must
be the last held-out loss ``train`` printed (the engine's, from the same weights).
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from protrain.planner.commands.cli import main

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

SENTENCES = [
    "the planner writes a plan and the executor replays it on every rank",
    "chunks of parameters move between the host and the device as the plan says",
    "activations are kept, swapped to the host, or recomputed in backward",
    "a small model learns these sentences quickly when it sees them again and again",
]
VOCAB = 320  # the models' vocabulary: more than the tokenizer's, as real checkpoints pad it

CONFIGS = {
    "llama": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "gpt2": dict(
        model_type="gpt2",
        architectures=["GPT2LMHeadModel"],
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    ),
}


def _tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SENTENCES, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return tok


def _checkpoint(directory, fields):
    """config.json and model.safetensors as transformers writes them, from a seeded init."""
    import transformers

    directory.mkdir()
    config = transformers.AutoConfig.for_model(**fields)
    torch.manual_seed(5)
    model = getattr(transformers, fields["architectures"][0])(config)
    model.save_pretrained(directory)
    return _tokenizer(directory)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_fine_tune_a_local_hf_model_and_load_it_back(tmp_path, arch, monkeypatch):
    import transformers

    from protrain.planner.models import hf
    from protrain.planner.models.data import heldout_batches, load_tokens, split_heldout

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model_dir = tmp_path / arch
    tok = _checkpoint(model_dir, CONFIGS[arch])
    data = tmp_path / "corpus.jsonl"
    data.write_text(
        "".join(json.dumps({"id": i, "body": SENTENCES[i % 4]}) + "\n" for i in range(200))
    )

    plan = tmp_path / "plan.json"
    r = CliRunner().invoke(
        main,
        [
            "plan",
            "--hf-config",
            str(model_dir),
            "--hardware",
            "cpu",
            "--batch",
            "2",
            "--seq",
            "16",
            "--budget",
            "1MiB",
            "-o",
            str(plan),
        ],
    )
    assert r.exit_code == 0, r.output
    out = tmp_path / "export"
    r = CliRunner().invoke(
        main,
        [
            "train",
            "--plan",
            str(plan),
            "--hf-config",
            str(model_dir),
            "--data",
            str(data),
            "--text-field",
            "body",
            "--steps",
            "4",
            "--eval-every",
            "2",
            "--lr",
            "1e-2",
            "--export",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output
    # It said what it loaded: the checkpoint's weights, and the model's own tokenizer.
    assert f"weights from {model_dir / 'model.safetensors'}" in r.output
    assert f"tokenizer {model_dir}" in r.output
    evals = [float(x.split()[-1]) for x in r.output.splitlines() if "held-out loss" in x]
    assert len(evals) == 3  # at the start, then at steps 2 and 4

    # The corpus was tokenised by the model's tokenizer: documents packed, each ended by
    # <|endoftext|>.
    source = load_tokens(str(data), tokenizer=str(model_dir), text_field="body")
    eos = tok.token_to_id("<|endoftext|>")
    first = tok.encode(SENTENCES[0], add_special_tokens=False).ids
    assert source.tokens[: len(first) + 1].tolist() == [*first, eos]

    # transformers loads the export (its own attention, not protrain's) ...
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    # ... with protrain's logits on the same tokens,
    ours = hf.build(out, seed=123).eval()  # seed unused: the export's weights are loaded
    idx = source.tokens[:32].view(2, 16)
    with torch.no_grad():
        theirs, mine = loaded(input_ids=idx).logits, ours(idx)
    torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)
    # ... and the engine's last held-out loss, from the weights it trained.
    _, tail = split_heldout(source, 16)
    batches = heldout_batches(tail, 2, 16)
    with torch.no_grad():
        loss = sum(
            torch.nn.functional.cross_entropy(loaded(input_ids=x).logits.flatten(0, 1), y.flatten())
            for x, y in batches
        ) / len(batches)
    # Tolerance: the engine's forward and a plain one differ by ~4e-5 on these models even
    # before any step (measured; fp32 reduction order), and by ~2e-4 after four steps.
    assert abs(float(loss) - evals[-1]) < 5e-4, (float(loss), evals[-1])
    # Training changed the weights (the export is not the input checkpoint).
    before = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    assert not torch.equal(before.lm_head.weight, loaded.lm_head.weight)


def test_zoo_models_stay_byte_level_and_refuse_export(tmp_path):
    ex = "plans/gpt2-tiny/example.json"
    r = CliRunner().invoke(
        main,
        [
            "train",
            "--plan",
            ex,
            "--model",
            "gpt2-tiny",
            "--steps",
            "1",
            "--export",
            str(tmp_path / "out"),
        ],
    )
    assert r.exit_code == 1 and "zoo model" in r.output and "--hf-config" in r.output
    r = CliRunner().invoke(main, ["train", "--plan", ex, "--model", "gpt2-tiny", "--steps", "1"])
    assert r.exit_code == 0 and "byte-level" in r.output and "random init (seed 0)" in r.output
