"""A tiny chat data set: a trained BPE tokenizer directory with a ChatML template
(``{% generation %}`` markers around the assistant's answer and its end-of-turn token), and
small chat, prompt/completion and text data sets written as JSON lines. Shared by the SFT tests
and the ``sft`` benchmark (tools import nothing from tests/)."""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
"""ChatML with generation markers: what ``--loss-on assistant`` (TRL's ``assistant_only_loss``)
needs."""

CHATML_PLAIN = CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")
"""The same template without generation markers."""

WORDS = (
    "the planner writes a plan chunks move between host and device the executor replays it "
    "what is a chunk a group of parameters fetched together why offload memory is short"
).split()


def tokenizer_dir(directory: Path, *, template: str | None = CHATML) -> str:
    """A Hugging Face tokenizer directory transformers loads (tokenizer.json, tokenizer_config.json,
    chat_template.jinja when ``template`` is given)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if template is not None:
        (directory / "chat_template.jinja").write_text(template)
    return str(directory)


def _sentence(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n))


def chats(n: int, *, system_every: int = 3) -> list[dict]:
    """``n`` conversations of varied lengths (ties in length included, as BFD must order them)."""
    out = []
    for i in range(n):
        turns = []
        if i % system_every == 0:
            turns.append({"role": "system", "content": _sentence(i, 3)})
        for t in range(1 + i % 3):
            turns.append({"role": "user", "content": _sentence(i + t, 2 + (i * 5 + t) % 9)})
            turns.append({"role": "assistant", "content": _sentence(i + t + 1, 1 + (i + t) % 11)})
        out.append({"messages": turns})
    return out


def prompt_completions(n: int, *, conversational: bool = False) -> list[dict]:
    out = []
    for i in range(n):
        prompt, completion = _sentence(i, 2 + i % 7), " " + _sentence(i + 2, 1 + i % 13)
        if conversational:
            out.append(
                {
                    "prompt": [{"role": "user", "content": prompt}],
                    "completion": [{"role": "assistant", "content": completion.strip()}],
                }
            )
        else:
            out.append({"prompt": prompt, "completion": completion})
    return out


def texts(n: int, field: str = "text") -> list[dict]:
    return [{field: _sentence(i, 1 + (i * 3) % 17)} for i in range(n)]


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)
