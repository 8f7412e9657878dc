"""Fine-tuning records to token ids and a loss mask, as TRL 1.16's ``SFTTrainer`` prepares them.

One record becomes one example: its token ids and a mask, 1 where the token is a label
(trains) and 0 where its label is -100. What the mask keeps is ``LOSS_ON``, one table read
by the CLI help, the validation and ``Encoder``; each mode is the pair of TRL settings it
stands for (``assistant_only_loss``, ``completion_only_loss``), so "the same rows as TRL" is
a statement about one row of the table.

How each format is tokenised (TRL's ``_prepare_dataset``, reimplemented and tested equal in
tests/test_sft_trl.py):
- text: the text, with the tokenizer's end-of-text token appended unless it ends with it,
  through ``tokenizer(text)`` (so with the tokenizer's own special tokens, a BOS for Llama);
- messages: ``apply_chat_template(messages, tools=...)``;
- prompt/completion strings: ``tokenizer(prompt)`` and ``tokenizer(prompt + completion + eos)``;
  the completion starts where the two ids first differ (usually after the prompt's ids);
- conversational prompt/completion: the prompt rendered with the generation prompt, and the
  prompt + completion rendered whole; the same common prefix.

[Note: generation markers]
``--loss-on assistant`` is TRL's ``assistant_only_loss``: the template marks the assistant's
tokens with ``{% generation %} … {% endgeneration %}`` and transformers'
``apply_chat_template(return_assistant_tokens_mask=True)`` returns them as a mask. A template
without the markers is refused, as TRL refuses one (``get_training_chat_template`` raises
"not training-compatible") -- except that TRL first swaps in its own patched copy for about
thirty known families (Qwen, Llama 3, Gemma, ...); we do not swap silently: the refusal
names the template and says to pass such a copy (TRL ships them as
``trl/chat_templates/*_training.jinja``) with ``--chat-template``. An example with no
assistant token under this mode is refused too, as TRL raises on one.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where it is used: ``protrain --help`` reads LOSS_ON
    import numpy as np

from protrain.plans.errors import ConfigError

from .sft_records import FORMATS, Format, Record


@dataclass(frozen=True)
class LossOn:
    name: str
    assistant_only: bool  # TRL's assistant_only_loss
    completion_only: bool | None  # TRL's completion_only_loss (None: TRL's default, per format)
    formats: tuple[str, ...]  # the formats it applies to; others are refused
    help: str


LOSS_ON = {
    m.name: m
    for m in (
        LossOn(
            "auto",
            False,
            None,
            tuple(FORMATS),
            "TRL's default: the completion for prompt/completion data, every token otherwise",
        ),
        LossOn(
            "assistant",
            True,
            None,
            ("messages", "conversational prompt-completion"),
            "the assistant turns, as the template's {% generation %} markers mark them "
            "(a template without them is refused); of the completion, for prompt/completion",
        ),
        LossOn(
            "completion",
            False,
            True,
            ("prompt-completion", "conversational prompt-completion"),
            "the completion of prompt/completion records",
        ),
        LossOn("all", False, False, tuple(FORMATS), "every token"),
    )
}
"""``--loss-on``: which tokens are labels, as the TRL settings each mode stands for."""

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")  # the opening marker, with trim variants

TOKENIZER_FILES = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|chat_template.*|vocab\..*|"
    r"merges\.txt|.*\.model|spiece.*)$"
)
"""The files of a model directory that make its tokenizer (what the cache fingerprint hashes;
not the weights next to them)."""


def loss_on_for(mode: str, fmt: Format, where: str) -> LossOn:
    """The ``LOSS_ON`` entry ``mode`` for records of ``fmt``; refuses a mode that does not apply."""
    if mode not in LOSS_ON:
        raise ConfigError(
            f"--loss-on {mode!r} is not a mode; modes are {', '.join(LOSS_ON)}",
            hint="pick one of them (see protrain data --help)",
        )
    entry = LOSS_ON[mode]
    if fmt.name not in entry.formats:
        raise ConfigError(
            f"{where}: --loss-on {mode} does not apply to {fmt.name} records ({entry.help}; "
            f"it applies to: {', '.join(entry.formats)})",
            hint="use --loss-on auto or all for this data",
        )
    return entry


class Encoder:
    """A tokenizer directory and a chat template, turning records into (ids, mask) examples."""

    def __init__(self, tokenizer_dir: str, chat_template: str | None = None, text_field="text"):
        from .data import _transformers_tokenizer

        self.tokenizer_dir, self.text_field = tokenizer_dir, text_field
        # The transformers tokenizer: chat templates and the tokenizer's own special tokens
        # are what TRL tokenises with, so the ids match only through the same code path.
        self.tok = _transformers_tokenizer(tokenizer_dir)
        self.template_source, self.template = _template(tokenizer_dir, self.tok, chat_template)
        self.eos = self.tok.eos_token  # TRL appends it to plain text and completions
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.pad_id: int = 0 if pad is None else int(pad)  # TRL pads with pad_token, else eos
        self.vocab_size: int = len(self.tok)

    def check(self, fmt: Format, loss: LossOn, where: str) -> None:
        """Refuse, before any record is tokenised, what cannot be encoded at all."""
        if fmt.conversational and self.template is None:
            raise ConfigError(
                f"{where}: {fmt.name} records need a chat template, and the tokenizer in "
                f"{self.tokenizer_dir} has none (no chat_template.jinja, no chat_template in "
                "tokenizer_config.json)",
                hint="pass one with --chat-template FILE.jinja",
            )
        if loss.assistant_only and not _GENERATION.search(self.template or ""):
            raise ConfigError(
                f"--loss-on assistant needs a chat template with {{% generation %}} markers "
                f"around the assistant's tokens, and {self.template_source} has none "
                "(TRL refuses such a template too, unless it ships a patched copy)",
                hint="pass a template with the markers with --chat-template FILE.jinja (TRL's "
                "trl/chat_templates/*_training.jinja for common families), or use --loss-on all",
            )

    def encode(self, record: Record, loss: LossOn) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask) of one record: ids (L,) int64, mask (L,) uint8, 1 = a label."""
        import numpy as np

        fields, fmt = record.fields, record.format
        kwargs = {"chat_template": self.template, "tools": _tools(fields, record.where)}
        masks = []  # TRL's mask columns; a token is a label where all of them are 1
        if fmt.name == "text":
            ids = self._text(self._with_eos(fields[self.text_field]))
        elif fmt.name == "messages":
            ids, assistant = self._chat(fields["messages"], loss, record.where, **kwargs)
            masks.append(assistant)
        else:
            if fmt.conversational:
                prompt_ids, _ = self._chat(
                    fields["prompt"], None, record.where, add_generation_prompt=True, **kwargs
                )
                ids, assistant = self._chat(
                    fields["prompt"] + fields["completion"], loss, record.where, **kwargs
                )
                masks.append(assistant)
            else:
                prompt_ids = self._text(fields["prompt"])
                ids = self._text(fields["prompt"] + self._with_eos(fields["completion"]))
            # The completion starts where the prompt's ids and the whole's first differ.
            n = min(len(prompt_ids), len(ids))
            differ = np.flatnonzero(prompt_ids[:n] != ids[:n])
            start = int(differ[0]) if differ.size else n
            completion_only = loss.completion_only
            if completion_only is None:  # TRL's default: completion-only for this format
                completion_only = True
            if completion_only:
                completion = np.zeros(len(ids), dtype=np.uint8)
                completion[start:] = 1
                masks.append(completion)
        mask = np.ones(len(ids), dtype=np.uint8)
        for m in masks:
            if m is not None:
                mask &= m
        return ids, mask

    def _text(self, text: str) -> np.ndarray:
        import numpy as np

        return np.asarray(self.tok(text=text)["input_ids"], dtype=np.int64)

    def _with_eos(self, text: str) -> str:
        return text if self.eos is None or text.endswith(self.eos) else text + self.eos

    def _chat(self, messages, loss: LossOn | None, where: str, **kwargs):
        import numpy as np

        assistant_only = loss is not None and loss.assistant_only
        try:
            out = self.tok.apply_chat_template(
                messages,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=assistant_only,
                **kwargs,
            )
        except Exception as e:  # jinja raises TemplateError (and the template its own errors)
            raise ConfigError(
                f"{where}: the chat template ({self.template_source}) fails on this record: {e}",
                hint="fix the record, or pass a template that renders it with --chat-template",
            ) from None
        ids = np.asarray(out["input_ids"], dtype=np.int64)
        if not assistant_only:
            return ids, None
        assistant = np.asarray(out["assistant_masks"], dtype=np.uint8)
        if not assistant.any():
            raise ConfigError(
                f"{where}: --loss-on assistant and this record has no assistant token inside "
                f"the {{% generation %}} markers of {self.template_source}",
                hint="give the record an assistant turn, or use --loss-on all",
            )
        return ids, assistant


def _tools(fields: dict, where: str):
    """The record's ``tools`` (a list, or a JSON string of one, as TRL accepts), or None."""
    tools = fields.get("tools")
    if isinstance(tools, str):
        import json

        try:
            tools = json.loads(tools)
        except ValueError as e:
            raise ConfigError(
                f"{where}, field 'tools': a string that is not JSON ({e})",
                hint="write the tool schemas as a JSON list",
            ) from None
    if tools is not None and not isinstance(tools, list):
        raise ConfigError(
            f"{where}, field 'tools': not a list of tool schemas",
            hint="write the tool schemas as a JSON list",
        )
    return tools


def _template(directory: str, tok, chat_template: str | None) -> tuple[str, str | None]:
    """(where the template came from, its text): ``--chat-template`` else the tokenizer's."""
    if chat_template is not None:
        path = Path(chat_template)
        try:
            return str(path), path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(
                f"--chat-template {chat_template}: cannot read it ({e})",
                hint="pass a readable Jinja file (UTF-8)",
            ) from None
    template = tok.chat_template
    if isinstance(template, dict):  # named variants: the default one, as TRL reads it
        template = template.get("default")
    return f"the chat template of {directory}", template


def tokenizer_digest(directory: str) -> str:
    """A hash of the tokenizer's files (``TOKENIZER_FILES``) by name and content."""
    h = hashlib.blake2b(digest_size=16)
    for f in sorted(Path(directory).iterdir()):
        if f.is_file() and TOKENIZER_FILES.match(f.name):
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()
