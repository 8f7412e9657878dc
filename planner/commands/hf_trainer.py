"""protrain under a transformers ``Trainer`` or TRL ``SFTTrainer`` script, with a few added lines::

    from protrain.planner.commands.hf_trainer import plan_for, prepare

    plan = plan_for(model, args)  # or a committed plan's path
    model, optimizer = prepare(model, plan, args)
    trainer = SFTTrainer(model=model, args=args, ..., optimizers=(optimizer, None))

``prepare`` wraps the model under the plan (``executor.wrap``) and returns what Trainer takes:

- ``PlannedModel``, a module whose forward takes Trainer's batches (``input_ids``, ``labels``,
  ``attention_mask``, ``position_ids``, ``num_items_in_batch``, TRL's ``fused_lm_head``),
  lays them out in the plan's static (micro_batch, seq_len) shape ([Note: static shape]),
  runs the planned model (the engine's split phases: executor/engine.py [Note: split
  phases]) and returns transformers' output with ``.loss`` — the sum of the supervised
  token losses over ``num_items_in_batch``, as transformers' own causal-LM loss;
- ``PlanOptimizer``, a ``torch.optim.Optimizer`` whose ``step()`` ends the engine's step at the
  rate in ``param_groups[0]["lr"]`` (the one Trainer's scheduler writes).

Trainer's checkpoints hold our state in Trainer's own files ([Note: Trainer checkpoints]).

What the plan cannot honour is refused at ``prepare``, by its Trainer option, with the fix
(``refusals``): the plan owns precision, activation policy, sharding and the optimizer.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from protrain.plans import plan as P
from protrain.plans.errors import ConfigError, ProtrainError

IGNORE = -100
"""transformers' label of a token that carries no loss."""

ADAMW = ("adamw_torch", "adamw_torch_fused")
"""Trainer ``optim`` values whose update is the engine's: torch's AdamW."""

PASSED_THROUGH = {"use_cache", "return_dict", "cu_seq_lens_q", "cu_seq_lens_k"}
PASSED_THROUGH |= {"max_length_q", "max_length_k", "seq_idx", "token_type_ids"}
"""Batch keys Trainer or TRL's collator add that the planned forward has no use for: the cache
is off, the output is a ModelOutput, and packed rows' boundaries come from ``position_ids``."""


def _args_value(args, name: str, default=None):
    return getattr(args, name, default)


def refusals(args, plan: P.Plan) -> list[tuple[str, str]]:
    """(what, fix) for each Trainer setting ``plan`` cannot honour, or training would differ."""
    t, out = plan.training, []

    def refuse(cond: bool, what: str, fix: str) -> None:
        if cond:
            out.append((what, fix))

    refuse(
        bool(_args_value(args, "activation_offloading")),
        "activation_offloading=True: the plan chooses which blocks' activations go to the host "
        "(TRL's saved-tensor hooks would move them under the plan's)",
        "set activation_offloading=False; the plan swaps blocks where memory needs it",
    )
    refuse(
        bool(_args_value(args, "torch_compile")),
        "torch_compile=True: a compiled graph bypasses the block hooks that replay the plan",
        "set torch_compile=False",
    )
    refuse(
        bool(_args_value(args, "deepspeed")) or bool(_args_value(args, "fsdp")),
        "deepspeed/fsdp: the plan already places and shards every parameter",
        "remove deepspeed=/fsdp= from the arguments; make a plan for several ranks with "
        "`protrain plan … --world-size N`",
    )
    for flag in ("fp16", "bf16"):
        refuse(
            bool(_args_value(args, flag)),
            f"{flag}=True: Trainer would autocast the forward, but the plan's compute dtype "
            f"({t.compute_dtype}, $.training.compute_dtype) decides the arithmetic",
            f"set {flag}=False; for 16-bit training make the plan with --dtype "
            f"{'float16' if flag == 'fp16' else 'bfloat16'}",
        )
    optim = str(_args_value(args, "optim", "adamw_torch")).removeprefix("OptimizerNames.")
    optim = getattr(_args_value(args, "optim"), "value", optim)
    refuse(
        optim not in ADAMW,
        f"optim={optim!r}: protrain's update is AdamW on the plan's chunks",
        f"set optim to one of {', '.join(ADAMW)}",
    )
    refuse(
        bool(_args_value(args, "weight_decay", 0.0)),
        f"weight_decay={_args_value(args, 'weight_decay')}: Trainer exempts biases and norm "
        "weights from decay, protrain's AdamW decays every trainable parameter",
        "set weight_decay=0.0 (or train with `protrain train --weight-decay`, which decays all)",
    )
    refuse(
        bool(_args_value(args, "label_smoothing_factor", 0.0)),
        "label_smoothing_factor > 0: the smoothed loss is computed outside the planned model",
        "set label_smoothing_factor=0.0",
    )
    refuse(
        bool(_args_value(args, "use_liger_kernel")),
        "use_liger_kernel=True: Liger replaces the model's modules after the plan was made",
        "set use_liger_kernel=False",
    )
    mb = _args_value(args, "per_device_train_batch_size")
    refuse(
        mb is not None and mb != t.micro_batch,
        f"per_device_train_batch_size={mb}, but the plan was made for micro-batch "
        f"{t.micro_batch} ($.training.micro_batch)",
        f"set per_device_train_batch_size={t.micro_batch}, or make the plan for {mb}: "
        "plan_for(model, args)",
    )
    seq = _args_value(args, "max_length")
    refuse(
        seq is not None and seq != t.seq_len,
        f"max_length={seq}, but the plan was made for sequences of {t.seq_len} "
        "($.training.seq_len)",
        f"set max_length={t.seq_len}, or make the plan for {seq}: plan_for(model, args)",
    )
    k = _args_value(args, "gradient_accumulation_steps")
    refuse(
        k is not None and k != t.grad_accum,
        f"gradient_accumulation_steps={k}, but the plan accumulates {t.grad_accum} "
        "micro-batches per step ($.training.grad_accum)",
        f"set gradient_accumulation_steps={t.grad_accum}, or make the plan for {k}: "
        "plan_for(model, args)",
    )
    clip = _args_value(args, "max_grad_norm") or 0.0
    refuse(
        clip > 0 and plan.schedule.cpu_adam != "after_backward",
        f"max_grad_norm={clip}: clipping needs every gradient before any parameter steps, but "
        f"the plan overlaps CPU AdamW steps with backward ($.schedule.cpu_adam = "
        f"{plan.schedule.cpu_adam!r})",
        "make the plan for clipping: plan_for(model, args) (or `protrain plan … "
        "--max-grad-norm X`), or set max_grad_norm=0.0",
    )
    world = _args_value(args, "world_size", 1)
    refuse(
        world != t.world_size,
        f"the script runs {world} processes, but the plan was made for {t.world_size} "
        "($.training.world_size)",
        f"make the plan with --world-size {world}",
    )
    save = _args_value(args, "save_strategy", "no")
    save = getattr(save, "value", save)  # (Trainer's SaveStrategy enum, or its string)
    refuse(
        world > 1 and save != "no",
        f"save_strategy={save} with {world} processes: Trainer "
        "checkpoints a model that owns its gradient reduction by rank 0 alone, while the plan's "
        "chunks are sharded over the ranks ([Note: several processes])",
        "set save_strategy='no'; for checkpoints under ZeRO-3 train with `protrain train` under "
        "torchrun (--save-every N --save-dir DIR)",
    )
    refuse(
        _args_value(args, "n_gpu", 1) > 1,
        f"{_args_value(args, 'n_gpu')} GPUs visible to one process: Trainer would replicate "
        "the model with nn.DataParallel",
        "launch one process per GPU (torchrun) or set CUDA_VISIBLE_DEVICES to one GPU",
    )
    return out


def _check_args(args, plan: P.Plan) -> None:
    found = refusals(args, plan)
    if found:
        raise ConfigError(
            "the Trainer arguments ask for what this plan cannot do: "
            + "; ".join(w for w, _ in found),
            "; ".join(f for _, f in found),
        )


def _with_peft(model: nn.Module, peft_config, seed: int | None) -> nn.Module:
    """``get_peft_model(model, peft_config)``, as SFTTrainer applies its ``peft_config``: after
    ``set_seed(args.seed)`` (``seed``), so LoRA's A matrices draw the same values. (LoRA's B
    starts at 0, so another A changes no loss until the first update at a rate > 0.)"""
    if peft_config is None:
        return model
    import peft
    import transformers

    if seed is not None:
        transformers.set_seed(seed)
    return peft.get_peft_model(model, peft_config)


def _meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on ``meta`` (nothing allocated, nothing of the caller's changed)."""
    memo = {}
    for t in [*model.parameters(), *model.buffers()]:
        twin = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(twin, t.requires_grad) if isinstance(t, nn.Parameter) else twin
    import copy

    return copy.deepcopy(model, memo)


def plan_for(
    model: nn.Module,
    args,
    *,
    peft_config=None,
    seq_len: int | None = None,
    budget: str | int | None = None,
    hardware: str = "cpu",
) -> P.Plan:
    """The planner's plan for ``model`` trained with ``args`` (``TrainingArguments`` or
    ``SFTConfig``): micro-batch ``per_device_train_batch_size``, sequence ``max_length`` (or
    ``seq_len``), ``gradient_accumulation_steps``, clipping when ``max_grad_norm`` > 0, the
    LoRA of ``peft_config`` (applied to a meta copy; ``prepare`` applies it to the model).
    ``budget``: device memory (``"4GiB"`` or bytes; default the spec's whole memory);
    ``hardware``: a spec name or path (``protrain hardware list``), the machine planned for.
    """
    from ..hardware.spec import find_spec
    from ..models.hf import from_model
    from ..profiling.analytic import analytic_profile
    from ..search.planning import make_plan, parse_budget

    seq = seq_len or _args_value(args, "max_length")
    if not seq:
        raise ConfigError(
            "plan_for: the arguments give no sequence length (TrainingArguments has no max_length)",
            "pass plan_for(model, args, seq_len=N), N the length of the tokenized rows",
        )
    with torch.random.fork_rng(devices=[]):  # LoRA's initialisation on meta draws nothing real
        adapted = from_model(_with_peft(_meta_copy(model), peft_config, None))
    spec = find_spec(hardware)
    profile = analytic_profile(
        adapted,
        name=type(model).__name__,
        blocks=adapted.protrain_blocks(),
        micro_batch=_args_value(args, "per_device_train_batch_size", 1),
        seq_len=seq,
        compute_dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        spec=spec,
    )
    clip = _args_value(args, "max_grad_norm") or 0.0
    budget_bytes = (
        parse_budget(budget) if isinstance(budget, str) else budget or spec.device_memory_bytes
    )
    plan, _ = make_plan(
        profile,
        budget_bytes,
        grad_accum=_args_value(args, "gradient_accumulation_steps", 1),
        world_size=_args_value(args, "world_size", 1),
        max_grad_norm=clip if clip > 0 else None,
    )
    return plan


def prepare(model: nn.Module, plan: P.Plan | str | os.PathLike, args, *, peft_config=None):
    """``(PlannedModel, PlanOptimizer)`` for ``Trainer(model=..., optimizers=(optimizer, None))``.

    ``model``: a transformers ``PreTrainedModel`` (or a peft ``PeftModel``) holding its weights;
    ``plan``: a ``Plan`` or a plan file's path; ``args``: the script's ``TrainingArguments`` /
    ``SFTConfig``, checked against the plan (``refusals``); ``peft_config``: the LoRA config
    SFTTrainer would have applied (pass it here instead: the plan is made for the adapted
    model). The optimizer is AdamW with ``args``' rate, betas and epsilon, clipping at
    ``max_grad_norm``.
    """
    from protrain.executor import AdamWConfig, wrap
    from protrain.plans.reader import load

    plan = plan if isinstance(plan, P.Plan) else load(Path(plan))
    _check_args(args, plan)
    model = _with_peft(model, peft_config, _args_value(args, "seed"))
    from ..models.hf import from_model

    adapted = from_model(model)
    clip = _args_value(args, "max_grad_norm") or 0.0
    config = AdamWConfig(
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=0.0,
        max_grad_norm=clip if clip > 0 else None,
    )
    device = "cpu" if _args_value(args, "use_cpu") else None
    engine = wrap(adapted, plan, config, device=device)
    planned = PlannedModel(model, adapted, engine)
    return planned, PlanOptimizer(planned, config)


# [Note: static shape]
# A plan is made for (micro_batch, seq_len) rows. Trainer's collators give rows of at most
# that: (b <= micro_batch, s <= seq_len) padded on the right, or, padding-free (TRL's
# packing), one row of every example of the micro-batch flattened, with position_ids
# restarting at 0 at each example. Targets are made first, in the caller's layout (the
# next token's label; -100 at each row's end, and at each packed example's first token
# as TRL's collator marks it), then the examples are laid into micro_batch rows of
# seq_len in their order, each row filled until the next example does not fit (TRL
# packed them so: its bins hold at most max_length tokens, and filling in order never
# needs more rows than bins). Padding is token 0 with target -100 at positions counting
# from 0, a document of its own (hf_attention.py [Note: packed rows]), so it changes no
# supervised token's loss. An example longer than seq_len is refused; so is, in training,
# a batch that needs more than micro_batch rows. Evaluation batches are larger
# (``per_device_eval_batch_size``, 8 by default, packed by TRL too): under no_grad the
# rows go on into further pieces of micro_batch rows, each run under the plan as a
# micro-batch of its own ([Note: evaluation pieces]).


def _static(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    shape: tuple[int, int],
    pieces: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(idx, targets, position_ids or None, where)`` of (k * micro_batch, seq_len) rows, k = 1
    unless ``pieces``; ``where`` holds each slot's index in the caller's flattened batch, -1 for
    padding. [Note: static shape]."""
    B, S = shape
    labels = input_ids if labels is None else labels
    if attention_mask is not None:
        # right padding only: a 0 followed by a 1 would be left padding
        if bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
            raise ConfigError(
                "the batch is padded on the left (attention_mask has 0s before 1s); the planned "
                "model trains causal rows padded on the right",
                "set tokenizer.padding_side = 'right'",
            )
        labels = labels.masked_fill(attention_mask == 0, IGNORE)
    targets = torch.cat([labels[:, 1:], labels.new_full((labels.size(0), 1), IGNORE)], 1)
    b, s = input_ids.shape
    flat = torch.arange(b * s, device=input_ids.device)
    if position_ids is None:
        if (b > B and not pieces) or s > S:
            raise ConfigError(
                f"a batch of shape ({b}, {s}) does not fit the plan's ({B}, {S}) "
                "(micro_batch, seq_len)",
                f"set per_device_train_batch_size={B} and max_length={S} (truncate the rows)",
            )
        R = -(-b // B) * B  # rows, a whole number of pieces
        idx, out = input_ids.new_zeros((R, S)), targets.new_full((R, S), IGNORE)
        where = flat.new_full((R, S), -1)
        idx[:b, :s], out[:b, :s], where[:b, :s] = input_ids, targets, flat.view(b, s)
        return idx, out, None, where
    starts = (position_ids.reshape(-1) == 0).nonzero().flatten().tolist() + [b * s]
    spans, row, col = [], 0, 0  # (start, end, row, col) of each example, in order
    for a, z in zip(starts[:-1], starts[1:]):
        n = z - a
        if col + n > S:
            row, col = row + 1, 0
        if n > S or (row >= B and not pieces):
            raise ConfigError(
                f"a packed micro-batch of {b * s} tokens (examples of up to {max(n, 0)}) does "
                f"not fit the plan's {B} rows of {S} (micro_batch, seq_len)",
                f"set per_device_train_batch_size={B} and max_length={S} with packing",
            )
        spans.append((a, z, row, col))
        col += n
    R = (row // B + 1) * B
    flat_idx, flat_t = input_ids.reshape(-1), targets.reshape(-1)
    idx, out = input_ids.new_zeros((R, S)), targets.new_full((R, S), IGNORE)
    where = flat.new_full((R, S), -1)
    pos = torch.arange(S, device=idx.device).repeat(R, 1)
    for a, z, row, col in spans:
        n = z - a
        idx[row, col : col + n], out[row, col : col + n] = flat_idx[a:z], flat_t[a:z]
        where[row, col : col + n] = flat[a:z]
        pos[row, col : col + n] = torch.arange(n, device=idx.device)
        pos[row, col + n :] = torch.arange(S - col - n, device=idx.device)  # the padding's own
    return idx, out, pos, where


def _trainer_syncs() -> bool:
    """Whether an accelerate Accelerator exists and marks this micro-batch as its step's last
    (Trainer's ``do_sync_step``): [Note: short last step]."""
    from accelerate.state import GradientState

    return bool(GradientState._shared_state) and GradientState().sync_gradients


class _KeptForward:
    """``PlannedModel.forward``: ours on the class and on every instance; an assignment is kept
    as ``patched_forward`` and not called ([Note: TRL's fused head])."""

    def __get__(self, obj, cls=None):
        return PlannedModel._forward if obj is None else PlannedModel._forward.__get__(obj, cls)

    def __set__(self, obj, patched) -> None:
        obj.__dict__["patched_forward"] = patched


class PlannedModel(PreTrainedModel):
    """The model Trainer holds: Trainer's batches in, transformers' output with ``.loss`` out,
    the work done under the plan. ``.hf`` is the transformers (or peft) model, ``.engine`` the
    protrain Engine.

    A ``PreTrainedModel`` by class for one reason, ``save_pretrained``: Trainer writes a whole
    Hugging Face directory (config, weights, generation config) only through the
    ``save_pretrained`` of a ``PreTrainedModel`` or ``PeftModel`` (``Trainer._save``; accelerate's
    ``unwrap_model`` unwraps only DDP, FSDP, DeepSpeed and compiled modules, so no wrapper of
    ours is looked through); any other model gets its ``state_dict()`` in model.safetensors
    alone, which ``from_pretrained`` cannot load. Its ``__init__`` is nn.Module's: it has no
    weights or config of its own to set up, the inner model's are used."""

    accepts_loss_kwargs = True  # Trainer passes num_items_in_batch: our loss divides by it
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True  # (what it means here: activation_checkpointing_enable)
    _keys_to_ignore_on_save = None

    def __init__(self, hf: nn.Module, adapted: nn.Module, engine):
        nn.Module.__init__(self)  # (not PreTrainedModel's: see the class docstring)
        self.planned = adapted  # the module the engine wraps (its hooks replay the plan)
        object.__setattr__(self, "hf", hf)  # (its children are ours already: not registered)
        self.engine = engine  # (not a module: a plain attribute)
        self.config = hf.config
        self.generation_config = getattr(hf, "generation_config", None)
        self.warnings_issued: dict = {}
        self.model_tags: list[str] = []
        # [Note: clipping through Trainer] the forwards run since the last optimizer step, and
        # the one-element tensor whose gradient shows the engine's norm to clip_grad_norm_
        self.forwards = 0
        self.trainer_checkpointing = False  # Trainer asked for it (activation_checkpointing_enable)
        self.norm_proxy = torch.zeros(1, device=engine.device)

    # [Note: TRL's fused head]
    # SFTTrainer patches ``model.forward`` (``add_fused_lm_head``) so that ``fused_lm_head=True``
    # returns per-token log-probabilities without logits. The patch would call the backbone
    # outside the plan's hooks, so ``forward`` is a descriptor that keeps ours and records the
    # patch; ours answers ``fused_lm_head=True`` with the same fields (``FusedCausalLMOutput``:
    # log_probs, entropy, is_top1, label_mask, loss) computed from the planned logits.

    forward = _KeptForward()

    def _forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        fused_lm_head: bool = False,
        **kwargs,
    ):
        unknown = sorted(set(kwargs) - PASSED_THROUGH)
        if unknown:
            raise ConfigError(
                f"the planned model was called with {', '.join(unknown)}, which it does not take",
                "call it with input_ids, labels, attention_mask, position_ids, num_items_in_batch",
            )
        t = self.engine.plan.training
        dev = self.engine.device
        training = torch.is_grad_enabled()
        idx, targets, pos, where = _static(
            input_ids.to(dev),
            None if labels is None else labels.to(dev),
            None if attention_mask is None else attention_mask.to(dev),
            None if position_ids is None else position_ids.to(dev),
            (t.micro_batch, t.seq_len),
            pieces=not training,
        )
        if training:
            logits = self.planned(idx, position_ids=pos) if pos is not None else self.planned(idx)
            if self.training:
                self.forwards += 1
        else:  # [Note: evaluation pieces]
            logits = self._pieces(idx, pos, where, input_ids.shape)  # (b, s, V)
            valid = where >= 0
            caller = targets.new_full((input_ids.numel(),), IGNORE)
            caller[where[valid]] = targets[valid]
            targets = caller
        tokens = F.cross_entropy(  # (B*T,), 0 where the target is -100
            logits.float().view(-1, logits.size(-1)),
            targets.view(-1),
            ignore_index=IGNORE,
            reduction="none",
        )
        mask = targets.view(-1) != IGNORE
        n = mask.sum() if num_items_in_batch is None else num_items_in_batch
        if not fused_lm_head:
            from transformers.modeling_outputs import CausalLMOutput

            loss = tokens.sum() / (n if torch.is_tensor(n) else torch.tensor(n)).to(dev)
            return CausalLMOutput(loss=loss, logits=logits)
        from trl.trainer.utils import FusedCausalLMOutput

        log_probs = -tokens
        with torch.no_grad():
            flat = logits.detach().float().view(-1, logits.size(-1))
            logp = flat.log_softmax(-1)
            entropy = -(logp.exp() * logp).sum(-1) * mask
            top1 = (flat.argmax(-1) == targets.view(-1)) & mask
        loss = tokens.sum() / torch.as_tensor(n, device=dev).clamp(min=1)
        return FusedCausalLMOutput(
            loss=loss, log_probs=log_probs, entropy=entropy, is_top1=top1, label_mask=mask
        )

    # [Note: evaluation pieces]
    # Trainer evaluates ``per_device_eval_batch_size`` rows at a time (and TRL packs them into
    # one flattened row), more than the plan's micro-batch. Under no_grad the batch is laid
    # out as for training ([Note: static shape]) into as many pieces of micro_batch rows as
    # it needs; each piece runs as one forward of the planned model, so the plan's fetches
    # and releases replay per piece (executor/access.py [Note: the model between steps]).
    # Each piece's logits go back to the caller's slots (``where``), so the output is the
    # caller's layout, (b, s, V), and the loss is transformers': the sum of the batch's
    # supervised token losses over ``num_items_in_batch`` (Trainer's ``prediction_step``
    # counts it as in training; without it, over the batch's supervised tokens).

    def _pieces(
        self, idx: torch.Tensor, pos: torch.Tensor | None, where: torch.Tensor, shape
    ) -> torch.Tensor:
        B, logits = self.engine.plan.training.micro_batch, None
        for r in range(0, idx.size(0), B):
            rows = slice(r, r + B)
            part = (  # (B, S, V)
                self.planned(idx[rows], position_ids=pos[rows])
                if pos is not None
                else self.planned(idx[rows])
            )
            if logits is None:
                logits = part.new_zeros(shape[0] * shape[1], part.size(-1))
            keep = where[rows] >= 0
            logits[where[rows][keep]] = part[keep]
        return logits.view(*shape, -1)

    # -- what Trainer calls besides forward

    @property
    def loss_type(self) -> str | None:
        """The transformers model's (``ForCausalLM``: ours shifts the labels as its loss does).
        Trainer reads it to count a step's supervised tokens, ``num_items_in_batch``, over
        ``labels[..., 1:]``; without it, it counts every row's first label too, and the loss
        is divided by more tokens than the model without protrain divides by."""
        return getattr(self.hf, "loss_type", None)

    def add_model_tags(self, tags) -> None:
        self.model_tags += [tags] if isinstance(tags, str) else list(tags)

    def get_input_embeddings(self) -> nn.Module:
        return self.hf.get_input_embeddings()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the gradients live in the plan's chunks, which each step starts afresh."""

    def to(self, *args, **kwargs):
        """Accept a move to where the plan put the model (Trainer and accelerate place every
        model); refuse any other device or dtype."""
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        same = device is None or torch.device(device).type == self.engine.device.type
        if not same or dtype is not None:
            raise ProtrainError(
                f"the planned model cannot move to {device or dtype}: the plan places every "
                f"chunk (on {self.engine.device}) and fixes its dtype",
                "make a plan for the device and dtype wanted",
            )
        return self

    def activation_checkpointing_enable(self, *args, **kwargs) -> None:
        """Trainer's ``activation_checkpointing`` (TRL's default): the plan's policies stand.

        Checkpointing trades memory for recomputation and changes no arithmetic (torch
        restores the RNG for the recompute); the plan already chose, per block, whether to
        keep, swap or checkpoint its activations to fit the budget it was made for, so
        recomputing on top of it would only cost time."""
        self.trainer_checkpointing = True

    gradient_checkpointing_enable = activation_checkpointing_enable

    # [Note: clipping through Trainer]
    # Trainer clips with ``accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)`` and
    # logs the norm it returns, reading each parameter's ``.grad``; the chunks' gradients are
    # not there (an offloaded chunk's went to the host). The engine clips itself (its
    # AdamWConfig.max_grad_norm is Trainer's), so while a step's backwards are done and its
    # update is not, ``parameters()`` yields one tensor whose gradient is the engine's global
    # norm: clip_grad_norm_ returns that norm, and scaling it scales nothing of the model.
    # Under a plan that overlaps CPU steps with backward no global norm exists: NaN.

    def parameters(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        if self.forwards and _trainer_syncs():  # the clipping moment of a short last step
            self.complete_step()
        if self.forwards < self.engine.plan.training.grad_accum:
            if not self.is_distributed_loading_by_transformers:  # [Note: several processes]
                yield from super().parameters(recurse)
            return
        if self.engine.plan.schedule.cpu_adam == "after_backward":
            norm = self.engine.grad_norm().detach().float().reshape(1)
        else:
            norm = torch.full((1,), math.nan, device=self.engine.device)
        self.norm_proxy.grad = norm.clone()
        yield self.norm_proxy

    # [Note: short last step]
    # Trainer's last step of an epoch takes what is left of the epoch's micro-batches, which
    # may be fewer than gradient_accumulation_steps, with num_items_in_batch counted over
    # them; the plan runs exactly grad_accum forwards and backwards per step. The step is
    # completed with empty micro-batches: every label -100, so each token loss is 0 and the
    # loss, divided by 1 (not 0, whose 0/0 would put NaN into every gradient), adds an
    # exact zero to every gradient. The update is then Trainer's shorter step's. The CPU
    # RNG is restored after them, so a model with dropout draws the same later masks as
    # the run without protrain. Done where the step ends: at the clipping moment, which
    # accelerate's GradientState marks (Trainer sets sync_gradients before each micro-batch:
    # true for the last of a step), or at optimizer.step() when nothing clips.

    @torch.enable_grad()
    def complete_step(self) -> None:
        """Run the step's missing micro-batches as empty ones ([Note: short last step])."""
        t = self.engine.plan.training
        empty = torch.zeros((t.micro_batch, t.seq_len), dtype=torch.long)
        dev = self.engine.device
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            while 0 < self.forwards < t.grad_accum:
                out = self._forward(empty, labels=empty - 100, num_items_in_batch=1)
                out.loss.backward()

    # [Note: several processes]
    # Under torchrun, accelerate wraps a model in DistributedDataParallel (gloo on CPU), which
    # would average every parameter's gradient after each backward, on top of the plan's
    # ZeRO-3 reductions (executor/dist.py), and reads each parameter's storage at wrap (an
    # offloaded chunk's is released). Trainer skips the wrap for a model that owns its
    # placement and gradient reduction, ``is_distributed_loading_by_transformers``; it then
    # broadcasts, and averages the gradients of, the trainable parameters ``parameters()``
    # yields (``_sync_replicated_trainable_parameters``), so under several processes they are
    # not yielded (nor counted in Trainer's log), except the clipping moment's norm. The loss
    # arithmetic is DDP's: Trainer divides by the global ``num_items_in_batch`` (summed over
    # the ranks, ``average_tokens_across_devices``) and multiplies the loss by the world size,
    # and the plan's reductions average the ranks' gradients, so each token's gradient
    # weighs 1/N of the global batch, as in one process with the ranks' rows.

    @property
    def is_distributed_loading_by_transformers(self) -> bool:
        return self.engine.comm.world > 1

    # -- after training: generate and save

    def generate(self, *args, **kwargs):
        """The inner model's ``generate``, KV cache and all: its forwards run under the plan
        (no_grad: executor/access.py [Note: the model between steps])."""
        return self.hf.generate(*args, **kwargs)

    def save_pretrained(self, save_directory, state_dict=None, **kwargs) -> None:
        """The inner model's ``save_pretrained`` (config, generation config, safetensors; a LoRA
        run: the adapter directory), its weights the engine's trained values by the inner
        model's names (``engine.state_dict()["model"]``, through the access layer's
        ``state_dict``), never a released chunk's storage. ``state_dict``: Trainer's, passed on."""
        if state_dict is None:  # (copies: tied aliases would share storage, safetensors refuses)
            state_dict = {k: v.clone() for k, v in self.hf.state_dict().items()}
        self.hf.save_pretrained(save_directory, state_dict=state_dict, **kwargs)

    # -- Trainer's checkpoints: [Note: Trainer checkpoints]

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """The weights in the model's own names (fp32 masters), as Trainer writes them to
        model.safetensors; LoRA runs: the trainable parameters only."""
        frozen = any(not p.requires_grad for p in self.planned.parameters())
        model = self.engine.state_dict(trainable_only=frozen)["model"]
        return {k: v.clone() for k, v in model.items()}  # tied aliases: safetensors wants copies

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        self.engine.load_state_dict({"model": dict(state_dict)})
        return nn.modules.module._IncompatibleKeys([], [])


# [Note: Trainer checkpoints]
# Trainer saves ``model.state_dict()`` (model.safetensors) and ``optimizer.state_dict()``
# (optimizer.pt), and restores both with their ``load_state_dict``, plus its scheduler, RNG
# and data position. We round-trip through those files: PlannedModel's state dict is the
# engine's fp32 masters by name, PlanOptimizer's holds the engine's whole state dict (masters
# and AdamW moments by name, per-parameter step counts), the engine's step count and the
# param groups (the rate Trainer's scheduler set). The masters are in both: the optimizer
# file alone restores the engine exactly, as mixed-precision optimizers keep their own fp32
# weights, while model.safetensors is what transformers tools read. Names, not the chunk
# layout, so a checkpoint resumes under another plan of the model (Engine.load_state_dict).


class PlanOptimizer(torch.optim.Optimizer):
    """The optimizer Trainer steps: ``step()`` ends the engine's step ([Note: split phases]) at
    the rate of ``param_groups[0]["lr"]``, read at the step's first forward, before any chunk
    can step; ``zero_grad()`` does nothing (the chunks' gradients start afresh each step)."""

    def __init__(self, model: PlannedModel, config):
        params = [p for p in model.planned.parameters() if p.requires_grad]
        defaults = dict(
            lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
        )
        super().__init__(params, defaults)
        self.model, self.engine = model, model.engine
        self.engine.follow_rate(lambda: float(self.param_groups[0]["lr"]))

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ConfigError(
                "PlanOptimizer.step(closure): the planned step runs each micro-batch's forward "
                "and backward once",
                "call loss.backward() yourself, then optimizer.step()",
            )
        rate = float(self.param_groups[0]["lr"])
        if self.model.forwards and rate != self.engine.lr:
            raise ConfigError(
                f"the learning rate changed from {self.engine.lr} to {rate} after this step's "
                "first forward; the plan's CPU AdamW steps may have used the first already",
                "set param_groups[0]['lr'] before the step's first forward (a scheduler's "
                "step() after optimizer.step(), as Trainer does)",
            )
        self.model.complete_step()  # [Note: short last step]
        self.model.forwards = 0
        self.engine.finish_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: see the class docstring."""

    def state_dict(self) -> dict:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {
            "state": {},
            "param_groups": [{**g, "params": []} for g in groups],
            "protrain": {**self.engine.state_dict(), "steps_done": self.engine.steps_done},
        }

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["protrain"]
        self.engine.load_state_dict(saved, steps_done=saved["steps_done"])
        for group, kept in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in kept.items() if k != "params"})
