"""``protrain train``: replay a plan on a model for N steps, with a progress bar or log lines.

On a terminal a bar shows loss, tokens per second and the step's peak device memory
against the plan's predicted peak, so a user sees at once whether the plan holds.
When stdout is not a terminal (nohup, slurm, torchrun's log files), or with
``log_every``, the same figures go out as plain ``step N  loss …`` lines instead, and
``metrics_path`` appends one JSON object per step for scripts. With
``eval_every`` K, every K steps a held-out loss is printed: ``Engine.evaluate`` (an
eval-mode, no-grad forward) averaged over ``data.HELDOUT_BATCHES`` fixed windows of
the corpus's tail, which the training loop never draws from (``data.split_heldout``).

Everything that could fail at the end of a long run (an output path, the checkpoint
root, the export directory) and everything that could fail expensively (a model too
big for the host, a binary data file) is checked before the first step
(``planner/commands/preflight.py``). A Hugging Face model trains on its own tokenizer and can
be exported back to a directory transformers loads (``export_dir``, ``hf.export``).
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from protrain import plans
from protrain.executor import AdamWConfig, wrap
from protrain.executor.check import check
from protrain.plans.errors import ConfigError

from ..hardware.units import human_bytes
from ..models.data import batches, heldout_batches, load_tokens, split_heldout, vocab_check
from ..models.epochs import RowOrder
from ..models.zoo import check_name, is_hf_name
from . import exports, sft_feed
from .progress import Metrics, ProgressBar
from .stopping import StopFlag

LOG_EVERY = 10
DEFAULT_STEPS = 100
"""Optimizer steps of a run given neither ``steps`` nor epochs (the CLI's ``--steps`` default)."""
"""Steps between plain log lines when stdout is not a terminal and no --log-every is given."""


class Losses(list):
    """The per-step losses of a run; ``interrupted`` says whether Ctrl-C ended it early."""

    interrupted: bool = False


def _init_distributed(timeout_s: float) -> tuple[int, int, str | None]:
    """Under torchrun (WORLD_SIZE > 1): join the process group; return (rank, world, device).

    NCCL on GPUs (one per local rank), gloo on CPU. The timeout bounds every
    collective, so a dead rank ends the others with an error instead of a hang.
    """
    import datetime

    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, None
    cuda = torch.cuda.is_available()
    device = None
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
    return dist.get_rank(), world, device


def train(
    plan_path: str,
    model_name: str,
    *,
    steps: int | None = None,
    data_path: str | None = None,
    seed: int = 0,
    lr: float | None = None,
    device: str | None = None,
    timeout_s: float = 300.0,
    trace_path: str | None = None,
    echo: Callable[[str], None] = print,
    progress: bool | None = True,
    save_every: int | None = None,
    save_dir: str | None = None,
    resume: str | None = None,
    eval_every: int | None = None,
    max_grad_norm: float | None = None,
    keep: int = 2,
    tokenizer: str | None = None,
    text_field: str = "text",
    log_every: int | None = None,
    metrics_path: str | None = None,
    export_dir: str | None = None,
    nvme_dir: str | None = None,
    lora=None,
    export_merged: str | None = None,
    weight_decay: float = 0.01,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    overwrite: bool = False,
    base_name: str | None = None,
    lr_schedule: str | None = None,
    warmup_steps: int | None = None,
    warmup_ratio: float | None = None,
    min_lr_rate: float | None = None,
    sft: sft_feed.SFTFlags | None = None,
) -> Losses:
    """Train ``steps`` optimizer steps in all (a resumed run counts the steps already done;
    default ``DEFAULT_STEPS``), or ``sft.epochs`` passes over fine-tuning rows.

    ``sft``: the fine-tuning flags (packing, loss mask, chat template, epochs, held-out rows;
    ``sft_feed.SFTFlags``). Chat and instruction data, or any data with one of those flags,
    trains as packed rows (``sft_feed.wants_rows``), raw text as a stream of random windows.

    ``eval_every`` K: hold the corpus's tail out of training and print its loss every
    K steps. ``max_grad_norm``: clip gradients to this global norm (the plan must have
    been made for it, ``protrain plan --max-grad-norm``: the executor refuses otherwise).

    ``save_dir``: checkpoint there at the end and on Ctrl-C, and every ``save_every``
    K steps; the newest ``keep`` checkpoints stay. ``resume``: a checkpoint root (or
    step directory) to continue from, under this plan (the plan may differ from the one
    the checkpoint was written under). A root belongs to one run: a run that does not
    resume refuses a ``save_dir`` holding checkpoints, unless ``overwrite`` (a new run: the
    old checkpoints are deleted once this run has saved its first, ``checks.other_run``).
    Every output's room (and ``ulimit -f``) is checked before the first step
    (``preflight.output_room``); a save that still fails for want of room goes to
    ``exports.rescue_dirs`` and the error names it. Ctrl-C (or SIGTERM, SIGHUP) stops after the
    current step and, when checkpointing, saves first (the result's ``interrupted`` is then True); a
    second Ctrl-C interrupts at once — the last complete checkpoint stays intact
    (executor/checkpoint.py [Note: atomicity]).

    ``tokenizer``: a tokenizer directory, or ``"bytes"``; by default a Hugging Face
    model's directory's own tokenizer when it has one, else byte-level tokens.
    ``progress``: True or None (the CLI's) draws a bar when stdout is a terminal (and no
    ``log_every``), False never; otherwise plain lines every ``log_every`` (default 10) steps.
    ``export_dir``: write the trained Hugging Face model there (``hf.export``); with ``lora``
    (a ``lora.LoraSpec``: peft's adapters injected, the base frozen) the adapter in peft's
    format, and ``export_merged`` the base with the adapter merged in (planner/models/lora.py);
    ``base_name``: the base as the user named it (the CLI's ``--hf-config`` as typed; default
    ``model_name``), which the adapter's ``adapter_config.json`` names (``lora.base_name``).
    ``lr``, ``weight_decay``, ``betas``, ``eps``: AdamW's (one group, every parameter; the
    defaults are ``AdamWConfig``'s but for the rate), printed in the run's header.
    ``lr_schedule`` (a name of ``lr_schedule.SCHEDULES``), ``warmup_steps`` or ``warmup_ratio``,
    ``min_lr_rate``: how the rate moves from step to step, ``lr`` its peak, over the ``steps``
    of the run (``lr_schedule.resolve``; None: left out, so on ``resume`` the checkpoint's).
    """
    if save_every is not None and save_dir is None:
        raise ConfigError("--save-every needs a directory to save to", "add --save-dir DIR")
    sft = sft or sft_feed.SFTFlags()
    sft_feed.check_flags(sft, steps_given=steps is not None, eval_every=eval_every)
    if steps is None and sft.epochs is None:
        steps = DEFAULT_STEPS
    from .lr_schedule import DEFAULT_LR, Flags, resolve

    lr_flags = Flags(lr_schedule, lr, warmup_steps, warmup_ratio, min_lr_rate)
    if resume is None:  # refused before anything is built; a resume's needs its checkpoint's
        if steps is not None:  # (epochs: the total is known once the rows are)
            resolve(lr_flags, steps)
    else:
        lr_flags.check()
    from .preflight import output_dir, output_file

    output_file(trace_path, "--trace")
    output_file(metrics_path, "--metrics")
    output_dir(save_dir, "--save-dir")
    if overwrite and (save_dir is None or resume is not None):
        raise ConfigError(
            "--overwrite starts a new run in a --save-dir that holds another run's checkpoints"
            + ("; with --resume this run continues one" if save_dir is not None else ""),
            "drop --overwrite"
            if save_dir is not None
            else "add --save-dir DIR, or drop --overwrite",
        )
    previous: list[str] = []  # another run's checkpoints in save_dir, replaced (--overwrite)
    if save_dir is not None:
        from .checks import check_root, other_run

        check_root(save_dir)  # a directory of other files is not a checkpoint root
        if resume is None:
            # A live run in the directory is named by its lock (pid), before its checkpoints.
            if os.environ.get("RANK", "0") == "0" and Path(save_dir).is_dir():
                from protrain.executor.checkpoint import lock_root

                lock_root(save_dir).release()
            previous = other_run(save_dir, overwrite)
    if export_merged is not None and (lora is None or not is_hf_name(model_name)):
        raise ConfigError(
            "--export-merged writes a Hugging Face model with its LoRA adapter merged in",
            "train with --lora and --hf-config DIR, or drop --export-merged",
        )
    if export_merged is not None:
        output_dir(export_merged, "--export-merged", create=False, must_be_empty=True)
    if export_dir is not None and lora is not None:
        output_dir(export_dir, "--export", create=False, must_be_empty=True)
    elif export_dir is not None:
        if not is_hf_name(model_name):
            raise ConfigError(
                f"--export writes a Hugging Face model directory, and {model_name} is a zoo model",
                "train a Hugging Face model (--hf-config DIR) to export it, or drop --export",
            )
        output_dir(export_dir, "--export", create=False, must_be_empty=True)
        if save_dir is None:
            from .checks import check_root

            check_root(exports.export_keeper(export_dir), "the checkpoint kept until the export")
    plan = plans.load(plan_path)
    if plan.placement.nvme and nvme_dir is None:  # before the model is built, not after
        raise ConfigError(
            f"{plan_path} keeps the optimizer states of chunks {plan.placement.nvme} on disk "
            "(placement.nvme)",
            "pass --nvme DIR: a directory on a fast local disk",
        )
    if nvme_dir is not None:
        output_dir(nvme_dir, "--nvme")
    from .preflight import output_room

    output_room(
        plan,
        save_dir=save_dir,
        keep=keep,
        saves=1 + (steps // save_every if save_every and steps else 0) + (keep if not steps else 0),
        export_dir=export_dir,
        export_merged=export_merged,
        keeper=exports.export_keeper(export_dir)
        if export_dir is not None and save_dir is None and lora is None
        else None,
        lora=lora is not None,
        tokenizer_dir=_tokenizer_dir(model_name, tokenizer),
    )
    rank, world, rank_device = _init_distributed(timeout_s)
    lock = None
    try:
        if (
            save_dir is not None and rank == 0
        ):  # one run per root (checkpoint.py [Note: one run per root])
            from protrain.executor.checkpoint import lock_root

            lock = lock_root(save_dir)
        bar = progress is not False and log_every is None and sys.stdout.isatty()
        return _train(
            plan,
            plan_path,
            model_name,
            steps=steps,
            data_path=data_path,
            seed=seed,
            lr=lr,
            lr_flags=lr_flags,
            device=device or rank_device,
            rank=rank,
            world=world,
            trace_path=trace_path if rank == 0 else None,
            echo=echo if rank == 0 else (lambda _: None),
            progress=bar and rank == 0,
            save_every=save_every,
            save_dir=save_dir,
            resume=resume,
            eval_every=eval_every,
            max_grad_norm=max_grad_norm,
            keep=keep,
            tokenizer=tokenizer,
            text_field=text_field,
            log_every=log_every or LOG_EVERY,
            metrics_path=metrics_path if rank == 0 else None,
            export_dir=export_dir,
            nvme_dir=nvme_dir,
            lora=lora,
            export_merged=export_merged,
            base_name=base_name,
            sft=sft,
            previous=previous if rank == 0 else [],
            adamw=AdamWConfig(
                lr=DEFAULT_LR if lr is None else lr,  # (the schedule sets each step's)
                weight_decay=weight_decay,
                betas=tuple(betas),
                eps=eps,
                max_grad_norm=max_grad_norm,
            ),
        )
    finally:
        if lock is not None:
            lock.release()
        if world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _tokenizer_dir(model_name: str, tokenizer: str | None) -> str | None:
    """The tokenizer directory to use (None: byte-level); see ``train``'s docstring."""
    if tokenizer == "bytes":
        return None
    if tokenizer is not None:
        return tokenizer
    if is_hf_name(model_name):
        directory = _model_dir(model_name)
        if (directory / "tokenizer.json").is_file() or (
            directory / "tokenizer_config.json"
        ).is_file():
            return str(directory)
    return None


def _model_dir(model_name: str) -> Path:
    """The directory of a Hugging Face model name's config.json."""
    from ..models.hf import parse_hf_name

    path = Path(parse_hf_name(model_name)[0])
    return path if path.is_dir() else path.parent


def _train(
    plan,
    plan_path,
    model_name,
    *,
    steps,
    data_path,
    seed,
    lr,
    device,
    rank,
    world,
    echo,
    progress,
    trace_path=None,
    save_every=None,
    save_dir=None,
    resume=None,
    eval_every=None,
    max_grad_norm=None,
    keep=2,
    tokenizer=None,
    text_field="text",
    log_every=LOG_EVERY,
    metrics_path=None,
    export_dir=None,
    nvme_dir=None,
    lora=None,
    export_merged=None,
    base_name=None,
    sft=None,
    previous=(),
    adamw: AdamWConfig | None = None,
    lr_flags=None,
) -> Losses:
    from .lr_schedule import DEFAULT_LR, Flags

    check_name(model_name)
    lr_flags = lr_flags or Flags(lr=lr)  # (the schedule's flags; lr alone: a constant rate)
    adamw = adamw or AdamWConfig(lr=DEFAULT_LR if lr is None else lr, max_grad_norm=max_grad_norm)
    dev = device or default_device()
    prechecks(plan, model_name, device=dev, where=plan_path)
    from .preflight import other_machine

    note = other_machine(plan, dev)
    if note is not None:
        echo(note)
    tok_dir = _tokenizer_dir(model_name, tokenizer)
    sft = sft or sft_feed.SFTFlags()
    rows = None  # fine-tuning rows (sft_feed's module docstring), else a token stream
    if sft_feed.wants_rows(data_path, sft):
        rows, heldout_rows = sft_feed.load_rows(
            data_path, sft, tok_dir, text_field, plan.training.seq_len, echo
        )
    else:
        source = load_tokens(
            data_path, tokenizer=tok_dir, text_field=text_field
        )  # a bad file fails before the build
        echo(
            f"data     {source.name}: {source.tokens.numel():,} tokens, "
            + (f"tokenizer {tok_dir} (vocab {source.vocab_size})" if tok_dir else "byte-level")
        )
    if rows is None and tok_dir is None and tokenizer is None and is_hf_name(model_name):
        echo(
            f"note: {_model_dir(model_name)} holds no tokenizer (tokenizer.json or "
            "tokenizer_config.json), so this run trains byte-level: each byte of the UTF-8 text "
            "is one token, ids 0-255 of the model's embedding, whatever its own tokenizer would "
            "mean by them; the trained model then reads bytes, not that tokenizer's ids. Give "
            "--tokenizer DIR to train on its tokenizer, or --tokenizer bytes to choose bytes (and "
            "silence this note)"
        )
    from ..models.lora import build_model, check_plan

    check_plan(plan, lora, plan_path)
    model = build_model(model_name, lora, device="cpu", seed=seed)
    loaded = getattr(model, "weights_loaded_from", None)
    echo(
        f"model    {model_name}: "
        + (
            f"weights from {', '.join(map(str, loaded))}"
            if loaded
            else f"random init (seed {seed})"
        )
        + (f"; then the checkpoint's ({resume})" if resume else "")
        + _trainable(model)
    )
    echo(
        (
            "optim    AdamW"
            # (a resume without --lr: the checkpoint's peak, in the `lr` line once it is read)
            + ("" if resume and lr is None else f" lr {adamw.lr:g},")
            + f" betas ({adamw.betas[0]:g}, {adamw.betas[1]:g}), eps "
            f"{adamw.eps:g}, weight decay {adamw.weight_decay:g} on every parameter"
        )
        + (
            f", gradients clipped to norm {adamw.max_grad_norm:g}"
            if adamw.max_grad_norm is not None
            else ""
        )
    )
    check(plan, model, where=plan_path, name=model_name)
    t = plan.training
    heldout = None
    if rows is not None:
        sft_feed.check_vocab(rows, output_vocab(model), tok_dir)
        train_rows, split_rows = sft_feed.split(rows, sft, seed)
        order = RowOrder(train_rows.size, seed, t.micro_batch, t.grad_accum, world, rank)
        source = sft_feed.RowFeed(rows, train_rows, order, t.seq_len)
        n_sup, share = sft_feed.summary(source)
        if sft.epochs is not None:
            steps = sft.epochs * order.steps_per_epoch
        echo(
            f"rows     {train_rows.size:,} train ({order.steps_per_epoch:,} steps an epoch of "
            f"{order.rows_per_draw * t.grad_accum} rows); {n_sup:,} supervised targets, "
            f"{share:.1%} of their positions"
            + (f"; {sft.epochs} epochs = {steps:,} steps" if sft.epochs is not None else "")
        )
        if eval_every is not None:
            if heldout_rows is None:  # a share of --data: its counts are the feed's
                held_from, counts, held = rows, source.counts, split_rows
            else:
                held_from, counts = heldout_rows, heldout_rows.supervised_counts()
                held = np.arange(heldout_rows.n_rows)
            heldout = sft_feed.heldout_batches(
                held_from, counts, held, t.micro_batch, t.seq_len, world, rank
            )
            if not heldout:
                raise ConfigError(
                    "the held-out rows hold no supervised target", "hold out other data"
                )
            echo(f"held out {held.size:,} rows for --eval-every {eval_every}")
    else:
        vocab_check(source, output_vocab(model))
        if eval_every is not None:
            source, tail = split_heldout(source, t.seq_len)
            heldout = heldout_batches(tail, t.micro_batch, t.seq_len, rank=rank, world_size=world)
    engine = wrap(model, plan, adamw, device=dev, nvme_dir=nvme_dir)
    try:
        # wrap checked the plans agree; the data order and the loop's collectives depend on these
        # too
        engine.comm.agree(
            {
                "--seed (the data order)": seed,
                "--steps": steps,
                "the learning-rate flags": repr(lr_flags),
                "--eval-every": eval_every,
                "--save-every": save_every,
                "the corpus's token count": source.rows.fingerprint
                if rows is not None
                else source.tokens.numel(),
                # every rank writes into these (its RNG file, its part of a save): one place for all
                **{
                    flag: None if path is None else os.path.abspath(path)
                    for flag, path in (
                        ("--save-dir", save_dir),
                        ("--resume", resume),
                        ("--export", export_dir),
                        ("--export-merged", export_merged),
                    )
                },
                "--keep": keep,
            },
            engine.device,
        )
        losses = _loop(
            engine,
            plan,
            t,
            source,
            seed=seed,
            steps=steps,
            rank=rank,
            world=world,
            echo=echo,
            progress=progress,
            trace_path=trace_path,
            save_every=save_every,
            save_dir=save_dir,
            resume=resume,
            eval_every=eval_every,
            heldout=heldout,
            keep=keep,
            log_every=log_every,
            metrics_path=metrics_path,
            previous=previous,
            lr_flags=lr_flags,
        )
        if lora is not None and (export_dir or export_merged):
            if losses.interrupted:
                echo("not exported: the run was interrupted")
            else:
                exports.export_lora(
                    engine,
                    model,
                    model_name,
                    lora,
                    export_dir,
                    export_merged,
                    tok_dir,
                    rank,
                    echo,
                    base_name=base_name,
                    chat_template=sft.chat_template,
                )
        elif export_dir is not None:
            if losses.interrupted:
                echo(f"not exported to {export_dir}: the run was interrupted")
            else:
                exports.export_model(
                    engine,
                    model,
                    model_name,
                    export_dir,
                    save_dir,
                    tok_dir,
                    rank,
                    echo,
                    chat_template=sft.chat_template,
                )
        return losses
    finally:
        engine.close()


def output_vocab(model) -> int:
    """Rows of the model's output head: the zoo's ``lm_head``, or whatever a transformers family
    calls its head (``get_output_embeddings``: BioGPT's is ``output_projection``)."""
    hf = getattr(model, "hf", None)
    head = hf.get_output_embeddings() if hf is not None else getattr(model, "lm_head", None)
    if head is not None and getattr(head, "weight", None) is not None:
        return head.weight.shape[0]
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.vocab_size)


def default_device() -> str:
    """The device ``train`` runs on without ``--device`` (or torchrun's local rank)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def prechecks(plan, model_name: str, *, device: str | torch.device, where: str = "the plan") -> int:
    """What ``train`` checks of a plan before building the model: its bounds (``validate``,
    plans/bounds.py: a plan made in memory has not been loaded) and whether this machine
    holds what it needs on the host (``preflight.plan_fits_host``). Allocates nothing;
    returns the host bytes it counted. ``protrain validate --model`` runs it too, so what
    validate passes, train does not refuse before its build."""
    from protrain.plans.validation import validate

    from .preflight import plan_fits_host

    validate(plan, where)
    return plan_fits_host(plan, model_name, device=torch.device(device).type, where=where)


def heldout_loss(engine, heldout: list) -> float:
    """Mean of ``engine.evaluate`` over the held-out micro-batches (every rank must call it);
    for fine-tuning rows, the held-out rows' loss over their supervised targets."""
    if heldout and isinstance(heldout[0][1], int):  # (micro-batch, count): sft_feed's
        return sft_feed.heldout_loss(engine, heldout)
    return sum(engine.evaluate(b) for b in heldout) / len(heldout)


def _loop(
    engine,
    plan,
    t,
    source,
    *,
    seed,
    steps,
    rank,
    world,
    echo,
    progress,
    trace_path,
    save_every,
    save_dir,
    resume,
    eval_every=None,
    heldout=None,
    keep=2,
    log_every=LOG_EVERY,
    metrics_path=None,
    previous=(),
    lr_flags=None,
) -> Losses:
    """Train from ``engine.steps_done`` (after ``resume``) to ``steps``, the run's total optimizer
    steps: the learning-rate schedule (``lr_flags``, resolved here, after the checkpoint's
    settings are known) spans them, so a caller that counts steps from the data passes its
    total here."""
    from .lr_schedule import SCHEDULES, Flags, resolve

    previous = list(previous)  # (the checkpoint closure's: cleared after the first save)
    feed = source if isinstance(source, sft_feed.RowFeed) else None  # fine-tuning rows
    # Every rank draws the same global batch and keeps its slice of it.
    if feed is None:
        data = batches(source, t.micro_batch, t.seq_len, seed, rank=rank, world_size=world)
    drawn = 0  # micro-batch draws of the data stream so far (each draws the global micro-batch)
    # Where the held-out tail starts (tokens; 0: nothing held out): saved with the data
    # position, because the training windows depend on it. (Rows: their fingerprint instead.)
    heldout_split = 0 if heldout is None or feed is not None else source.tokens.numel()
    max_grad_accum = t.grad_accum  # the most micro-batches a step of this run's history drew
    m = engine.load(resume) if resume is not None else None
    # (a checkpoint written before schedules were saved has none: the flags alone then)
    schedule = resolve(lr_flags or Flags(), steps, m and m.lr_schedule, where=str(resume))
    if m is not None:
        saved_peak = m.lr_schedule.get("peak_lr", schedule.peak_lr)
        if saved_peak != schedule.peak_lr:
            echo(
                f"note: the peak learning rate changes from the checkpoint's {saved_peak:g} to "
                f"--lr {schedule.peak_lr:g} from step {m.step + 1} on"
            )
        max_grad_accum = max(t.grad_accum, m.data.get("max_grad_accum", t.grad_accum))
        if feed is None:
            drawn = _skip_to(data, m.data, t, world, echo, steps_done=m.step, where=resume)
        else:
            drawn = _rows_position(m.data, feed, t, world, steps_done=m.step, where=resume)
        if m.data.get("heldout_split", 0) != heldout_split:
            echo(
                "note: the checkpoint was trained with another held-out split (--eval-every on one "
                "run and not the other): from here the training windows differ from the first run's"
            )
        echo(f"resumed from {resume} at step {engine.steps_done}")
        if engine.steps_done >= steps:
            echo(
                f"nothing to train: the checkpoint is at step {engine.steps_done} and --steps "
                f"{steps} counts the total; "
                + (
                    f"its {schedule.name} schedule ends there (a longer run is a new run)"
                    if SCHEDULES[schedule.name].decays
                    else f"give --steps {engine.steps_done + steps} to train {steps} more"
                )
            )
    echo(f"lr       {schedule.describe()}")
    varies = schedule.name != "constant" or schedule.warmup_steps > 0  # (the rate in each line)
    predicted = plan.prediction.peak_memory_bytes
    tokens_per_step = t.micro_batch * t.seq_len * t.grad_accum * world
    losses = Losses()
    metrics = Metrics(metrics_path, echo) if metrics_path else None
    if metrics is not None and resume is not None:  # the steps that follow may repeat logged ones
        metrics.write({"event": "resume", "step": engine.steps_done, "resumed_from": str(resume)})
    bar = None
    if progress:
        bar = ProgressBar(steps, engine.steps_done)
        bar.start()
    t0 = time.perf_counter()
    recorder = None
    if trace_path:
        from ..views.trace import record_trace

        recorder = record_trace(engine)
        rec = recorder.__enter__()
    stop = StopFlag()

    def checkpoint() -> None:
        from protrain.plans.errors import CheckpointError

        from ..models.hf_checkpoint import write_hint

        data = {
            "draws": drawn,
            "global_micro_batch": t.micro_batch * world,
            "heldout_split": heldout_split,
            **({} if feed is None else {"rows": _rows_id(feed.rows)}),
            "max_grad_accum": max_grad_accum,
        }
        try:
            path = engine.save(save_dir, data=data, keep=keep, lr_schedule=schedule.saved())
        except CheckpointError as e:  # the disk filled up (or went away) during the run
            cause = exports.failed_write(e)
            if cause is None:  # (refused, not failed: a non-finite state)
                raise
            saved = exports.rescue(engine, data, e, echo, schedule.saved())
            again = "train again (fewer kept checkpoints, --keep 1, need less)"
            raise CheckpointError(
                e.message
                if saved is None
                else f"{e.message}; the trained state of step {engine.steps_done} was saved to "
                f"{saved} instead",
                write_hint(cause, save_dir, again)
                if saved is None
                else write_hint(
                    cause, save_dir, f"resume from it: `protrain train … --resume {saved}`"
                ),
            ) from cause
        echo(f"saved {path}")
        if previous:  # --overwrite: the old run's checkpoints go once this run has one
            import shutil

            for name in previous:
                if name != path.name:
                    target = Path(save_dir) / name
                    if target.is_dir():
                        shutil.rmtree(target, ignore_errors=True)
            previous.clear()

    first = engine.steps_done
    if eval_every is not None:  # where training starts from, for the curve's first point
        echo(f"step {first:5d}  held-out loss {heldout_loss(engine, heldout):.4f}")
    try:
        with stop.installed():
            for step in range(first, steps):
                engine.set_lr(schedule.rate(engine.steps_done + 1))
                # drawn one at a time as the engine needs them: one micro-batch in memory, not
                # grad_accum
                if feed is None:
                    result = engine.step(itertools.islice(data, t.grad_accum))
                else:  # the step's supervised targets on this rank, counted from the rows
                    micro_batches, num_items = feed.step(drawn)
                    result = engine.step(micro_batches, num_items=num_items)
                drawn += t.grad_accum
                losses.append(result.loss)
                stopping = _agree(stop.requested, engine)  # every rank stops after the same step
                done = engine.steps_done
                save = save_dir is not None and (
                    (save_every is not None and done % save_every == 0) or done == steps or stopping
                )
                if stopping:
                    if save:
                        checkpoint()
                    losses.interrupted = True
                    echo(
                        f"interrupted after step {done}"
                        + (f"; resume with --resume {save_dir}" if save_dir is not None else "")
                    )
                    break
                tps = tokens_per_step / max(result.timings_s["total"], 1e-9)
                record = {
                    "step": done,
                    "loss": result.loss,
                    "lr": engine.lr,  # the rate this step used
                    "tokens_per_s": round(tps, 1),
                    "peak_bytes": result.peak_bytes,
                    "time_s": round(time.perf_counter() - t0, 3),
                }
                if feed is not None:  # what trains: the targets the loss counts
                    n = feed.global_supervised(drawn - t.grad_accum)
                    record["supervised_tokens"] = n
                    record["supervised_tokens_per_s"] = round(
                        n / max(result.timings_s["total"], 1e-9), 1
                    )
                if eval_every is not None and done % eval_every == 0:
                    record["heldout_loss"] = heldout_loss(engine, heldout)
                    echo(f"step {done:5d}  held-out loss {record['heldout_loss']:.4f}")
                if metrics is not None:
                    metrics.write(record)
                status = (
                    (
                        f"loss {result.loss:.4f}  {tps:,.0f} tok/s  peak "
                        f"{human_bytes(result.peak_bytes)}"
                    )
                    + (f" / predicted {human_bytes(predicted)}" if predicted else "")
                    + (f"  lr {engine.lr:.3g}" if varies else "")
                )
                if bar is not None:
                    bar.advance(status)
                elif done % log_every == 0 or done == steps or step == first:
                    echo(f"step {done:5d}  {status}")
                if save:  # after the step's line: "saved" says the step just shown is safe
                    checkpoint()
    finally:
        if metrics is not None:
            metrics.close()
        if bar is not None:
            bar.stop()
        if recorder is not None:
            recorder.__exit__(None, None, None)
            try:
                rec.save(trace_path)
                echo(f"wrote {trace_path} (open in ui.perfetto.dev or chrome://tracing)")
            except OSError as e:  # a trace is not worth the run: the checkpoint is already saved
                echo(f"warning: --trace {trace_path}: not written ({e.strerror or e})")
    if losses:
        echo(
            f"trained {len(losses)} step{'' if len(losses) == 1 else 's'} in "
            f"{time.perf_counter() - t0:.1f} s: loss {losses[0]:.3f} → {losses[-1]:.3f}"
        )
    return losses


MAX_GLOBAL_MICRO_BATCH = 1 << 24
"""Sequences per draw a checkpoint's data position may claim (a sanity bound, not a limit of
any real run)."""


def _skip_to(
    data,
    position: dict[str, int],
    t,
    world: int,
    echo,
    *,
    steps_done: int = 0,
    where: str = "the checkpoint",
) -> int:
    """Advance the data stream to where the checkpoint left it; returns the draws skipped.

    A draw is one global micro-batch (``micro_batch × world`` sequences). Under a plan
    with another global micro-batch the position is converted by sequences, rounded
    down; the order of the data then differs from the uninterrupted run's. A position
    no run of ``steps_done`` steps could have reached is refused (skipping it would take
    forever): ``_check_position``.
    """
    draws = position.get("draws", 0)
    saved_global = position.get("global_micro_batch", t.micro_batch * world)
    _check_position(
        draws, saved_global, steps_done * position.get("max_grad_accum", t.grad_accum), where
    )
    if saved_global != t.micro_batch * world:
        draws = draws * saved_global // (t.micro_batch * world)
        echo(
            f"note: the checkpoint's global micro-batch was {saved_global} sequences, this plan's "
            f"is {t.micro_batch * world}: resuming at the same number of sequences, not the same "
            "batches"
        )
    for _ in range(draws):
        next(data)
    return draws


def _rows_position(position: dict, feed, t, world: int, *, steps_done: int, where) -> int:
    """The checkpoint's draws, where the rows' order resumes ([Note: epochs]); refused when the
    checkpoint trained other rows or another global micro-batch (its order would not go on)."""
    draws = position.get("draws", 0)
    _check_position(
        draws,
        position.get("global_micro_batch", 1),
        steps_done * position.get("max_grad_accum", t.grad_accum),
        where,
    )
    saved = position.get("rows")
    if saved != _rows_id(feed.rows):
        raise ConfigError(
            f"{where} was trained on "
            + ("raw text" if saved is None else f"other rows (fingerprint {saved:015x}…)")
            + f", not on these ({feed.rows.fingerprint}): its epoch order does not go on here",
            "resume with the run's own --data, --seq plan, --packing, --loss-on, --chat-template "
            "and --eval-split (or start a new run from its weights)",
        )
    if position.get("global_micro_batch", t.micro_batch * world) != t.micro_batch * world:
        raise ConfigError(
            f"{where}: the checkpoint drew {position.get('global_micro_batch')} rows a "
            f"micro-batch, this plan and world draw {t.micro_batch * world}: the epoch order "
            "would not go on",
            "resume under a plan with the same micro_batch × ranks",
        )
    return draws


def _rows_id(rows) -> int:
    """The rows' fingerprint as a checkpoint's data position holds it (integers only): its
    first 60 bits."""
    return int(rows.fingerprint[:15], 16)


def _check_position(draws: int, saved_global: int, most: int, where: str) -> None:
    """``draws`` at most ``most`` (steps × micro-batches per step) and a plausible global
    micro-batch."""
    if not 0 <= draws <= most or not 1 <= saved_global <= MAX_GLOBAL_MICRO_BATCH:
        raise ConfigError(
            f"{where}: the manifest's data position (draws {draws}, global_micro_batch "
            f"{saved_global}) is not one this checkpoint's steps could reach (at most {most} "
            f"draws; 1 to {MAX_GLOBAL_MICRO_BATCH} sequences a draw): the manifest was edited or "
            "damaged",
            "resume from another checkpoint (`protrain train … --resume DIR/step-NNNNNNNN`), or "
            "restore its manifest.json",
        )


def _agree(requested: bool, engine) -> bool:
    """Whether any rank was asked to stop (one all-reduce per step on several ranks), so all
    ranks checkpoint and stop after the same step and their collectives stay matched."""
    if engine.comm.world == 1:
        return requested
    flag = torch.tensor([1.0 if requested else 0.0], device=engine.device)
    engine.comm.all_reduce(flag, "the stop flag")
    return bool(flag.item() > 0)


def _trainable(model) -> str:
    """The header's parameter count: how many train of how many (LoRA freezes the base)."""
    ps = list(model.parameters())
    n_all = sum(p.numel() for p in ps)
    n_train = sum(p.numel() for p in ps if p.requires_grad)
    if n_train == n_all:
        return f"; {n_all:,} parameters, all trained"
    return f"; {n_train:,} of {n_all:,} parameters train ({100 * n_train / max(n_all, 1):.2f}%)"
