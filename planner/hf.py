"""Hugging Face causal LMs as protrain models (optional extra ``hf``: ``pip install transformers``).

A model is built from a LOCAL ``config.json`` (never from the hub: we read the JSON
ourselves and call no ``from_pretrained``), or adapted from a model the caller
already holds, and comes back as an ``HFCausalLM``: a module whose forward takes
``(idx, targets)`` and returns the loss, as the zoo's models do, so the planner and
the executor treat it like any zoo model. Supported architectures are the five in
``ARCHITECTURES``; the module names are Hugging Face's own, so a plan for
``hf:./llama`` names ``model.layers.3.self_attn.q_proj.weight`` as the checkpoint does.

Model names ``hf:PATH`` and ``hf:PATH#BLOCKS`` (PATH: a ``config.json`` or the
directory holding it; BLOCKS: the module path of the block list, e.g.
``model.layers``) are resolved by ``planner/models.py``, so every command that takes
a zoo name takes these too. A directory that also holds ``model.safetensors`` (or a
sharded ``model.safetensors.index.json``) is a checkpoint: its weights are loaded
when the model is built on a real device, whether PATH names the directory or the
``config.json`` in it (the built model's ``weights_loaded_from`` lists the files; empty:
initialised from the seed). ``hf_model_name`` and ``model_name_option`` make these
names from ``--hf-config PATH [--blocks PATH]``, with PATH made absolute so a plan
made here names its model from any directory. ``export`` writes a trained model
back as a directory transformers loads.
transformers is imported on first use (``_transformers``), so parsing a name does
not need it.

What we set, and why:

- **Attention**: ``ATTENTION``, our own entry in transformers' attention registry:
  causal ``F.scaled_dot_product_attention`` with GQA by repeating k/v heads, the call
  the zoo's models make. Because it has no entry in the *mask* registry, transformers
  builds no mask at all (``masking_utils`` returns None for such implementations):
  no T x T mask tensor per forward, and no data-dependent checks on the token ids
  (packed-sequence detection reads values, which fails on ``meta`` and syncs the
  device on CUDA). With the zoo's weights, a LLaMA built here gives the zoo's loss
  and gradients bit for bit, and so does GPT-2 with the zoo's GELU kernel
  (``gelu_pytorch_tanh``; GPT-2's own ``gelu_new`` differs in the last bits).
  Padding masks, sliding windows shorter than the sequence and logit soft-capping
  are refused, not approximated; GPT-2's ``reorder_and_upcast_attn`` (an eager-only
  fp32 upcast) does not apply.
- **No KV cache** (``use_cache=False``), no LayerDrop (a skipped layer would skip the
  plan's events), and dropout 0 unless asked (as ``models.build``).
- **Build on meta, then materialise**: the config is instantiated on ``meta``
  (llama-7b in ~0.05 s, nothing allocated); on a real device the storage is created
  with ``to_empty`` and initialised by transformers' own ``init_weights`` (per-model
  rules such as GPT-2's scaled residual projections, and the RoPE ``inv_freq``
  buffers) under a forked global RNG seeded with ``seed``, so the caller's RNG state
  is untouched and equal seeds give equal weights.

[Note: one module tree]
``HFCausalLM`` must not register the transformers model as a child: that would
prefix every name (``hf.model.layers.0...``) and plans, checkpoints and block paths
would stop matching Hugging Face's names. Instead the wrapper shares the model's
``_modules`` dict, so its children *are* the model's children and every parameter,
buffer and block has the same path from both roots; the model itself is kept as a
plain attribute (``.hf``) to call its forward. ``to``, ``to_empty``,
``functional_call``, hooks and ``copy.deepcopy`` (whose memo keeps the shared dict
shared) all act on the one tree. The root transformers module must hold no
parameters or buffers of its own (none of the supported ones does); ``from_model``
checks it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from protrain.executor.errors import ConfigError, did_you_mean

from .models import HF_PREFIX, ModelInfo, count_params, find_block_list, is_hf_name, lm_loss

ATTENTION = "protrain_sdpa"
"""Our attention implementation's name in transformers' registry (see the module docstring)."""

ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "opt": "OPTForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
"""model_type → the causal-LM class we build for it."""

# Config fields that are dropout probabilities in the supported architectures.
_DROPOUT_FIELDS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "dropout",
                   "activation_dropout")
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


# ---------------------------------------------------------------------------- attention


def causal_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0,
                     scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Causal SDPA with the zoo's kernel choices, in transformers' attention-function signature.

    query (B, nh, T, hs), key/value (B, nkv, T, hs) → output (B, T, nh, hs), no weights.
    """
    T = query.size(-2)
    if attention_mask is not None:
        raise ConfigError(
            f"{type(module).__name__}: protrain's attention is causal only, but the model passed "
            f"an attention mask of shape {tuple(attention_mask.shape)}",
            "train on packed token streams without padding (what protrain's data loader gives)",
        )
    window = kwargs.get("sliding_window")
    if window is not None and T > window:
        raise ConfigError(
            f"{type(module).__name__}: sequence length {T} exceeds the sliding window ({window}); "
            "protrain plans full causal attention, which equals sliding-window attention only "
            "up to the window",
            f"use --seq {window} or less",
        )
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ConfigError(f"{type(module).__name__}: attention with {name} is not supported",
                              "use one of the supported architectures: " + ", ".join(ARCHITECTURES.values()))
    groups = query.size(1) // key.size(1)
    if groups > 1:
        # Repeat k/v per query group (HF's repeat_kv, the zoo's choice) rather than
        # enable_gqa: every SDPA backend takes it, so the kernel does not change with dtype.
        key = key.repeat_interleave(groups, dim=1)  # (B, nh, T, hs)
        value = value.repeat_interleave(groups, dim=1)  # (B, nh, T, hs)
    hs = query.size(-1)
    # The kernel's own default scale when it is the usual 1/sqrt(hs), so the
    # arithmetic is the zoo's exactly; otherwise (GPT-2's per-layer scaling) the given one.
    default = scaling is None or scaling in (hs**-0.5, 1.0 / math.sqrt(hs))
    y = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True,
                                       scale=None if default else scaling)  # (B, nh, T, hs)
    return y.transpose(1, 2).contiguous(), None


def _transformers():
    """transformers (the optional extra), with our attention registered in it.

    Imported on first use, not with this module, so that model names can be parsed
    (and the CLI can start) without it; registering is a dict update, safe to repeat.
    """
    try:
        import transformers
    except ImportError as e:
        raise ConfigError(f"Hugging Face models need the transformers package ({e})",
                          "pip install 'protrain[hf]'  (or: pip install transformers safetensors)") from e
    transformers.AttentionInterface.register(ATTENTION, causal_attention)
    return transformers


# ---------------------------------------------------------------------------- names


def hf_model_name(config_path: str, blocks: str | None = None) -> str:
    """``hf:PATH`` or ``hf:PATH#BLOCKS``: the model name of a local Hugging Face config.

    PATH is a config.json or the directory holding it (with its safetensors
    checkpoint, if any); BLOCKS the module path of the block list (``model.layers``)
    when automatic discovery should be overridden.
    """
    if "#" in str(config_path):
        raise ConfigError(f"{config_path}: a Hugging Face config path cannot contain '#'",
                          "rename or move the directory")
    return f"{HF_PREFIX}{config_path}" + (f"#{blocks}" if blocks else "")


def parse_hf_name(name: str) -> tuple[str, str | None]:
    """``hf:PATH[#BLOCKS]`` → (PATH, BLOCKS or None)."""
    if not is_hf_name(name):
        raise ConfigError(f"{name!r} is not a Hugging Face model name", "write it as hf:PATH[#BLOCKS]")
    path, _, blocks = name[len(HF_PREFIX):].partition("#")
    if not path:
        raise ConfigError(f"{name!r} names no config file",
                          "write hf:PATH, PATH a config.json or the directory holding it")
    return path, (blocks or None)


def model_name_option(model: str | None, hf_config: str | None, blocks: str | None) -> str | None:
    """The model name from the CLI's ``--model NAME`` or ``--hf-config PATH [--blocks PATH]``.

    At most one of the two may be given; ``--blocks`` only with ``--hf-config``.
    Returns None when neither is given (the command decides whether that is an error).
    """
    if model is not None and hf_config is not None:
        raise ConfigError("--model and --hf-config both name the model",
                          "give one: --model NAME (a zoo name or hf:PATH), or --hf-config PATH")
    if blocks is not None and hf_config is None:
        raise ConfigError("--blocks names the block list of a Hugging Face model and needs --hf-config",
                          "add --hf-config PATH, or drop --blocks (zoo models name their own blocks)")
    if hf_config is not None:
        return hf_model_name(str(Path(hf_config).resolve()), blocks)
    if model is not None and is_hf_name(model):
        path, blocks = parse_hf_name(model)
        return hf_model_name(str(Path(path).resolve()), blocks)
    return model


# ---------------------------------------------------------------------------- config


def config_file(path: str | Path) -> Path:
    """The ``config.json`` that ``path`` names (the file itself, or the one in the directory)."""
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        where = f"{p} holds no config.json" if p.is_dir() else f"{p}: no such file"
        raise ConfigError(f"Hugging Face model: {where}",
                          "point hf:PATH at a config.json, or at the directory that holds it")
    return f


def load_config(path: str | Path):
    """Read a local config.json into its transformers config class; returns (config, class name)."""
    f = config_file(path)
    try:
        raw = json.loads(f.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})",
                          f"fix {f}, or write it again with `config.save_pretrained(DIR)`") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{f}: not a UTF-8 text file ({e.reason})", "point hf:PATH at a config.json") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{f}: expected a JSON object, found {type(raw).__name__}",
                          "a Hugging Face config.json is one object with model_type and the sizes")
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    supported = ", ".join(ARCHITECTURES.values())
    if model_type not in ARCHITECTURES:
        known = f"model_type {model_type!r}{did_you_mean(str(model_type), ARCHITECTURES)}" if model_type \
            else "no model_type"
        raise ConfigError(f"{f}: {known}; protrain builds these architectures: {supported}",
                          "set model_type to one of gpt2, llama, mistral, opt, qwen2, or build the model "
                          "yourself and pass it to protrain.planner.hf.from_model")
    if arch is not None and arch != ARCHITECTURES[model_type]:
        raise ConfigError(
            f"{f}: architecture {arch!r}{did_you_mean(arch, ARCHITECTURES.values())} is not supported "
            f"(model_type {model_type!r} builds {ARCHITECTURES[model_type]}); supported: {supported}",
            f"set \"architectures\": [\"{ARCHITECTURES[model_type]}\"], or build the model yourself "
            "and pass it to protrain.planner.hf.from_model",
        )
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    transformers = _transformers()
    try:
        config = transformers.AutoConfig.for_model(model_type, **fields)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{f}: transformers rejects this {model_type} config: {e}",
                          f"fix {f}") from e
    return config, ARCHITECTURES[model_type]


def _training_config(config, dropout: float) -> None:
    """Set what training with a plan needs, in place (see the module docstring)."""
    for name in _DROPOUT_FIELDS:
        if isinstance(getattr(config, name, None), float | int):
            setattr(config, name, float(dropout))
    if getattr(config, "layerdrop", 0.0):
        config.layerdrop = 0.0
    config.use_cache = False


# ---------------------------------------------------------------------------- the wrapper


class HFCausalLM(nn.Module):
    """A transformers causal LM with the zoo's interface: ``forward(idx, targets) -> loss``.

    Parameter, buffer and block paths are the transformers model's own; see
    [Note: one module tree]. ``.hf`` is the transformers model (for ``generate``,
    ``save_pretrained``, ...); ``.config`` its config.
    """

    def __init__(self, model: nn.Module, blocks: list[str]):
        super().__init__()
        # See [Note: one module tree]: share the children, do not register the root.
        object.__setattr__(self, "hf", model)
        self._modules = model._modules
        self.config = model.config
        self.blocks = list(blocks)  # module paths of the transformer blocks, in order
        self.max_seq_len = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.train(model.training)

    def protrain_blocks(self) -> list[str]:
        return list(self.blocks)

    def train(self, mode: bool = True) -> HFCausalLM:
        super().train(mode)
        self.hf.training = mode  # the root is not a child; its flag is read by some models
        return self

    def tie_weights(self) -> None:
        """Re-tie the input and output embeddings (after ``to_empty``), as transformers does."""
        self.hf.tie_weights()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Initialise every parameter and buffer by transformers' own rules.

        transformers draws from the global RNG, so with a ``generator`` we run its init
        under a forked RNG seeded with ``generator.initial_seed()`` (``models.materialize``
        makes a fresh generator from its seed); the caller's RNG state is left as it was.
        """
        for obj in [*self.hf.modules(), *self.hf.parameters()]:
            obj.__dict__.pop("_is_hf_initialized", None)  # transformers skips what it marked done
        if generator is None:
            self.hf.init_weights()  # initialises, then ties
            return
        devices = []
        if generator.device.type == "cuda":
            index = generator.device.index
            devices = [torch.cuda.current_device() if index is None else index]
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(generator.initial_seed())
            self.hf.init_weights()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        T = idx.size(1)
        if self.max_seq_len and T > self.max_seq_len:
            raise ConfigError(f"sequence length {T} exceeds the model's max_position_embeddings="
                              f"{self.max_seq_len}", f"use --seq {self.max_seq_len} or less")
        out = self.hf(input_ids=idx, use_cache=False)
        logits = out.logits if hasattr(out, "logits") else out[0]  # (B, T, V)
        # Targets are the next tokens already (the data loader shifts them), so the
        # zoo's loss, not transformers' (which shifts labels itself).
        return logits if targets is None else lm_loss(logits, targets)


def _skip_padding_check(input_ids, attention_mask) -> None:
    """Stands in for ``warn_if_padding_and_no_attention_mask``: our batches have no padding,
    and the check reads token values (an error on meta, a device sync on CUDA)."""


def find_blocks(model: nn.Module, blocks: str | None = None) -> list[str]:
    """Block paths: the children of ``blocks`` (``"model.layers"`` or ``"model.layers.*"``), or
    of the longest ``nn.ModuleList`` of modules of one class when ``blocks`` is None."""
    if blocks is None:
        path = find_block_list(model)
        if path is None:
            raise ConfigError(f"cannot find the transformer blocks of {type(model).__name__}: it has no "
                              "nn.ModuleList of modules of one class",
                              "name the block list: hf:PATH#model.layers, or from_model(model, blocks=...)")
    else:
        path = blocks.removesuffix(".*")
    modules = dict(model.named_modules())
    lists = [n for n, m in modules.items() if isinstance(m, nn.ModuleList | nn.Sequential)]
    hint = f"name a module whose children are the blocks; module lists here: {', '.join(lists)}"
    if path not in modules:
        raise ConfigError(f"block list {path!r} is not a module of {type(model).__name__}"
                          f"{did_you_mean(path, lists)}", hint)
    children = [n for n, _ in modules[path].named_children()]
    if not children:
        raise ConfigError(f"{path!r} has no child modules, so it is not a list of blocks", hint)
    prefix = f"{path}." if path else ""
    return [prefix + n for n in children]


def from_model(model: nn.Module, *, blocks: str | None = None) -> HFCausalLM:
    """Adapt a transformers causal LM the caller built (or loaded) to protrain.

    Sets our attention and ``use_cache=False`` on it (in place); dropout stays as
    the caller set it. LayerDrop is refused: it skips blocks at random, and with them
    the plan's events.
    """
    PreTrainedModel = _transformers().PreTrainedModel
    if not isinstance(model, PreTrainedModel):
        raise ConfigError(f"from_model needs a transformers PreTrainedModel, got {type(model).__name__}",
                          "for a plain nn.Module, give it forward(idx, targets) and protrain_blocks()")
    own = [n for n, _ in [*model.named_parameters(recurse=False), *model.named_buffers(recurse=False)]]
    if own:
        raise ConfigError(f"{type(model).__name__} holds tensors at its root ({', '.join(own)}); "
                          "protrain's adapter shares the model's children and would miss them",
                          "move them into a submodule")
    layerdrop = max([getattr(model.config, "layerdrop", 0.0) or 0.0]
                    + [getattr(m, "layerdrop", 0.0) or 0.0 for m in model.modules()])
    if layerdrop:
        raise ConfigError(f"{type(model).__name__} has layerdrop={layerdrop}: LayerDrop skips "
                          "blocks at random, and a plan's schedule needs every block to run",
                          "set model.config.layerdrop = 0.0 and the decoder's .layerdrop = 0.0 first")
    model.config.use_cache = False
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTENTION)
    else:  # transformers 4.x
        model.config._attn_implementation = ATTENTION
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            m.warn_if_padding_and_no_attention_mask = _skip_padding_check
    return HFCausalLM(model, find_blocks(model, blocks))


# ---------------------------------------------------------------------------- building


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    # Parameters only: buffers such as RoPE's inv_freq stay fp32 (in bf16 the
    # rotary angles of long positions would lose most of their digits).
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None and p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def build(source: str | Path, *, blocks: str | None = None, device: str | torch.device = "cpu",
          dtype: torch.dtype = torch.float32, dropout: float | None = None, seed: int = 0,
          weights: str | Path | list[str | Path] | None = None) -> HFCausalLM:
    """Build the causal LM a local config.json describes (``source``: the file or its directory).

    On ``device="meta"`` nothing is allocated. Otherwise the model is materialised
    on ``device``, initialised from ``seed`` (see the module docstring), then given
    ``weights`` when there are any: a safetensors file, a list of them, a directory or
    an index json; by default the checkpoint next to config.json when ``source`` is a
    directory holding one. ``dropout`` (default 0) is set on every dropout of the config.
    """
    from .models import materialize

    config, arch = load_config(source)
    _training_config(config, 0.0 if dropout is None else dropout)
    config._attn_implementation = ATTENTION
    with torch.device("meta"):
        model = getattr(_transformers(), arch)(config)
    wrapped = from_model(model, blocks=blocks)
    if torch.device(device).type == "meta":
        _cast_parameters(wrapped, dtype)
        return wrapped
    materialize(wrapped, device=device, seed=seed)
    # The checkpoint beside config.json, whichever of the two the caller named.
    directory = config_file(source).parent
    files = weight_files(weights) if weights is not None else (
        weight_files(directory) if _has_checkpoint(directory) else [])
    if not files and weights is None:
        _refuse_pickles(directory)
    if files:
        load_weights(wrapped, files)
    wrapped.weights_loaded_from = list(files)  # what train reports; empty: the seed's init
    _cast_parameters(wrapped, dtype)  # in place: tied parameters stay one object
    return wrapped


def describe(name: str) -> ModelInfo:
    """Size and shape of ``hf:PATH`` (built on meta; allocates nothing)."""
    path, blocks = parse_hf_name(name)
    model = build(path, blocks=blocks, device="meta")
    c = model.config
    return ModelInfo(name=name, family=c.model_type, n_params=count_params(model),
                     n_blocks=len(model.blocks), hidden=c.hidden_size, n_head=c.num_attention_heads,
                     n_kv_head=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                     vocab_size=c.vocab_size, max_seq_len=model.max_seq_len)


# ---------------------------------------------------------------------------- weights


def _has_checkpoint(d: Path) -> bool:
    return (d / WEIGHTS_FILE).is_file() or (d / WEIGHTS_INDEX).is_file()


def _refuse_pickles(d: Path) -> None:
    pickles = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt"))
    if pickles:
        raise ConfigError(
            f"{d} holds {', '.join(pickles[:3])} but no {WEIGHTS_FILE}: protrain loads safetensors only "
            "(torch pickles can run code when loaded)",
            "convert the checkpoint to safetensors (model.save_pretrained(DIR) in transformers writes it), "
            "or copy config.json alone to a new directory to train from a random init",
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
            raise ConfigError(f"{w} holds neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX}",
                              "point at the directory of a safetensors checkpoint")
    if not w.is_file():
        raise ConfigError(f"weights file {w}: no such file", "give a .safetensors file or its directory")
    if w.name.endswith(".json"):
        try:
            shards = sorted(set(json.loads(w.read_text(encoding="utf-8"))["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{w}: not a safetensors index (a JSON object with a weight_map)",
                              "write the checkpoint again with save_pretrained") from e
        return [w.parent / s for s in shards]
    if w.suffix != ".safetensors":
        raise ConfigError(f"{w}: protrain loads .safetensors files only (torch pickles can run code)",
                          "convert the checkpoint with model.save_pretrained(DIR) in transformers")
    return [w]


@torch.no_grad()
def load_weights(model: HFCausalLM, files: list[str | Path]) -> None:
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
    patterns = [*(getattr(model.hf, "_keys_to_ignore_on_load_unexpected", None) or []), r"rotary_emb\.inv_freq$"]
    ignore = [re.compile(pat) for pat in patterns]
    loaded: set[int] = set()
    unexpected, mismatched = [], []
    for f in files:
        try:
            tensors = load_file(str(f), device="cpu")
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{f}: cannot read as safetensors ({e})", "check the file is complete") from e
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
        return [f"{what}: {', '.join(names[:5])}" + (" …" if len(names) > 5 else "")] if names else []

    problems = listed("missing", missing) + listed("unexpected", unexpected) + mismatched[:5]
    if problems:
        where = str(files[0]) + (f" and {len(files) - 1} more files" if len(files) > 1 else "")
        raise ConfigError(f"weights in {where} do not fit "
                          f"{type(model.hf).__name__}:\n  " + "\n  ".join(problems),
                          "use the checkpoint saved with this config.json (same directory)")


# ---------------------------------------------------------------------------- export

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json")
"""Files copied from the tokenizer directory into an export, when present."""


def export(model: HFCausalLM, state: dict[str, torch.Tensor], out_dir: str | Path, *,
           config_path: str | Path | None = None, tokenizer_dir: str | Path | None = None) -> Path:
    """Write ``model`` with weights ``state`` as a Hugging Face directory; returns it.

    ``state``: parameter name → tensor in the model's own names (``Engine.state_dict()
    ["model"]``: the fp32 masters). Written: ``config.json`` (a copy of ``config_path``,
    the file the model was built from, so dropout and cache settings are the user's and
    not training's; without it, the live config less our attention implementation),
    ``model.safetensors`` (tied aliases stored once, as
    ``save_pretrained`` does) and the tokenizer's files from ``tokenizer_dir``. The
    directory appears whole: it is written under a temporary name and renamed.
    """
    import os
    import shutil

    from safetensors.torch import save_file

    out = Path(out_dir)
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
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
        tensors = {n: state[n].detach().to("cpu").contiguous() for n, p in params.items() if tied[id(p)] == n}
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    shutil.copyfile(Path(tokenizer_dir) / name, tmp / name)
        if out.is_dir():
            out.rmdir()  # checked empty before training (preflight.output_dir)
        os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"cannot write the export {out}: {e.strerror}",
                          "check the directory is writable and the disk has space") from None
    return out
