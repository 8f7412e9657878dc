"""Plan vs live model: fingerprint, parameter names, shapes, dtypes, blocks, tied parameters.

A plan made for another model must be refused before any state changes (Terraform's
stale plan): the chunk layout would put tensors at the wrong offsets. The plan
stores every parameter's (name, shape, dtype), so a mismatch is reported parameter
by parameter, with did-you-mean on near names, not as two opaque hashes.
"""

from __future__ import annotations

import torch
from torch import nn

from protrain.plans.errors import ConfigError, FingerprintError, did_you_mean
from protrain.plans.plan import Plan, fingerprint

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
    first: dict[int, str] = {}  # id → the first name it was reached under
    return [
        [first[id(p)], name]
        for name, p in model.named_parameters(remove_duplicate=False)
        if first.setdefault(id(p), name) != name
    ]


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
    # One list per kind of problem, each capped on display, so a plan for an entirely
    # different model shows some of each kind rather than 20 lines of the first.
    modules = dict(model.named_modules())
    blocks_bad = [
        f"block {b!r} is not a module of the model{did_you_mean(b, modules)}"
        for b in plan.model.blocks
        if b not in modules
    ]
    live = {n: (shape, dt) for n, shape, dt in model_signature(model)}
    planned = {p.name: (tuple(p.shape), p.dtype) for c in plan.chunks.items for p in c.params}
    missing = [
        f"missing in the model: {n}{did_you_mean(n, live.keys() - planned.keys())}"
        for n in sorted(planned.keys() - live.keys())
    ]
    extra = [
        f"not in the plan: {n} {list(live[n][0])} {live[n][1]}"
        for n in sorted(live.keys() - planned.keys())
    ]
    changed = [
        f"{what} of {n}: plan {ours}, model {theirs}"
        for n in sorted(planned.keys() & live.keys())
        for what, ours, theirs in (
            ("shape", list(planned[n][0]), list(live[n][0])),
            ("dtype", planned[n][1], live[n][1]),
        )
        if ours != theirs
    ]

    params = dict(model.named_parameters(remove_duplicate=False))
    tying = [
        f"tied alias {alias} is not a parameter name of the model"
        if alias not in params
        else f"{alias} is tied to {n} in the plan but is a separate tensor in the model"
        for n, alias in plan.model.tied
        if alias not in params or (n in params and params[n] is not params[alias])
    ]
    tying += [
        f"{alias} is tied to {n} in the model but not in the plan"
        for n, alias in sorted(
            {tuple(p) for p in tied_pairs(model)} - {tuple(p) for p in plan.model.tied}
        )
    ]

    problems: list[str] = []
    for group in (blocks_bad, missing, extra, changed, tying):
        problems += group[:8] + (
            [f"… and {len(group) - 8} more like this"] if len(group) > 8 else []
        )
    if not problems and model_fingerprint(model, plan.model.blocks) != plan.model.fingerprint:
        problems.append(
            "fingerprint differs although every parameter matches (the plan was edited)"
        )
    if problems:
        raise FingerprintError(
            f"{where} was made for another model ({plan.model.name}, {len(planned)} parameters; "
            f"this model has {len(live)}):\n  " + "\n  ".join(problems),
            f"make a plan for this model: `protrain plan --model {name} …`"
            if name
            else (
                "make a plan for this model with `protrain plan --model NAME …` (NAME: the model "
                f"you run), or run the plan's model, {plan.model.name}"
            ),
        )
    # Schema 8: a plan provisions no gradient, master or moments for a chunk it says is frozen.
    # Training a parameter the plan froze is refused; freezing one it trains is not (it needs less).
    trains = [
        p.name
        for c in plan.chunks.items
        for p in c.params
        if p.frozen and params[p.name].requires_grad
    ]
    if trains:
        raise ConfigError(
            f"{where} was made with {len(trains)} parameters frozen that this model trains "
            f"({', '.join(trains[:3])}{', …' if len(trains) > 3 else ''})",
            "freeze them as the plan was made (e.g. `--lora` with the same adapter), or make "
            "a plan for the model as it trains now",
        )
