"""Plan vs live model: fingerprint, parameter names, shapes, dtypes, blocks, tied parameters.

A plan made for another model must be refused before any state changes (Terraform's
stale plan): the chunk layout would put tensors at the wrong offsets. The plan
stores every parameter's (name, shape, dtype), so a mismatch is reported parameter
by parameter, with did-you-mean on near names, not as two opaque hashes.
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import ConfigError, FingerprintError, did_you_mean
from .plan import Plan, fingerprint

Signature = list[tuple[str, tuple[int, ...], str]]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``"float32"`` (the spelling plans use)."""
    return str(dtype).removeprefix("torch.")


def model_signature(model: nn.Module) -> Signature:
    """(name, shape, dtype) of each unique parameter, in registration order.

    Works on meta tensors, so a 70B model can be checked without allocating it.
    Tied parameters appear once, under the first name ``named_parameters`` yields.
    """
    return [(n, tuple(p.shape), dtype_name(p.dtype)) for n, p in model.named_parameters()]


def tied_pairs(model: nn.Module) -> list[list[str]]:
    """``[name, alias]`` for every parameter reachable under more than one name."""
    first: dict[int, str] = {}
    pairs = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            pairs.append([first[id(p)], name])
        else:
            first[id(p)] = name
    return pairs


def model_fingerprint(model: nn.Module, blocks: list[str]) -> str:
    """The fingerprint a plan for this model and block list must carry."""
    return fingerprint(model_signature(model), blocks)


def check(plan: Plan, model: nn.Module, where: str = "plan", name: str | None = None) -> None:
    """Raise ``FingerprintError`` unless ``plan`` was made for ``model``.

    ``name``: the model's name as the user gave it (``gpt2-tiny``, ``hf:DIR``), so the
    hint says how to plan for the model being run, not for the plan's.

    Checks, in order: every block path exists; the parameter lists agree (missing,
    extra, changed shape or dtype, each listed); tied parameters are the same tensor;
    the fingerprint agrees (it covers everything above, so this last test only fires
    if the plan's own listing was edited inconsistently).
    """
    run_name = name  # `name` is reused by the loops below
    # One list per kind of problem, each capped on display, so a plan for an entirely
    # different model shows some of each kind rather than 20 lines of the first.
    blocks_bad: list[str] = []
    missing: list[str] = []
    extra: list[str] = []
    changed: list[str] = []
    tying: list[str] = []
    modules = dict(model.named_modules())
    for b in plan.model.blocks:
        if b not in modules:
            blocks_bad.append(f"block {b!r} is not a module of the model{did_you_mean(b, modules)}")

    live = {n: (shape, dt) for n, shape, dt in model_signature(model)}
    planned = {p.name: (tuple(p.shape), p.dtype) for c in plan.chunks.items for p in c.params}
    for name in sorted(planned.keys() - live.keys()):
        missing.append(f"missing in the model: {name}{did_you_mean(name, live.keys() - planned.keys())}")
    for name in sorted(live.keys() - planned.keys()):
        extra.append(f"not in the plan: {name} {list(live[name][0])} {live[name][1]}")
    for name in sorted(planned.keys() & live.keys()):
        (ps, pd), (ls, ld) = planned[name], live[name]
        if ps != ls:
            changed.append(f"shape of {name}: plan {list(ps)}, model {list(ls)}")
        if pd != ld:
            changed.append(f"dtype of {name}: plan {pd}, model {ld}")

    params = dict(model.named_parameters(remove_duplicate=False))
    for name, alias in plan.model.tied:
        if name in params and alias in params and params[name] is not params[alias]:
            tying.append(f"{alias} is tied to {name} in the plan but is a separate tensor in the model")
        elif alias not in params:
            tying.append(f"tied alias {alias} is not a parameter name of the model")
    live_tied = {tuple(p) for p in tied_pairs(model)}
    for name, alias in sorted(live_tied - {tuple(p) for p in plan.model.tied}):
        tying.append(f"{alias} is tied to {name} in the model but not in the plan")

    problems: list[str] = []
    for group in (blocks_bad, missing, extra, changed, tying):
        problems += group[:8] + ([f"… and {len(group) - 8} more like this"] if len(group) > 8 else [])
    if not problems and model_fingerprint(model, plan.model.blocks) != plan.model.fingerprint:
        problems.append("fingerprint differs although every parameter matches (the plan was edited)")
    if problems:
        raise FingerprintError(f"{where} was made for another model ({plan.model.name}, {len(planned)} parameters; "
                               f"this model has {len(live)}):\n  " + "\n  ".join(problems),
                               f"make a plan for this model: `protrain plan --model {run_name} …`" if run_name else
                               "make a plan for this model with `protrain plan --model NAME …` (NAME: the model you run), "
                               f"or run the plan's model, {plan.model.name}")
    # Schema 8: a plan provisions no gradient, master or moments for a chunk it says is frozen.
    # Training a parameter the plan froze is refused; freezing one it trains is not (it needs less).
    trains = [p.name for c in plan.chunks.items for p in c.params if p.frozen and params[p.name].requires_grad]
    if trains:
        raise ConfigError(f"{where} was made with {len(trains)} parameters frozen that this model trains "
                          f"({', '.join(trains[:3])}{', …' if len(trains) > 3 else ''})",
                          "freeze them as the plan was made (e.g. `--lora` with the same adapter), or make "
                          "a plan for the model as it trains now")
