"""Hugging Face causal LMs as protrain models (optional extra ``hf``: ``pip install transformers``).

A model is built from a LOCAL ``config.json`` (never from the hub: transformers'
``AutoConfig.from_pretrained`` reads that file only, ``local_files_only``, and no remote
code runs; the weights are read by ``hf_checkpoint``), or adapted from a model the caller
already holds, and comes back as an ``HFCausalLM``: a module whose forward takes
``(idx, targets)`` and returns the loss, as the zoo's models do, so the planner and
the executor treat it like any zoo model. The module names are Hugging Face's own, so
a plan for ``hf:./llama`` names ``model.layers.3.self_attn.q_proj.weight`` as the
checkpoint does.

Which models: whatever ``AutoModelForCausalLM.from_config`` builds from the
config.json's ``model_type`` in the installed transformers (``causal_lm_classes``),
with ``architectures``, when present, naming that class or another causal LM of the
same config class. ``load_config`` refuses, each with its reason and never
suggesting another model_type (a near name is another architecture, and building
it would silently train a different model):

- ``auto_map`` configs: their code lives in the model's repository
  (``trust_remote_code``), and protrain runs no downloaded code;
- a model_type this transformers does not know (the hint: upgrade transformers), or
  one it builds no causal LM for (encoders such as T5 or ViT);
- ``architectures`` naming another head (``BertForMaskedLM``) or another family's class;
- the families in ``REFUSED``, whose forward syncs the device on values
  (data-dependent control flow we cannot plan around). A family nobody listed yet
  that does the same is refused by name the first time it is planned: planning runs
  its forward on ``meta``, where reading a value fails (``HFCausalLM._meta_forward``).

tests/test_hf_families.py trains a matrix of families (dense, fused-qkv,
parallel-residual, ALiBi, MLA, sliding-window, soft-capped, attention sinks,
state-space, hybrid, mixture-of-experts) exactly under every plan kind.

Model names ``hf:PATH`` and ``hf:PATH#BLOCKS`` (PATH: a ``config.json`` or the
directory holding it; BLOCKS: the module path of the block list, e.g.
``model.layers``) are resolved by ``planner/models/zoo.py``, so every command that takes
a zoo name takes these too. ``hf_model_name`` and ``model_name_option`` make these
names from ``--hf-config PATH [--blocks PATH]``, with PATH made absolute so a plan
made here names its model from any directory. A directory that also holds
``model.safetensors`` (or a sharded ``model.safetensors.index.json``) is a
checkpoint: its weights are loaded when the model is built on a real device, whether
PATH names the directory or the ``config.json`` in it (the built model's
``weights_loaded_from`` lists the files; empty: initialised from the seed).
``export`` writes a trained model back as a directory transformers loads. Reading
and writing those files is ``planner/models/hf_checkpoint.py``'s job.
transformers is imported on first use (``_transformers``), so parsing a name does
not need it.

What we set, and why:

- **Attention**: ``ATTENTION``, our causal SDPA in transformers' attention registry,
  for every call it computes exactly, and the family's own implementation for the
  rest (``planner/models/hf_attention.py``, [Note: which attention]).
- **Experts**: ``EXPERTS``, transformers' ``grouped_mm`` experts (nothing read back to
  the host), also runnable on ``meta`` in fp32 (``planner/models/hf_experts.py``).
- **No KV cache** (``use_cache=False``), no LayerDrop (a skipped layer would skip the
  plan's events), and dropout 0 unless asked (as ``models.build``): every config field
  named ``*dropout``/``*pdrop`` (``_DROPOUT_FIELD``).
- **Build on meta, then materialise**: the config is instantiated on ``meta``
  (llama-7b in ~0.05 s, nothing allocated); on a real device the storage is created
  with ``to_empty`` and initialised by transformers' own ``init_weights`` (per-model
  rules such as GPT-2's scaled residual projections, and the RoPE ``inv_freq``
  buffers) under a forked global RNG seeded with ``seed``, so the caller's RNG state
  is untouched and equal seeds give equal weights.
- **Blocks**: the first ``nn.ModuleList`` of ``num_hidden_layers`` modules (hybrid
  families mix layer classes there), else the longest list of one class.

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

import inspect
import json
import re
from pathlib import Path

import torch
from torch import nn

from protrain.plans.errors import ConfigError, did_you_mean

from ..shipped import shipped_config
from .base import (
    HF_PREFIX,
    ModelInfo,
    count_params,
    document_mask,
    find_block_list,
    is_hf_name,
    lm_loss,
    materialize,
)
from .hf_attention import ATTENTION, DOCUMENTS, OWN, causal_attention, own_default
from .hf_checkpoint import (
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    config_file,
    export,
    has_checkpoint,
    load_weights,
    refuse_pickles,
    weight_files,
)
from .hf_experts import EXPERTS, grouped_experts

__all__ = [
    # re-exported: callers import the whole Hugging Face adapter as protrain.planner.models.hf
    "ATTENTION",
    "EXPERTS",
    "OWN",
    "WEIGHTS_FILE",
    "WEIGHTS_INDEX",
    "causal_attention",
    "config_file",
    "export",
    "grouped_experts",
    "load_weights",
    "weight_files",
    # this module's own
    "REFUSED",
    "HFCausalLM",
    "build",
    "causal_lm_classes",
    "describe",
    "find_blocks",
    "from_model",
    "hf_model_name",
    "load_config",
    "model_name_option",
    "parse_hf_name",
]

REFUSED = {
    "gpt_neo": (
        "its own attention code (it cannot use protrain's) builds the mask with transformers' "
        "packed-sequence check, which reads position values back to the host: a device sync in "
        "every forward, and no forward on meta for planning"
    ),
    "jetmoe": "its mixture-of-experts router reads the tokens-per-expert counts back to the host "
    "(expert_size.tolist()): a device sync in every forward that depends on the data",
    "dbrx": (
        "its experts loop over the experts the router hit (nonzero on the routing), reading the "
        "routing back to the host: a device sync in every MoE layer that depends on the data"
    ),
}
"""model_type → why protrain refuses it. Everything else ``AutoModelForCausalLM`` builds
from a local config.json is accepted; tests/test_hf_families.py trains a family matrix."""

# Config fields that are dropout probabilities: "dropout", "attention_dropout",
# "resid_pdrop", "hidden_dropout_prob", ... (the names vary by family).
_DROPOUT_FIELD = re.compile(r"(^|_)(dropout|pdrop)(_prob|_rate)?$")


def _transformers():
    """transformers (the optional extra), with our attention and experts registered in it.

    Imported on first use, not with this module, so that model names can be parsed
    (and the CLI can start) without it; registering is a dict update, safe to repeat.
    """
    try:
        import transformers
    except ImportError as e:
        raise ConfigError(
            f"Hugging Face models need the transformers package ({e})",
            "pip install 'protrain[hf]'  (or: pip install transformers safetensors)",
        ) from e
    transformers.AttentionInterface.register(ATTENTION, causal_attention)
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS, grouped_experts)
    return transformers


# ---------------------------------------------------------------------------- names


def hf_model_name(config_path: str, blocks: str | None = None) -> str:
    """``hf:PATH`` or ``hf:PATH#BLOCKS``: the model name of a local Hugging Face config.

    PATH is a config.json or the directory holding it (with its safetensors
    checkpoint, if any); BLOCKS the module path of the block list (``model.layers``)
    when automatic discovery should be overridden.
    """
    if "#" in str(config_path):
        raise ConfigError(
            f"{config_path}: a Hugging Face config path cannot contain '#'",
            "rename or move the directory",
        )
    return f"{HF_PREFIX}{config_path}" + (f"#{blocks}" if blocks else "")


def parse_hf_name(name: str) -> tuple[str, str | None]:
    """``hf:PATH[#BLOCKS]`` → (PATH, BLOCKS or None)."""
    if not is_hf_name(name):
        raise ConfigError(
            f"{name!r} is not a Hugging Face model name", "write it as hf:PATH[#BLOCKS]"
        )
    path, _, blocks = name[len(HF_PREFIX) :].partition("#")
    if not path:
        raise ConfigError(
            f"{name!r} names no config file",
            "write hf:PATH, PATH a config.json or the directory holding it",
        )
    return path, (blocks or None)


def config_path(path: str) -> Path:
    """``--hf-config PATH`` made absolute; a name that is no path but a config shipped with
    protrain (``plans/configs/NAME``, e.g. ``mixtral-8x7b``) is that config."""
    p = Path(path)
    if not p.exists() and (shipped := shipped_config(path)) is not None:
        return shipped
    return p.resolve()


def model_name_option(model: str | None, hf_config: str | None, blocks: str | None) -> str | None:
    """The model name from the CLI's ``--model NAME`` or ``--hf-config PATH [--blocks PATH]``.

    At most one of the two may be given; ``--blocks`` only with ``--hf-config``.
    Returns None when neither is given (the command decides whether that is an error).
    """
    if model is not None and hf_config is not None:
        raise ConfigError(
            "--model and --hf-config both name the model",
            "give one: --model NAME (a zoo name or hf:PATH), or --hf-config PATH",
        )
    if blocks is not None and hf_config is None:
        raise ConfigError(
            "--blocks names the block list of a Hugging Face model and needs --hf-config",
            "add --hf-config PATH, or drop --blocks (zoo models name their own blocks)",
        )
    if hf_config is not None:
        return hf_model_name(str(config_path(hf_config)), blocks)
    if model is not None and is_hf_name(model):
        path, blocks = parse_hf_name(model)
        return hf_model_name(str(Path(path).resolve()), blocks)
    return model


# ---------------------------------------------------------------------------- config


def causal_lm_classes() -> dict[str, str]:
    """model_type → the causal-LM class this transformers builds for it
    (``AutoModelForCausalLM``'s table)."""
    _transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


_LIST_TYPES = (
    "python -c 'from transformers.models.auto.modeling_auto import "
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as m; print(*sorted(m))'"
)


def load_config(path: str | Path):
    """Read a local config.json into its transformers config class; returns (config, class name).

    ``AutoConfig.from_pretrained(file, local_files_only=True)`` (the file read as transformers
    reads it) and the class ``AutoModelForCausalLM`` would build, with nothing downloaded and no
    remote code.
    Refused, each with its reason (see the module docstring): configs with
    ``auto_map`` (remote code), model types this transformers does not know or builds
    no causal LM for, ``architectures`` naming a class other than a causal LM of this
    model type, and the families in ``REFUSED``.
    """
    f = config_file(path)
    try:
        raw = json.loads(f.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{f}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})",
            f"fix {f}, or write it again with `config.save_pretrained(DIR)`",
        ) from e
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{f}: not a UTF-8 text file ({e.reason})", "point hf:PATH at a config.json"
        ) from e
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{f}: expected a JSON object, found {type(raw).__name__}",
            "a Hugging Face config.json is one object with model_type and the sizes",
        )
    yourself = "or build the model yourself and pass it to protrain.planner.models.hf.from_model"
    if raw.get("auto_map"):
        raise ConfigError(
            f"{f}: auto_map names code from the model's own repository "
            f"({', '.join(sorted(raw['auto_map']))}); protrain builds only what transformers "
            "implements itself and never runs downloaded code (trust_remote_code)",
            f"use a config.json whose model_type transformers implements, {yourself}",
        )
    model_type = raw.get("model_type")
    transformers = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    classes = causal_lm_classes()
    version = f"transformers {transformers.__version__}"
    # Never suggest another model_type: a near name is another architecture, and
    # building it would silently train a different model.
    listing = f"the model types it builds as causal LMs: {_LIST_TYPES}"
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(
            f"{f}: no model_type; it names the architecture transformers builds",
            "use the config.json that came with the model (config.save_pretrained(DIR) writes one)",
        )
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(
            f"{f}: model_type {model_type!r} is unknown to {version}",
            f"a newer transformers may implement it (pip install -U transformers); {listing}",
        )
    if model_type not in classes:
        raise ConfigError(
            f"{f}: model_type {model_type!r} has no causal-LM class in {version} "
            "(it is not a decoder language model), and protrain trains causal LMs",
            f"{yourself}; {listing}",
        )
    if model_type in REFUSED:
        raise ConfigError(
            f"{f}: model_type {model_type!r} is refused: {REFUSED[model_type]}",
            f"{yourself} (the same limits apply), or train another family",
        )
    cls = classes[model_type]
    archs = raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    try:
        # As transformers reads it (special floats such as time_step_limit's Infinity decoded),
        # from this file only: nothing downloaded, no remote code (auto_map was refused above).
        config = transformers.AutoConfig.from_pretrained(
            str(f), local_files_only=True, trust_remote_code=False
        )
    except (TypeError, ValueError, *_strict_errors()) as e:
        raise ConfigError(
            f"{f}: {version} rejects this {model_type} config: {e}", f"fix {f}"
        ) from e
    if arch is not None and arch != cls:
        other = getattr(transformers, arch, None) if arch in classes.values() else None
        if other is None or getattr(other, "config_class", None) is not type(config):
            raise ConfigError(
                f"{f}: architectures names {arch!r}, which is not a causal LM of model_type "
                f"{model_type!r} (for it {version} builds {cls})",
                f'set "architectures": ["{cls}"] to train it as a causal LM, {yourself}',
            )
        cls = arch
    return config, cls


def _strict_errors() -> tuple[type[Exception], ...]:
    # transformers 5 validates configs with huggingface_hub's strict dataclasses,
    # whose errors derive from Exception only.
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def _text_config(config):
    """The language model's config: ``config`` itself, or its text part in a multimodal family."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


_NO_DROPOUT = {"diffllama": {"attention_dropout"}}
"""model_type → dropout fields its transformers class refuses above 0 (DiffLlama: "no
paper-defined dropout semantics"): they stay 0 whatever ``dropout`` is asked for."""


def _training_config(config, dropout: float) -> None:
    """Set what training with a plan needs, in place (see the module docstring)."""
    for c in {id(config): config, id(_text_config(config)): _text_config(config)}.values():
        fixed = _NO_DROPOUT.get(getattr(c, "model_type", None), set())
        for name, value in c.to_dict().items():
            if name in fixed:
                continue
            if (
                _DROPOUT_FIELD.search(name)
                and isinstance(value, float | int)
                and not isinstance(value, bool)
            ):
                setattr(c, name, float(dropout))
        if getattr(c, "layerdrop", 0.0):
            c.layerdrop = 0.0
        c.use_cache = False


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
        self.max_seq_len = int(
            getattr(_text_config(model.config), "max_position_embeddings", 0) or 0
        )
        self.train(model.training)

    def protrain_blocks(self) -> list[str]:
        return list(self.blocks)

    def protrain_roots(self) -> list[nn.Module]:
        """Modules outside this tree whose forward runs the whole model: the transformers model
        (``generate`` calls it). After wrap, a call of it under ``torch.no_grad()`` runs under
        the plan, as one of this adapter does (executor/access.py)."""
        return [self.hf]

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

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Loss (or logits (B, T, V) without targets) of idx (B, T); ``position_ids`` (B, T) for
        packed rows: the model's positions, and attention within each example
        (hf_attention.py [Note: packed rows])."""
        T = idx.size(1)
        if self.max_seq_len and T > self.max_seq_len:
            raise ConfigError(
                f"sequence length {T} exceeds the model's max_position_embeddings="
                f"{self.max_seq_len}",
                f"use --seq {self.max_seq_len} or less",
            )
        if position_ids is not None:
            out = self._packed_forward(idx, position_ids)
        elif idx.device.type == "meta":
            out = self._meta_forward(idx)
        else:
            out = self.hf(input_ids=idx, use_cache=False)
        logits = out.logits if hasattr(out, "logits") else out[0]  # (B, T, V)
        # Targets are the next tokens already (the data loader shifts them), so the
        # zoo's loss, not transformers' (which shifts labels itself).
        return logits if targets is None else lm_loss(logits, targets)

    def _packed_forward(self, idx: torch.Tensor, position_ids: torch.Tensor):
        """The forward of packed rows: hf_attention.py [Note: packed rows]."""
        own = getattr(self.config, "_attn_implementation", None) != ATTENTION
        if own or "position_ids" not in inspect.signature(self.hf.forward).parameters:
            family = getattr(self.config, "model_type", type(self.hf).__name__)
            raise ConfigError(
                f"model_type {family!r} cannot train on packed rows: "
                + (
                    "it computes attention in its own code, which protrain cannot keep within "
                    "each packed example"
                    if own
                    else "its forward takes no position_ids"
                ),
                "train it on raw text (a text dataset, one (idx, targets) pair per micro-batch), "
                "or train another family",
            )
        mask = document_mask(position_ids)  # (B, 1, T, T), or None: one example per row
        if mask is not None:
            setattr(mask, DOCUMENTS, True)  # ours, not the family's
        return self.hf(
            input_ids=idx, position_ids=position_ids, attention_mask=mask, use_cache=False
        )

    def _meta_forward(self, idx: torch.Tensor):
        """The forward on ``meta`` (planning), with a family whose forward reads values refused by
        name.

        A forward that reads a tensor's values back to the host (``.item()``,
        ``.tolist()``, ``nonzero`` to size a loop) cannot run on meta, and on a GPU it
        syncs the device on data every step: such a family is refused here, the first
        time a plan is made for it, rather than failing with torch's meta error.
        """
        try:
            return self.hf(input_ids=idx, use_cache=False)
        except (RuntimeError, NotImplementedError) as e:
            if not _READS_VALUES.search(str(e)):
                raise
            family = getattr(self.config, "model_type", type(self.hf).__name__)
            raise ConfigError(
                f"model_type {family!r}: its forward reads tensor values back to the host "
                f"({str(e).splitlines()[0]}): a device sync every step that depends on the data, "
                "which protrain cannot plan around",
                "train another family (planner/models/hf.py lists the refused ones in REFUSED)",
            ) from e


# torch's messages when a meta tensor's values are asked for.
_READS_VALUES = re.compile(
    r"cannot be called on meta tensors|Cannot copy out of meta tensor|"
    r"data-independent implementation does not exist|data-dependent"
)


def _skip_padding_check(input_ids, attention_mask) -> None:
    """Stands in for ``warn_if_padding_and_no_attention_mask``: our batches have no padding,
    and the check reads token values (an error on meta, a device sync on CUDA)."""


def find_blocks(model: nn.Module, blocks: str | None = None) -> list[str]:
    """Block paths: the children of ``blocks`` (``"model.layers"`` or ``"model.layers.*"``); when
    ``blocks`` is None, of the first ``nn.ModuleList`` holding ``config.num_hidden_layers`` modules
    (hybrid families mix layer classes in it: Jamba's attention and Mamba layers), else of the
    longest ``nn.ModuleList`` of modules of one class."""
    if blocks is None:
        n_layers = getattr(_text_config(model.config), "num_hidden_layers", None)
        stacks = [
            n
            for n, m in model.named_modules()
            if isinstance(m, nn.ModuleList) and len(m) == n_layers
        ]
        path = stacks[0] if stacks else find_block_list(model)
        if path is None:
            raise ConfigError(
                f"cannot find the transformer blocks of {type(model).__name__}: it has no "
                "nn.ModuleList of modules of one class",
                "name the block list: hf:PATH#model.layers, or from_model(model, blocks=...)",
            )
    else:
        path = blocks.removesuffix(".*")
    modules = dict(model.named_modules())
    lists = [n for n, m in modules.items() if isinstance(m, nn.ModuleList | nn.Sequential)]
    hint = f"name a module whose children are the blocks; module lists here: {', '.join(lists)}"
    if path not in modules:
        raise ConfigError(
            f"block list {path!r} is not a module of {type(model).__name__}"
            f"{did_you_mean(path, lists)}",
            hint,
        )
    children = [n for n, _ in modules[path].named_children()]
    if not children:
        raise ConfigError(f"{path!r} has no child modules, so it is not a list of blocks", hint)
    prefix = f"{path}." if path else ""
    return [prefix + n for n in children]


def from_model(model: nn.Module, *, blocks: str | None = None) -> HFCausalLM:
    """Adapt a transformers causal LM the caller built (or loaded) to protrain.

    Sets, in place: our attention (where the class computes attention through
    transformers' attention interface), our experts implementation (where it has
    fused experts), ``use_cache=False``, and on every module the family's own
    attention implementation for [Note: which attention]. Dropout stays as the
    caller set it. LayerDrop is refused: it skips blocks at random, and with them the
    plan's events. A peft ``PeftModel`` (``get_peft_model``) is adapted as the transformers
    model inside it, its LoRA layers in place and its base frozen (planner/models/lora.py).
    """
    if type(model).__module__.startswith("peft.") and hasattr(model, "base_model"):
        model = model.base_model.model  # PeftModel → LoraModel → the injected transformers model
    PreTrainedModel = _transformers().PreTrainedModel
    if not isinstance(model, PreTrainedModel):
        raise ConfigError(
            f"from_model needs a transformers PreTrainedModel, got {type(model).__name__}",
            "for a plain nn.Module, give it forward(idx, targets) and protrain_blocks()",
        )
    own = [
        n for n, _ in [*model.named_parameters(recurse=False), *model.named_buffers(recurse=False)]
    ]
    if own:
        raise ConfigError(
            f"{type(model).__name__} holds tensors at its root ({', '.join(own)}); "
            "protrain's adapter shares the model's children and would miss them",
            "move them into a submodule",
        )
    layerdrop = max(
        [getattr(model.config, "layerdrop", 0.0) or 0.0]
        + [getattr(m, "layerdrop", 0.0) or 0.0 for m in model.modules()]
    )
    if layerdrop:
        raise ConfigError(
            f"{type(model).__name__} has layerdrop={layerdrop}: LayerDrop skips "
            "blocks at random, and a plan's schedule needs every block to run",
            "set model.config.layerdrop = 0.0 and the decoder's .layerdrop = 0.0 first",
        )
    model.config.use_cache = False
    own = own_default(model)
    # Families that compute attention in their own code (no attention interface:
    # BLOOM, MPT, ...) keep it; transformers would only log that it cannot switch.
    if model._can_set_attn_implementation():
        model.set_attn_implementation(ATTENTION)
    if model._can_set_experts_implementation():
        model.set_experts_implementation(EXPERTS)
    for m in model.modules():
        setattr(m, OWN, own)  # see [Note: which attention]
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


def _onto_meta(model: nn.Module) -> None:
    """Move to ``meta`` what a family's ``__init__`` created off it despite the device context.

    ``torch.normal(mean, std, size=...)`` with float arguments ignores the default device
    (DiffLlama's ``lambda_q1`` ... are drawn so, on the CPU); materialising initialises them
    again by the family's own ``_init_weights``, as it does every other parameter.
    """
    if any(t.device.type != "meta" for t in [*model.parameters(), *model.buffers()]):
        model.to("meta")


def build(
    source: str | Path,
    *,
    blocks: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    dropout: float | None = None,
    seed: int = 0,
    weights: str | Path | list[str | Path] | None = None,
) -> HFCausalLM:
    """Build the causal LM a local config.json describes (``source``: the file or its directory).

    On ``device="meta"`` nothing is allocated. Otherwise the model is materialised
    on ``device``, initialised from ``seed`` (see the module docstring), then given
    ``weights`` when there are any: a safetensors file, a list of them, a directory or
    an index json; by default the checkpoint next to config.json when ``source`` is a
    directory holding one. ``dropout`` (default 0) is set on every dropout of the config.
    """

    config, arch = load_config(source)
    _training_config(config, 0.0 if dropout is None else dropout)
    with torch.device("meta"):
        model = getattr(_transformers(), arch)(config)
    _onto_meta(model)
    wrapped = from_model(model, blocks=blocks)
    if torch.device(device).type == "meta":
        _cast_parameters(wrapped, dtype)
        return wrapped
    materialize(wrapped, device=device, seed=seed)
    # The checkpoint beside config.json, whichever of the two the caller named.
    directory = config_file(source).parent
    files = (
        weight_files(weights)
        if weights is not None
        else (weight_files(directory) if has_checkpoint(directory) else [])
    )
    if not files and weights is None:
        refuse_pickles(directory)
    if files:
        load_weights(wrapped, files)
    wrapped.weights_loaded_from = list(files)  # what train reports; empty: the seed's init
    _cast_parameters(wrapped, dtype)  # in place: tied parameters stay one object
    return wrapped


def describe(name: str) -> ModelInfo:
    """Size and shape of ``hf:PATH`` (built on meta; allocates nothing)."""
    path, blocks = parse_hf_name(name)
    model = build(path, blocks=blocks, device="meta")
    c = _text_config(model.config)
    # State-space families have no attention heads (0 in the table).
    n_head = getattr(c, "num_attention_heads", None) or 0
    return ModelInfo(
        name=name,
        family=model.config.model_type,
        n_params=count_params(model),
        n_blocks=len(model.blocks),
        hidden=getattr(c, "hidden_size", 0) or 0,
        n_head=n_head,
        n_kv_head=getattr(c, "num_key_value_heads", None) or n_head,
        vocab_size=c.vocab_size,
        max_seq_len=model.max_seq_len,
    )


def export_checkpoint(
    checkpoint: str | Path,
    model_name: str,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    chat_template: str | Path | None = None,
) -> Path:
    """``protrain export``: the model state of a protrain checkpoint (a root or a step directory)
    as a Hugging Face directory, through ``export`` (``chat_template``: a template file written
    as the tokenizer's ``chat_template.jinja``). The checkpoint is checked as ``load``
    checks it (manifest, sizes, SHA-256, this model's names and shapes, finite values). A LoRA
    run's checkpoint (adapters alone) is refused naming ``--lora`` (``lora.export_checkpoint``)."""
    from protrain.executor.checkpoint import read_manifest, resolve

    from .hf_checkpoint import load_model_state

    path, blocks = parse_hf_name(model_name)
    model = build(path, blocks=blocks, device="meta")
    adapters = [n for n in read_manifest(resolve(checkpoint)).params if "lora_" in n]
    if adapters:
        raise ConfigError(
            f"{checkpoint}: a LoRA checkpoint (it holds peft's adapters, e.g. {adapters[0]}), "
            "not the whole model's",
            "export its adapter: add --lora and the --lora-r/--lora-alpha/--lora-targets it was "
            "trained with",
        )
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {
        n for n, _ in model.named_parameters()
    }
    shapes = {
        n: list(p.shape)
        for n, p in model.named_parameters(remove_duplicate=False)
        if n not in aliases
    }
    state = load_model_state(checkpoint, shapes)
    return export(
        model,
        state,
        out_dir,
        config_path=path,
        tokenizer_dir=tokenizer_dir,
        chat_template=chat_template,
    )
