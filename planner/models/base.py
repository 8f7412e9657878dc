"""What every model source shares (the zoo in ``zoo.py``, Hugging Face configs in
``hf.py``, user models): the loss, finding the blocks, materialising a meta-built model,
counting parameters, the ``hf:`` name prefix and the ``protrain models`` row.

Below both sources, so that neither imports the other to reach these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from protrain.plans.errors import ConfigError

IGNORE = -100
"""The target of a position that carries no loss (Hugging Face's label convention; cross_entropy's
default ``ignore_index``): prompts, system turns, padding."""


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean token loss over the supervised targets (``!= IGNORE``); 0 when there are none.

    logits (B, T, V), targets (B, T), already shifted (the token after each position).
    """
    # fp32 loss even for a bf16 model: log-softmax over 50k logits in bf16 loses
    # most of the digits that distinguish a good step from a bad one.
    V = logits.size(-1)
    loss = F.cross_entropy(logits.float().view(-1, V), targets.view(-1), ignore_index=IGNORE)
    # A micro-batch of prompts or padding only has a mean over zero tokens, 0/0 = NaN. It
    # carries no loss: 0, whose gradient is zero everywhere (``where`` sends none to the NaN
    # branch), and the engine weighs it 0 anyway. With supervised tokens ``where`` passes the
    # loss and its gradient through unchanged, bit for bit, and reads nothing back to the host.
    return torch.where(targets.ne(IGNORE).any(), loss, torch.zeros_like(loss))


def document_mask(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Which keys each query of a packed row may attend to: (B, 1, T, T) bool, True where key s
    is at or before query t in the same example; None when no row holds more than one example
    (then plain causal attention is exact, and its ``is_causal`` kernels keep their bits).

    position_ids (B, T) restart at 0 at each packed example (the data contract: a new example
    begins wherever ``position_ids == 0``; a row's padding tail is an example of its own).
    Reads one flag back to the host per forward (on CUDA a sync), so that rows of one example
    each keep the causal kernels; every layer then shares the one mask.
    """
    starts = position_ids == 0  # (B, T)
    if not bool(starts[:, 1:].any()):
        return None
    T = position_ids.size(1)
    example = starts.cumsum(1)  # (B, T): the example each position belongs to
    same = example[:, :, None] == example[:, None, :]  # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()  # (T, T)
    return (same & causal)[:, None]  # (B, 1, T, T)


def block_paths(model: nn.Module) -> list[str]:
    """Module paths of the model's transformer blocks, in execution order.

    A model can say so itself with a ``protrain_blocks()`` method (the zoo models
    and the Hugging Face adapter in ``hf.py`` do). Otherwise we take the children of
    the longest ``nn.ModuleList`` of modules of one class (``find_block_list``).
    """
    own = getattr(model, "protrain_blocks", None)
    if callable(own):
        return list(own())
    best_name = find_block_list(model)
    if best_name is None:
        raise ConfigError(
            f"cannot find the transformer blocks of {type(model).__name__}: it has no "
            "protrain_blocks() method and no nn.ModuleList of modules of one class",
            hint="name the blocks with --blocks (e.g. --blocks 'model.layers.*'), "
            "or give the model a protrain_blocks() method returning their module paths",
        )
    prefix = f"{best_name}." if best_name else ""
    return [f"{prefix}{i}" for i in range(len(model.get_submodule(best_name)))]


def find_block_list(model: nn.Module) -> str | None:
    """Path of the longest ``nn.ModuleList`` whose children are all of one class, or None.

    That is the stack of repeated blocks in Hugging Face models (``model.layers``,
    ``transformer.h``, ``model.decoder.layers``, ``gpt_neox.layers``, ...). Ties go to
    the first in registration order.
    """
    best_name, best_len = None, 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) <= best_len:
            continue
        if len({type(child) for child in module}) == 1:
            best_name, best_len = name, len(module)
    return best_name


HF_PREFIX = "hf:"
"""Model names ``hf:PATH[#BLOCKS]`` are Hugging Face configs (``planner/models/hf.py``), not zoo
entries."""


def is_hf_name(name: str) -> bool:
    return name.startswith(HF_PREFIX)


def materialize(model: nn.Module, device: str | torch.device = "cpu", seed: int = 0) -> nn.Module:
    """Give a meta-built model real storage on `device` and initialise it from `seed`.

    The init draws from a private ``torch.Generator`` on `device` seeded with
    `seed`, so the global RNG state is left exactly as it was and two calls with
    the same seed give bit-identical parameters. (A CPU and a CUDA generator give
    different numbers for the same seed: compare models materialised on the same
    device type.) Tied weights are re-tied after ``to_empty``.
    """
    reset = getattr(model, "reset_parameters", None)
    if not callable(reset):
        raise ConfigError(
            f"cannot materialise {type(model).__name__}: it has no reset_parameters() method",
            hint="build the model on a real device instead of meta, or add reset_parameters()",
        )
    model.to_empty(device=device)
    retie(model)
    generator = torch.Generator(device=device).manual_seed(seed)
    reset(generator=generator)
    return model


def retie(model: nn.Module) -> None:
    """Rejoin tied parameters after a device move."""
    # Module.to_empty / .to(device) rebuild parameters per module, splitting a tied
    # pair into two tensors; tie_weights() (ours, or HF's of the same name) rejoins them.
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()


def count_params(model: nn.Module) -> int:
    """Number of parameter elements, each tied parameter counted once."""
    # parameters() yields each Parameter object once, so tied weights count once.
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class ModelInfo:
    """One row of the `protrain models` table."""

    name: str
    family: str  # "gpt2" or "llama"; a Hugging Face model's model_type
    n_params: int  # unique parameter elements, tied counted once
    n_blocks: int
    hidden: int  # residual stream width (n_embd / dim)
    n_head: int
    n_kv_head: int  # == n_head without GQA
    vocab_size: int
    max_seq_len: int
