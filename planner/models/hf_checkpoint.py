"""A Hugging Face model directory on disk: its config.json, safetensors weights in, an export out.

A directory that holds ``config.json`` and ``model.safetensors`` (or a sharded
``model.safetensors.index.json``) is a checkpoint: ``hf.build`` loads its weights
(``load_weights``) when the model is built on a real device, whether ``hf:PATH``
names the directory or the ``config.json`` in it. Only safetensors are read: a
directory holding torch pickles (``*.bin``, ``*.pt``) and no safetensors is refused
(``refuse_pickles``), because unpickling can run code. ``export`` writes a trained
model back as a directory transformers loads.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch
from torch import nn

from protrain.executor.checkpoint import (
    check_header,
    fsync_path,
    read_manifest,
    refuse_to_load_nonfinite,
    resolve,
)
from protrain.plans.errors import CheckpointError, ConfigError

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def config_file(path: str | Path) -> Path:
    """The ``config.json`` that ``path`` names (the file itself, or the one in the directory)."""
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        where = f"{p} holds no config.json" if p.is_dir() else f"{p}: no such file"
        raise ConfigError(
            f"Hugging Face model: {where}",
            "point hf:PATH at a config.json, or at the directory that holds it",
        )
    return f


def has_checkpoint(d: Path) -> bool:
    """Whether directory ``d`` holds a safetensors checkpoint (one file, or a sharded index)."""
    return (d / WEIGHTS_FILE).is_file() or (d / WEIGHTS_INDEX).is_file()


def refuse_pickles(d: Path) -> None:
    """Refuse directory ``d`` when it holds torch pickles in place of safetensors."""
    pickles = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt"))
    if pickles:
        raise ConfigError(
            f"{d} holds {', '.join(pickles[:3])} but no {WEIGHTS_FILE}: protrain loads safetensors "
            "only (torch pickles can run code when loaded)",
            "convert the checkpoint to safetensors (model.save_pretrained(DIR) in transformers "
            "writes it), or copy config.json alone to a new directory to train from a random init",
        )


def weight_files(weights: str | Path | list[str | Path]) -> list[Path]:
    """The safetensors files ``weights`` names: files, a directory, or an index json."""
    if isinstance(weights, list | tuple):
        return [f for w in weights for f in weight_files(w)]
    w = Path(weights)
    if w.is_dir():
        if (w / WEIGHTS_INDEX).is_file():
            w = w / WEIGHTS_INDEX
        elif (w / WEIGHTS_FILE).is_file():
            return [w / WEIGHTS_FILE]
        else:
            raise ConfigError(
                f"{w} holds neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX}",
                "point at the directory of a safetensors checkpoint",
            )
    if not w.is_file():
        raise ConfigError(
            f"weights file {w}: no such file", "give a .safetensors file or its directory"
        )
    if w.name.endswith(".json"):
        try:
            shards = sorted(set(json.loads(w.read_text(encoding="utf-8"))["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(
                f"{w}: not a safetensors index (a JSON object with a weight_map)",
                "write the checkpoint again with save_pretrained",
            ) from e
        return [_shard(w, s) for s in shards]
    if w.suffix != ".safetensors":
        raise ConfigError(
            f"{w}: protrain loads .safetensors files only (torch pickles can run code)",
            "convert the checkpoint with model.save_pretrained(DIR) in transformers",
        )
    return [w]


def _shard(index: Path, name: object) -> Path:
    """A shard the index names: a relative path under the index's directory, nowhere else
    (checked by name: the Hugging Face cache's shards are symbolic links into its blobs)."""
    import os

    rel = os.path.normpath(name) if isinstance(name, str) and name else ""
    if not rel or os.path.isabs(rel) or rel == ".." or rel.startswith(".." + os.sep) or "\0" in rel:
        raise ConfigError(
            f"{index}: weight_map names shard {name!r}, which is not a file in {index.parent}",
            "point at a checkpoint whose index lists its own shards (save_pretrained writes one)",
        )
    return index.parent / rel


@torch.no_grad()
def load_weights(model: nn.Module, files: list[str | Path]) -> None:
    """Copy tensors from safetensors ``files`` into ``model``'s parameters (cast to their dtype).

    Names may carry the base-model prefix or not (GPT-2's original checkpoints say
    ``h.0.attn.c_attn.weight``); keys transformers itself ignores (old causal-mask
    buffers) are skipped. Every parameter must be given (a tied one under either
    name); anything else is an error listing what is missing or unexpected.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = {n for n, _ in model.named_buffers()}
    prefix = getattr(model.hf, "base_model_prefix", "")
    # Old LLaMA-family checkpoints store a RoPE inv_freq per layer; transformers skips those too.
    patterns = [
        *(getattr(model.hf, "_keys_to_ignore_on_load_unexpected", None) or []),
        r"rotary_emb\.inv_freq$",
    ]
    ignore = [re.compile(pat) for pat in patterns]
    loaded: set[int] = set()
    unexpected, mismatched = [], []
    for f in files:
        try:
            tensors = load_file(str(f), device="cpu")
        except (SafetensorError, OSError) as e:
            raise ConfigError(
                f"{f}: cannot read as safetensors ({e})", "check the file is complete"
            ) from e
        for key, t in tensors.items():
            name = key if key in params or not prefix else f"{prefix}.{key}"
            if name not in params:
                if key not in buffers and not any(pat.search(key) for pat in ignore):
                    unexpected.append(key)
                continue
            p = params[name]
            if tuple(t.shape) != tuple(p.shape):
                mismatched.append(f"{key}: file {list(t.shape)}, model {list(p.shape)}")
                continue
            p.copy_(t)
            loaded.add(id(p))
    missing = [n for n, p in model.named_parameters() if id(p) not in loaded]

    def listed(what: str, names: list[str]) -> list[str]:
        return (
            [f"{what}: {', '.join(names[:5])}" + (" …" if len(names) > 5 else "")] if names else []
        )

    problems = listed("missing", missing) + listed("unexpected", unexpected) + mismatched[:5]
    if problems:
        where = str(files[0]) + (f" and {len(files) - 1} more files" if len(files) > 1 else "")
        raise ConfigError(
            f"weights in {where} do not fit {type(model.hf).__name__}:\n  " + "\n  ".join(problems),
            "use the checkpoint saved with this config.json (same directory)",
        )


# [Note: the tokenizer travels whole]
# An export carries every file of the tokenizer the model trained with, so that
# ``AutoTokenizer.from_pretrained(export)`` gives the same tokenizer, chat template included
# (a fixed list of names dropped ``chat_template.jinja``, and ``apply_chat_template`` then
# failed on the export: issue 40). We copy the files, byte for byte, by the names transformers
# gives them, rather than load the tokenizer and ``save_pretrained`` it again, because a re-save
# is not the tokenizer we trained with: transformers 5.25 rewrites ``tokenizer_config.json``
# with its own keys (``backend``, ``tokenizer_class``, ``model_max_length``, and ``is_local``,
# which describes this machine's directory), and a file it did not load is not written at all;
# a copy also spares every export a tokenizer load. The names: those ``save_pretrained`` writes
# (``tokenization_utils_base``: the config, the fast tokenizer, the legacy special-token and
# added-token maps, the default chat template and the named ones beside it) and the vocabulary
# files the tokenizer classes declare in their ``vocab_files_names`` (counted in transformers
# 5.25: BPE vocab and merges, WordPiece vocab, sentencepiece models) or convert on load
# (Mistral's ``tekken.json`` and versioned ``tokenizer.model.v3``, ``tiktoken.model``).
TOKENIZER_PATTERNS = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",  # (the template file processors wrote before chat_template.jinja)
    "additional_chat_templates/*.jinja",  # (named templates: a dict chat_template's others)
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "bpe.codes",
    "*.model",  # (tokenizer.model, spiece.model, sentencepiece.bpe.model, tiktoken.model, …)
    "tokenizer.model.*",  # (Mistral's versioned sentencepiece models)
    "*.spm",
    "tekken.json",
    "generation_config.json",  # (not the tokenizer's, but generation's eos and pad ids beside it)
)
"""Glob patterns, relative to the tokenizer directory, of the files an export copies:
see [Note: the tokenizer travels whole]."""

CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""The default chat template's file: transformers reads it before any ``chat_template`` key of
``tokenizer_config.json``, so a template written here is the one ``apply_chat_template`` uses."""


def tokenizer_files(tokenizer_dir: str | Path | None) -> list[str]:
    """The tokenizer's files in ``tokenizer_dir`` (``TOKENIZER_PATTERNS``, those present), as
    sorted paths relative to it; none without a directory (byte-level tokens)."""
    if tokenizer_dir is None:
        return []
    root = Path(tokenizer_dir)
    return sorted(
        {
            f.relative_to(root).as_posix()
            for pat in TOKENIZER_PATTERNS
            for f in root.glob(pat)
            if f.is_file()  # (a link into the Hugging Face cache's blobs is followed)
        }
    )


def export(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    out_dir: str | Path,
    *,
    config_path: str | Path | None = None,
    tokenizer_dir: str | Path | None = None,
    chat_template: str | Path | None = None,
) -> Path:
    """Write ``model`` with weights ``state`` as a Hugging Face directory; returns it.

    ``state``: parameter name → tensor in the model's own names (``Engine.state_dict()
    ["model"]``: the fp32 masters). Written: ``config.json`` (a copy of ``config_path``,
    the file the model was built from, so dropout and cache settings are the user's and
    not training's; without it, the live config less our attention implementation),
    ``model.safetensors`` (tied aliases stored once, as
    ``save_pretrained`` does) and the tokenizer's files from ``tokenizer_dir``, with
    ``chat_template`` (a template file) as its ``chat_template.jinja`` (``copy_tokenizer``). The
    directory appears whole or not at all: it is written under a temporary name, every
    file and the directory fsynced, then renamed. Any failure to write (a full disk,
    which safetensors reports as its own ``SafetensorError``) removes the temporary
    directory and is a ``ConfigError``.
    """
    out = Path(out_dir)
    with atomic_directory(out, "the export") as tmp:
        _write_export(model, state, tmp, config_path, tokenizer_dir, chat_template)
    return out


def write_errno(error: BaseException | None) -> int | None:
    """The errno of a failed write: an ``OSError``'s own, or the ``code: N`` safetensors puts in
    its ``SafetensorError`` text (it reports a full disk as ``Os { code: 28, … }``)."""
    if isinstance(error, OSError):
        return error.errno
    found = re.search(r"\bcode: (\d+)", str(error)) if error is not None else None
    return int(found.group(1)) if found else None


def write_hint(error: BaseException | None, where: str | Path, fix: str) -> str:
    """The HINT of a failed write into ``where``: a file-size limit (EFBIG, ``ulimit -f``; Python
    ignores SIGXFSZ, so the write fails instead of killing the process) is not a full disk
    (ENOSPC), and neither is a permission; ``fix``: the command to run once it is mended."""
    import errno

    code = write_errno(error)
    if code == errno.EFBIG:
        return (
            "a file-size limit (ulimit -f) stopped the write: raise it (`ulimit -f unlimited`), "
            f"then {fix}"
        )
    if code in (errno.ENOSPC, errno.EDQUOT):
        return f"free space on the disk of {where}, then {fix}"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"make {where} writable, then {fix}"
    return f"check that {where} is writable and its disk has space, then {fix}"


@contextlib.contextmanager
def atomic_directory(out: Path, what: str, fix: str = "export again"):
    """Yield a temporary directory beside ``out`` (``.tmp-NAME``, same parent, so the same disk)
    for the caller to fill; then fsync its files and itself and rename it to ``out``: the
    directory appears whole or not at all (every export: full, merged, adapter). Any failure to
    write, whichever file it was copying from (a full disk, a file-size limit; safetensors reports
    those as its own ``SafetensorError``), removes the temporary directory and is a
    ``ConfigError`` naming ``out``, with a hint that tells a full disk from ``ulimit -f``."""
    import os
    import shutil

    from safetensors import SafetensorError

    out = Path(out)
    tmp = out.with_name(f".tmp-{out.name}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)  # (a killed export's: this export's own name)
        tmp.mkdir(parents=True)
        yield tmp
        for f in [*sorted(tmp.rglob("*"), reverse=True), tmp]:  # (files before their directory)
            fsync_path(f)
        if out.is_dir():
            out.rmdir()  # checked empty before training (preflight.output_dir)
        os.replace(tmp, out)
        fsync_path(out.parent)
    except (OSError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(
            f"cannot write {what} {out}: {getattr(e, 'strerror', None) or e}; nothing was "
            "left there",
            write_hint(e, out.parent, fix),
        ) from None
    except BaseException:  # (a bug or Ctrl-C: still nothing half-written left behind)
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_export(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    tmp: Path,
    config_path: str | Path | None,
    tokenizer_dir: str | Path | None,
    chat_template: str | Path | None = None,
) -> None:
    """``export``'s files into ``tmp``, each fsynced, then ``tmp`` itself."""
    import shutil

    from safetensors.torch import save_file

    if config_path is not None:
        shutil.copyfile(config_file(config_path), tmp / "config.json")
    else:
        config = model.config.to_dict()
        for key in ("_attn_implementation", "_attn_implementation_internal", "attn_implementation"):
            config.pop(key, None)
        config["use_cache"] = True  # what generation wants; training set it off
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tied = {id(p): n for n, p in model.named_parameters()}  # first name of each tensor
    params = dict(model.named_parameters(remove_duplicate=False))
    tensors = {
        n: state[n].detach().to("cpu").contiguous() for n, p in params.items() if tied[id(p)] == n
    }
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    copy_tokenizer(tokenizer_dir, tmp, chat_template)


def copy_tokenizer(
    tokenizer_dir: str | Path | None, into: Path, chat_template: str | Path | None = None
) -> None:
    """Copy the tokenizer's files (``tokenizer_files``) into directory ``into``, and the chat
    template file ``chat_template`` (a ``--chat-template FILE.jinja``) as its
    ``chat_template.jinja``, in place of the tokenizer's own: the export then renders chats as
    training rendered them. See [Note: the tokenizer travels whole]."""
    import shutil

    for name in tokenizer_files(tokenizer_dir):
        (into / name).parent.mkdir(exist_ok=True)  # (additional_chat_templates/)
        shutil.copyfile(Path(tokenizer_dir) / name, into / name)
    if chat_template is not None:
        shutil.copyfile(chat_template, into / CHAT_TEMPLATE_FILE)


def load_model_state(
    root: str | Path, shapes: dict[str, list[int]], what: str = "--hf-config"
) -> dict[str, torch.Tensor]:
    """The model state (fp32, the model's own names, tied aliases included) of the checkpoint
    ``root`` names, checked as ``load`` checks it, for a model whose parameters (tied aliases
    excluded) have ``shapes``; no engine needed (``protrain export``)."""
    from safetensors.torch import load_file

    directory = resolve(root)
    m = read_manifest(directory)
    if m.params != shapes:
        wrong = sorted(set(m.params) ^ set(shapes)) or [
            k for k in shapes if m.params.get(k) != shapes[k]
        ]
        raise CheckpointError(
            f"{directory}: checkpoint of another model (e.g. {wrong[:3]})",
            f"export with the {what} the checkpoint was trained with",
        )
    check_header(
        directory / "model.safetensors", {k: (v, torch.float32) for k, v in m.params.items()}
    )
    model = load_file(directory / "model.safetensors")
    refuse_to_load_nonfinite(directory, model, {})
    for name, alias in m.tied:
        if name in model:  # (an adapter checkpoint holds no tied base weights)
            model[alias] = model[name]
    return model
