"""LoRA through peft: a frozen base with low-rank adapters, planned and trained (issue 30).

``inject`` puts peft's LoRA layers into any model protrain builds (a zoo model or an
``hf:`` one), in place, and freezes everything else, as ``get_peft_model`` does: the
model keeps its class, its ``forward`` and its blocks, so the planner traces it and the
executor wraps it like any other. A frozen parameter is one the plan marks
(``Param.frozen``): its chunk keeps only its values (plans/homes.py), and the layout
puts the adapters in chunks of their own (``layout.layout_order``).

peft is an optional extra (``pip install -e ".[peft]"``); it is imported on first use.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from protrain.plans.errors import ConfigError, did_you_mean

from .lora_spec import LoraSpec

ADAPTER = "default"
"""peft's adapter name: the one ``PeftModel.from_pretrained`` loads by default."""


def _peft():
    try:
        import peft
    except ImportError:
        raise ConfigError(
            "--lora needs peft, which is not installed",
            'install the extra: pip install -e ".[peft]"',
        ) from None
    return peft


def attention_projections(model: nn.Module) -> tuple[str, ...]:
    """The family's attention projections: the linear layers (``nn.Linear``, or transformers'
    GPT-2 ``Conv1D``) directly inside a module whose name says attention (``self_attn``,
    ``attn``, ``attention``), by name: ``q_proj k_proj v_proj o_proj`` for llama, ``qkv_proj
    o_proj`` for phi3; a name that a layer outside attention has too is qualified by its
    parent (GPT-2: ``attn.c_attn attn.c_proj``, not the MLP's ``c_proj``), as peft matches
    a target against the end of each module's path."""
    inside: list[tuple[str, str]] = []
    outside: set[str] = set()
    for path, m in model.named_modules():
        if not (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"):
            continue
        parent, _, leaf = path.rpartition(".")
        last = parent.rpartition(".")[2]
        if "attn" in last.lower() or "attention" in last.lower():
            inside.append((last, leaf))
        else:
            outside.add(leaf)
    names: list[str] = []
    for last, leaf in inside:
        name = f"{last}.{leaf}" if leaf in outside else leaf
        if name not in names:
            names.append(name)
    if not names:
        raise ConfigError(
            f"found no attention projections to adapt in {type(model).__name__}",
            "name the modules: --lora-targets q_proj,v_proj",
        )
    return tuple(names)


def config(spec: LoraSpec, model: nn.Module):
    """peft's ``LoraConfig`` for ``spec`` on ``model``."""
    peft = _peft()
    if spec.targets is not None:
        check_targets(spec.targets, model)
    targets = list(spec.targets or attention_projections(model))
    return peft.LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=targets,
        bias="none",
    )


def check_targets(targets: tuple[str, ...], model: nn.Module) -> None:
    """Refuse ``--lora-targets`` names that match no module of ``model`` (as peft matches a
    target: a module's whole path, or its end after a dot), with the closest linear layer's
    name; and an empty list. peft itself ignores a name that matches nothing as long as another
    one matches, so a misspelt target trained no adapter there (issue 39 item 11)."""
    if not targets:
        raise ConfigError(
            "--lora-targets names no module (an empty list)",
            "name the modules to adapt, e.g. --lora-targets "
            + ",".join(attention_projections(model)),
        )
    paths = [p for p, _ in model.named_modules() if p]
    linear = sorted(
        {
            name
            for path, m in model.named_modules()
            if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"
            for name in (path.rpartition(".")[2], ".".join(path.split(".")[-2:]))
        }
    )
    for t in targets:
        if not any(p == t or p.endswith("." + t) for p in paths):
            raise ConfigError(
                f"--lora-targets {t!r}: no module of {type(model).__name__} is named so"
                f"{did_you_mean(t, linear)}; its linear layers are named "
                + ", ".join(sorted({n.rpartition(".")[2] for n in linear})),
                "choose --lora-targets among those names, e.g. --lora-targets "
                + ",".join(attention_projections(model)),
            )


def inject(model: nn.Module, spec: LoraSpec, seed: int = 0) -> nn.Module:
    """``model`` with peft's LoRA layers in place and every other parameter frozen (returned;
    the same object). On a real device the adapters' A matrices are drawn from ``seed``
    (peft's init; B starts at zero), leaving the global RNG as it was; on meta nothing is
    allocated. An ``HFCausalLM`` gets its transformers model adapted."""
    peft = _peft()
    inner = getattr(model, "hf", None)
    target = inner if isinstance(inner, nn.Module) else model
    cfg = config(spec, target)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            peft.inject_adapter_in_model(cfg, target, adapter_name=ADAPTER)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise ConfigError(
            f"LoRA: {e}", "choose --lora-targets among the model's linear layers"
        ) from None
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    return model


def injected(model: nn.Module) -> tuple[str, ...]:
    """The targets that carry an adapter, in model order, named as ``attention_projections``
    names them (a leaf name another, unadapted linear layer also has is qualified by its parent)."""
    adapted = [
        path
        for path, m in model.named_modules()
        if hasattr(m, "lora_A") and hasattr(m, "base_layer")
    ]
    others = {
        path.rpartition(".")[2]
        for path, m in model.named_modules()
        if (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")
        and not any(path == a or path.startswith(a + ".") for a in adapted)
    }
    names: list[str] = []
    for path in adapted:
        parent, _, leaf = path.rpartition(".")
        name = f"{parent.rpartition('.')[2]}.{leaf}" if leaf in others else leaf
        if name not in names:
            names.append(name)
    return tuple(names)


def check_plan(plan, lora: LoraSpec | None, where: str) -> None:
    """Refuse, before the model is built, a LoRA plan trained without ``--lora`` and the reverse."""
    frozen = any(p.frozen for c in plan.chunks.items for p in c.params)
    adapters = any("lora_" in p.name for c in plan.chunks.items for p in c.params)
    if lora is None and adapters:
        raise ConfigError(
            f"{where} was made for a LoRA model (its parameters include peft's adapters)",
            "train with --lora and the --lora-r/--lora-targets it was planned with",
        )
    if lora is not None and not (frozen and adapters):
        raise ConfigError(
            f"{where} was made for training the whole model, not LoRA",
            "make a plan with `protrain plan … --lora`, or drop --lora",
        )


def trainable_count(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameter elements."""
    ps = list(model.parameters())
    return sum(p.numel() for p in ps if p.requires_grad), sum(p.numel() for p in ps)


def base_fingerprint(model: nn.Module) -> str:
    """``sha256:`` of the frozen parameters' names, shapes, dtypes and values: what an
    adapter checkpoint was trained on (resume refuses another base)."""
    h = hashlib.sha256()
    for n, p in sorted(model.named_parameters(), key=lambda x: x[0]):
        if p.requires_grad:
            continue
        t = p.detach()
        h.update(f"{n}|{list(t.shape)}|{t.dtype}|".encode())
        if t.device.type != "meta":
            h.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return "sha256:" + h.hexdigest()


# ---------------------------------------------------------------------------- export


def peft_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors as peft saves them (``adapter_model.safetensors``): keys
    ``base_model.model.<path>.lora_A.weight`` relative to the transformers model, taken
    from ``state`` (the engine's ``state_dict()["model"]``, names as ``model``'s)."""
    out = {}  # (an HFCausalLM's names are its transformers model's: hf.py [Note: one module tree])
    for name, t in state.items():
        if "lora_" not in name:
            continue
        key = name.replace(f".{ADAPTER}.", ".")
        out["base_model.model." + key] = t.detach().to("cpu").contiguous().clone()
    return out


def export_adapter(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    spec: LoraSpec,
    out_dir: str | Path,
    base_name: str = "",
    tokenizer_dir: str | Path | None = None,
    chat_template: str | Path | None = None,
) -> Path:
    """Write the trained adapter in peft's own format (``adapter_config.json``,
    ``adapter_model.safetensors``) and the tokenizer's files (``chat_template`` as its
    template: ``hf_checkpoint.copy_tokenizer``) to ``out_dir``:
    ``PeftModel.from_pretrained(base, out_dir)`` loads it. ``base_name``: the config's
    ``base_model_name_or_path``, written as given (``base_name``, the function, says what to
    give). Written into a temporary directory beside it and renamed
    (``hf_checkpoint.atomic_directory``): whole or not at all."""
    from safetensors.torch import save_file

    from .hf_checkpoint import atomic_directory, copy_tokenizer

    out = Path(out_dir)
    cfg = config(
        spec if spec.targets else LoraSpec(spec.r, spec.alpha, spec.dropout, injected(model)), model
    )
    cfg.base_model_name_or_path = base_name or None
    cfg.inference_mode = True
    if isinstance(
        getattr(model, "hf", None), nn.Module
    ):  # a transformers causal LM (planner/models/hf.py)
        cfg.task_type = "CAUSAL_LM"
    tensors = peft_state_dict(model, state)
    with atomic_directory(out, "the adapter export") as tmp:
        cfg.save_pretrained(str(tmp))
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        copy_tokenizer(tokenizer_dir, tmp, chat_template)
    return out


def export_checkpoint(
    checkpoint: str | Path,
    model_name: str,
    spec: LoraSpec,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    chat_template: str | Path | None = None,
    given_name: str | None = None,
) -> Path:
    """``protrain export --lora``: a LoRA run's checkpoint (``train --lora`` saves the adapters
    alone: executor/checkpoint.py [Note: adapter checkpoints]) exported as ``train --lora
    --export`` exports it, the adapter in peft's format (``export_adapter``). Its names and
    shapes must be those ``spec``'s adapters have on this model (checked as ``load`` checks).
    ``given_name``: the base as the user named it (``--hf-config`` as typed; default
    ``model_name``), for ``base_name``."""
    from .hf import build, parse_hf_name
    from .hf_checkpoint import load_model_state

    path, blocks = parse_hf_name(model_name)
    model = inject(build(path, blocks=blocks, device="meta"), spec)
    shapes = {n: list(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    state = load_model_state(checkpoint, shapes, what="--lora settings")
    return export_adapter(
        model,
        state,
        spec,
        out_dir,
        base_name=base_name(given_name or model_name),
        tokenizer_dir=tokenizer_dir,
        chat_template=chat_template,
    )


def base_name(given: str) -> str:
    """``adapter_config.json``'s ``base_model_name_or_path`` for a base the user named ``given``:
    an ``--hf-config PATH`` or ``hf:PATH[#BLOCKS]`` as typed, before the CLI made it absolute.

    The name stays as typed (a relative path, or a hub-style ``org/name``) because the adapter
    travels: peft's ``AutoPeftModelForCausalLM.from_pretrained(adapter)`` loads the base from
    this name, so an absolute path of the machine that trained it breaks once the adapter and
    its base are moved or copied to another machine, while the name the user gave resolves
    wherever they give it again (issue 40). A ``config.json`` named directly stands for its
    directory, which is what ``from_pretrained`` reads."""
    from .base import is_hf_name
    from .hf import parse_hf_name

    path = parse_hf_name(given)[0] if is_hf_name(given) else given
    return str(Path(path).parent) if Path(path).is_file() else path


def merged_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base's weights with each adapter folded in, under the names the model had before
    injection (``...q_proj.weight``), as peft's ``merge_and_unload`` computes them (each LoRA
    layer's ``scaling`` and ``fan_in_fan_out``): for ``from_pretrained``. ``state``: the
    engine's ``state_dict()["model"]`` of the injected ``model``; its frozen base is the base
    as trained, in the plan's compute dtype (a frozen chunk keeps no fp32 master: chunks.py
    [Note: frozen chunks]), so a 16-bit run merges into its 16-bit base."""
    out = {name.replace(".base_layer.", "."): t for name, t in state.items() if "lora_" not in name}
    for path, m in model.named_modules():
        if not (
            hasattr(m, "lora_A")
            and hasattr(m, "base_layer")
            and ADAPTER in getattr(m, "lora_A", {})
        ):
            continue
        a, b = state[f"{path}.lora_A.{ADAPTER}.weight"], state[f"{path}.lora_B.{ADAPTER}.weight"]
        delta = b @ a
        if getattr(m, "fan_in_fan_out", False):
            delta = delta.T
        w = state[f"{path}.base_layer.weight"]
        out[f"{path}.weight"] = (w + (delta * m.scaling[ADAPTER]).to(w.dtype)).contiguous()
    return out


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------- CLI


def build_model(name: str, lora: LoraSpec | None, **kw) -> nn.Module:
    """``models.build(name, **kw)``, with ``lora``'s adapters injected (seeded by ``kw``'s seed)."""
    from .zoo import build

    model = build(name, **kw)
    return inject(model, lora, seed=kw.get("seed", 0)) if lora is not None else model
