"""Exports carry the tokenizer whole, and an adapter names its base as the user did (issue 40.8).

A user fine-tunes a chat model: its directory holds a tokenizer whose chat templates live in
``chat_template.jinja`` and ``additional_chat_templates/`` (as transformers'
``save_pretrained`` writes them). Every export — ``train --export``, ``--export-merged``, the
LoRA adapter, ``protrain export`` — must give back a tokenizer that renders chats exactly as
the source does, and the adapter's ``adapter_config.json`` must name the base as it was typed
(``--hf-config llama``), so the adapter and its base still load after they are moved.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from protrain.planner.commands.cli import main

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_USE = "{% for t in tools %}tool: {{ t['name'] }}\n{% endfor %}" + CHATML
TOOLS = [{"name": "fetch", "description": "fetch a chunk", "parameters": {"type": "object"}}]
MESSAGES = [
    {"role": "system", "content": "you plan memory"},
    {"role": "user", "content": "where do the chunks live"},
    {"role": "assistant", "content": "where the plan says"},
]


def _chat_tokenizer(directory: Path) -> tuple[str, ...]:
    """Save, into ``directory``, a tiny trained BPE tokenizer with a ChatML default template and
    a named ``tool_use`` one, through transformers; returns the files it wrote (relative)."""
    import transformers
    from test_workflow import _tokenizer

    source = directory.parent / f".{directory.name}-bare"
    source.mkdir()
    _tokenizer(source)
    tok = transformers.AutoTokenizer.from_pretrained(source)
    tok.chat_template = {"default": CHATML, "tool_use": TOOL_USE}
    shutil.rmtree(source)
    written = tok.save_pretrained(directory)
    return tuple(sorted(Path(f).relative_to(directory).as_posix() for f in written))


def _rendered(directory) -> tuple[str, str]:
    """The chat as ``directory``'s tokenizer renders it with its default and its named template."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(directory)
    return (
        tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
        tok.apply_chat_template(MESSAGES, tokenize=False, chat_template="tool_use", tools=TOOLS),
    )


def test_every_file_the_tokenizer_saves_is_copied_and_nothing_else(tmp_path):
    from protrain.planner.models.hf_checkpoint import copy_tokenizer

    src = tmp_path / "model"
    saved = _chat_tokenizer(src)
    expected = _rendered(src)
    assert "chat_template.jinja" in saved and "additional_chat_templates/tool_use.jinja" in saved
    # What other tokenizers save (legacy maps, slow vocabularies, sentencepiece), and a model's
    # own files, which are not the tokenizer's.
    for name in ("special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt"):
        (src / name).write_text("{}")
    (src / "spiece.model").write_bytes(b"\x0a\x01")
    for name in ("config.json", "model.safetensors", "notes.txt"):
        (src / name).write_text("not the tokenizer's")
    out = tmp_path / "out"
    out.mkdir()
    copy_tokenizer(src, out)
    copied = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    tokenizer_own = {"special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt"}
    assert copied == sorted({*saved, *tokenizer_own, "spiece.model"})
    for name in copied:  # byte for byte: the tokenizer trained with, not a re-save of it
        assert (out / name).read_bytes() == (src / name).read_bytes(), name

    # A template given as a file (--chat-template FILE.jinja) becomes the export's default.
    given = tmp_path / "mine.jinja"
    given.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    out2 = tmp_path / "out2"
    out2.mkdir()
    for name in tokenizer_own | {"spiece.model"}:  # (placeholders transformers cannot read)
        (src / name).unlink()
    copy_tokenizer(src, out2, chat_template=given)
    assert (out2 / "chat_template.jinja").read_text() == given.read_text()
    default, named = _rendered(out2)
    assert default.startswith("[system] you plan memory\n")
    assert named == expected[1]  # the named template is still the tokenizer's own


def test_the_adapter_names_its_base_as_typed(tmp_path, monkeypatch):
    from protrain.planner.models.lora import base_name

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "llama").mkdir(parents=True)
    (tmp_path / "models" / "llama" / "config.json").write_text("{}")
    assert base_name("models/llama") == "models/llama"
    assert base_name("./models/llama") == "./models/llama"  # as typed, not normalised
    assert base_name("models/llama/config.json") == "models/llama"  # its directory
    assert base_name("hf:models/llama/config.json#model.layers") == "models/llama"
    assert base_name("org/some-model") == "org/some-model"  # hub-style, not a path here
    absolute = str(tmp_path / "models" / "llama")
    assert base_name(absolute) == absolute  # typed absolute: kept


def _invoke(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r


def _plan(out, *extra):
    _invoke(
        "plan",
        "--hf-config",
        "llama",
        *extra,
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
        out,
    )


@pytest.mark.slow  # plans and trains a transformers model twice, with peft (~15 s)
def test_exports_chat_and_a_moved_adapter_loads(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    import peft
    import transformers
    from test_workflow import CONFIGS, SENTENCES, _checkpoint

    from protrain.planner.models.data import load_tokens

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # the user types relative paths: --hf-config llama
    _checkpoint(tmp_path / "llama", CONFIGS["llama"])
    _chat_tokenizer(tmp_path / "llama")  # (over the bare tokenizer _checkpoint wrote)
    source = _rendered("llama")
    (tmp_path / "corpus.jsonl").write_text(
        "".join(json.dumps({"text": SENTENCES[i % 4]}) + "\n" for i in range(200))
    )
    data = ["--hf-config", "llama", "--data", "corpus.jsonl", "--steps", 2, "--lr", "1e-2"]
    lora = ["--lora", "--lora-r", 4, "--lora-alpha", 8]

    _plan("full.json")
    _invoke("train", "--plan", "full.json", *data, "--export", "E")
    _plan("lora.json", *lora)
    _invoke(
        "train",
        "--plan",
        "lora.json",
        *data,
        *lora,
        "--save-dir",
        "ckpt",
        "--export",
        "A",
        "--export-merged",
        "M",
    )
    _invoke("export", "--resume", "ckpt", "--hf-config", "llama", *lora, "-o", "A2")

    # (a) Every export's tokenizer renders the chat as the source's does, both templates.
    for export in ("E", "M", "A", "A2"):
        assert _rendered(export) == source, export
    # (c) The adapter names its base as it was typed.
    for adapter in ("A", "A2"):
        config = json.loads((tmp_path / adapter / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == "llama", adapter

    # (b) The adapter moved elsewhere loads onto the base, with the logits it gave in place;
    # and moved together with its base, peft finds the base by the name the adapter holds.
    idx = load_tokens("corpus.jsonl", tokenizer="llama").tokens[:32].view(2, 16)
    base = transformers.AutoModelForCausalLM.from_pretrained("llama").eval()
    with torch.no_grad():
        before = peft.PeftModel.from_pretrained(base, "A").eval()(input_ids=idx).logits
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(tmp_path / "A", elsewhere / "A")
    base = transformers.AutoModelForCausalLM.from_pretrained("llama").eval()
    moved = peft.PeftModel.from_pretrained(base, elsewhere / "A").eval()
    with torch.no_grad():
        torch.testing.assert_close(moved(input_ids=idx).logits, before, rtol=0, atol=0)
    shutil.move(tmp_path / "llama", elsewhere / "llama")
    os.chdir(elsewhere)  # (monkeypatch.chdir above restores the directory after the test)
    auto = peft.AutoPeftModelForCausalLM.from_pretrained("A").eval()
    with torch.no_grad():
        torch.testing.assert_close(auto(input_ids=idx).logits, before, rtol=0, atol=0)
