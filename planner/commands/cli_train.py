"""The commands that train and write what training made: ``train``, ``tokenize`` (a corpus
into a token file) and ``export`` (a checkpoint into a Hugging Face model or a LoRA adapter).
Their bodies import the machinery (torch, the executor) only when they run; the click group
in ``cli.py`` registers them."""

from __future__ import annotations

import os
import sys

import click

from .cli_data import row_options
from .floats import FiniteFloatRange
from .lora_options import click_options as lora_options
from .lora_options import spec_from as lora_spec
from .lr_schedule import SCHEDULES
from .lr_schedule import help_text as lr_schedule_help
from .options import (
    BETA,
    EXIT_INTERRUPTED,
    LEARNING_RATE,
    SEED,
    hf_options,
    model_option,
)


@click.command()
@click.option(
    "--plan", "plan_path", required=True, type=click.Path(dir_okay=False), help="Plan file."
)
@click.option(
    "--model",
    "model_name",
    metavar="NAME",
    default=None,
    help="Zoo model (or hf:PATH) the plan is for.",
)
@hf_options
@click.option(
    "--data",
    "data_path",
    default=None,
    metavar="FILE",
    help="Text file, JSON lines (.jsonl, see --text-field) or a token file (`protrain tokenize`); "
    "default: the embedded Python docs. Tokens: the model's own tokenizer.json with "
    "--hf-config DIR, else bytes.",
)
@click.option(
    "--text-field",
    default="text",
    show_default=True,
    metavar="NAME",
    help="Field of each .jsonl line that holds the text.",
)
@click.option(
    "--tokenizer",
    "tokenizer",
    default=None,
    metavar="DIR|bytes",
    help="Tokenizer directory (tokenizer.json) or `bytes` for byte-level tokens "
    "[default: the --hf-config directory's tokenizer if it has one, else bytes].",
)
@click.option(
    "--steps",
    type=click.IntRange(1),
    default=None,
    help="Optimizer steps in all [default: 100, or --epochs].",
)
@click.option(
    "--epochs",
    type=click.IntRange(1),
    default=None,
    metavar="N",
    help="Fine-tuning rows: N passes over them (instead of --steps), each in its own seeded "
    "shuffle, each rank its own rows; the last step of an epoch takes what is left.",
)
@row_options(defaults=False)
@click.option(
    "--eval-split",
    type=FiniteFloatRange(min=0, max=1, min_open=True, max_open=True),
    default=None,
    metavar="R",
    help="Fine-tuning rows: hold out this share of --data's rows (chosen by --seed) for "
    "--eval-every; they never train.",
)
@click.option(
    "--eval-data",
    type=click.Path(exists=True),
    default=None,
    metavar="FILE",
    help="Fine-tuning rows: the held-out rows for --eval-every, from another file.",
)
@click.option(
    "--lr",
    type=LEARNING_RATE,
    default=None,
    help="AdamW's peak learning rate (positive and finite) [default: 3e-3; on --resume the "
    "checkpoint's; a --resume may give a new peak, e.g. after a divergence].",
)
@click.option(
    "--lr-schedule",
    type=click.Choice(list(SCHEDULES)),
    default=None,
    metavar="NAME",  # (the help lists them; a long metavar would narrow every option's help)
    help=lr_schedule_help(),
)
@click.option(
    "--warmup-steps",
    type=click.IntRange(0),
    default=None,
    metavar="N",
    help="Raise the rate linearly from 0 over the first N steps (step 1 runs at 0, as in "
    "transformers) [default: 0; on --resume the checkpoint's].",
)
@click.option(
    "--warmup-ratio",
    type=FiniteFloatRange(min=0, max=1),
    default=None,
    metavar="R",
    help="The warm-up as a fraction of the run's steps, ceil(R × --steps) (transformers' "
    "rounding); instead of --warmup-steps.",
)
@click.option(
    "--min-lr-rate",
    type=FiniteFloatRange(min=0, max=1),
    default=None,
    metavar="F",
    help="cosine: the rate at the end, as a fraction of --lr (transformers' cosine_with_min_lr) "
    "[default: 0; on --resume the checkpoint's].",
)
@click.option(
    "--weight-decay",
    type=FiniteFloatRange(min=0),
    default=0.01,
    show_default=True,
    metavar="X",
    help="AdamW's decoupled weight decay, applied to every parameter (one group).",
)
@click.option(
    "--betas",
    type=(BETA, BETA),
    default=(0.9, 0.999),
    show_default=True,
    metavar="B1 B2",
    help="AdamW's moment decay rates, each in [0, 1).",
)
@click.option(
    "--eps",
    type=FiniteFloatRange(min=0, min_open=True),
    default=1e-8,
    show_default=True,
    metavar="X",
    help="AdamW's epsilon (added to the root of the second moment).",
)
@click.option(
    "--seed",
    type=SEED,
    default=0,
    show_default=True,
    help="Seed of the model init and the data order (a 64-bit signed integer).",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=FiniteFloatRange(min=1),
    default=300.0,
    show_default=True,
    help="Seconds any collective may wait before the run fails (multi-rank runs).",
)
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the measured steps as a Chrome/Perfetto trace (rank 0).",
)
@click.option(
    "--save-every",
    type=click.IntRange(1),
    default=None,
    metavar="K",
    help="Checkpoint every K steps too (needs --save-dir).",
)
@click.option(
    "--save-dir",
    type=click.Path(file_okay=False),
    default=None,
    metavar="DIR",
    help="Checkpoint root (atomic step-N directories and a `latest` pointer): saved at the end "
    "and on Ctrl-C, and every --save-every K steps.",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Start a new run in a --save-dir that holds another run's checkpoints (without it such a "
    "directory is refused unless resuming): they are deleted once this run has saved its first.",
)
@click.option(
    "--keep",
    type=click.IntRange(1),
    default=2,
    show_default=True,
    metavar="N",
    help="Checkpoints kept in --save-dir (the newest N; older ones are deleted after each save).",
)
@click.option(
    "--resume",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    metavar="DIR",
    help="Continue from a checkpoint (any plan of this model); --steps counts the total.",
)
@click.option(
    "--eval-every",
    type=click.IntRange(1),
    default=None,
    metavar="K",
    help="Every K steps print a held-out loss (eval mode, no grad), averaged over 4 fixed "
    "micro-batches from the last 5% of the corpus; with this option training draws only "
    "from the other 95%, so it never sees a held-out token.",
)
@click.option(
    "--max-grad-norm",
    type=FiniteFloatRange(min=0, min_open=True),
    default=None,
    metavar="X",
    help="Clip gradients to this global L2 norm; needs a plan made with "
    "`protrain plan --max-grad-norm X` (CPU AdamW after backward).",
)
@click.option(
    "--log-every",
    type=click.IntRange(1),
    default=None,
    metavar="K",
    help="Print a plain `step N  loss …` line every K steps (the default when stdout is not a "
    "terminal, K=10); on a terminal this replaces the progress bar.",
)
@click.option(
    "--metrics",
    "metrics_path",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="FILE",
    help="Append one JSON object per step (step, loss, tokens/s, peak bytes; held-out loss "
    'when evaluated) to FILE (rank 0); a resumed run first appends {"event": "resume", "step": N, '
    '"resumed_from": DIR}, as the steps after it may repeat steps already logged.',
)
@click.option(
    "--export",
    "export_dir",
    type=click.Path(file_okay=False),
    default=None,
    metavar="DIR",
    help="After training, write a Hugging Face model directory (config.json, model.safetensors, "
    "the tokenizer) that transformers' from_pretrained loads; needs --hf-config. With --lora: "
    "the adapter in peft's format (adapter_config.json, adapter_model.safetensors, the "
    "tokenizer), for PeftModel.from_pretrained.",
)
@click.option(
    "--export-merged",
    "export_merged",
    type=click.Path(file_okay=False),
    default=None,
    metavar="DIR",
    help="With --lora and --hf-config: after training, write the base with the adapter merged in "
    "as a Hugging Face model directory (AutoModelForCausalLM.from_pretrained loads it).",
)
@lora_options
@click.option(
    "--nvme",
    "nvme_dir",
    default=None,
    metavar="DIR",
    type=click.Path(file_okay=False),
    help="Directory on a fast local disk for the optimizer states the plan keeps on disk "
    "(placement.nvme); an unlinked file there, gone when training ends.",
)
def train(
    plan_path,
    model_name,
    hf_config,
    blocks,
    data_path,
    text_field,
    tokenizer,
    steps,
    epochs,
    packing,
    loss_on,
    chat_template,
    eval_split,
    eval_data,
    lr,
    lr_schedule,
    warmup_steps,
    warmup_ratio,
    min_lr_rate,
    weight_decay,
    betas,
    eps,
    seed,
    timeout_s,
    trace_path,
    save_every,
    save_dir,
    overwrite,
    keep,
    resume,
    eval_every,
    max_grad_norm,
    log_every,
    metrics_path,
    export_dir,
    nvme_dir,
    export_merged,
    **lora,
):
    """Train a zoo or Hugging Face model by replaying a plan (under torchrun for several ranks).

    Ctrl-C stops after the current step (checkpointing first with --save-dir) and
    exits 130; a second Ctrl-C stops at once and the last complete checkpoint stays intact.
    """
    from .sft_feed import SFTFlags
    from .train import train as run

    # The base as typed, before model_option makes it absolute: what a LoRA adapter's
    # adapter_config.json names (planner/models/lora.py base_name).
    given = hf_config if hf_config is not None else model_name
    model_name = model_option(model_name, hf_config, blocks, required=True)
    losses = run(
        plan_path,
        model_name,
        steps=steps,
        data_path=data_path,
        seed=seed,
        lr=lr,
        lr_schedule=lr_schedule,
        warmup_steps=warmup_steps,
        warmup_ratio=warmup_ratio,
        min_lr_rate=min_lr_rate,
        timeout_s=timeout_s,
        weight_decay=weight_decay,
        betas=tuple(betas),
        eps=eps,
        trace_path=trace_path,
        echo=click.echo,
        save_every=save_every,
        save_dir=save_dir,
        overwrite=overwrite,
        resume=resume,
        eval_every=eval_every,
        max_grad_norm=max_grad_norm,
        keep=keep,
        tokenizer=tokenizer,
        text_field=text_field,
        log_every=log_every,
        metrics_path=metrics_path,
        export_dir=export_dir,
        progress=None,
        nvme_dir=nvme_dir,
        lora=lora_spec(**lora),
        export_merged=export_merged,
        base_name=given,
        sft=SFTFlags(packing, loss_on, chat_template, epochs, eval_split, eval_data),
    )
    code = EXIT_INTERRUPTED if getattr(losses, "interrupted", False) else 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A rank of a finished multi-rank run (its process group destroyed, its files closed)
        # leaves without the interpreter's finalisation: gloo's worker threads can still hold
        # a finished collective's work then, and releasing it aborts the process ("terminate
        # called without an active exception", exit -6: pytorch/pytorch#179291), which torchrun
        # reports as a failed run after every step succeeded (seen in CI, a few % of runs).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)


@click.command()
@click.option(
    "--data",
    "data_path",
    required=True,
    metavar="FILE",
    help="Text file, or JSON lines (.jsonl, see --text-field), read a piece at a time.",
)
@click.option(
    "--text-field",
    default="text",
    show_default=True,
    metavar="NAME",
    help="Field of each .jsonl line that holds the text.",
)
@click.option(
    "--tokenizer",
    "tokenizer",
    default=None,
    metavar="DIR",
    help="Tokenizer directory (tokenizer.json) [default: byte-level tokens].",
)
@click.option(
    "-o", "--output", required=True, type=click.Path(dir_okay=False), help="Token file to write."
)
def tokenize(data_path, text_field, tokenizer, output):
    """Tokenise a corpus of any size once, into a token file `train --data` memory-maps.

    The file is a flat array of token ids (uint16 when the vocabulary fits, else
    uint32) after a small header; training on it draws exactly the batches training on
    the text would, without tokenising again and in memory independent of its size.
    """
    from ..models.data import tokenize as run
    from .preflight import output_file

    output_file(output, "--output")
    source = run(data_path, output, tokenizer=tokenizer, text_field=text_field)
    width = "uint16" if source.tokens.dtype.itemsize == 2 else "uint32"
    click.echo(
        f"wrote {output}: {source.tokens.numel():,} tokens ({width}, vocabulary "
        f"{source.vocab_size}) from {data_path}; train on it with `protrain train --data {output} "
        "…`"
    )


@click.command()
@click.option(
    "--resume",
    "checkpoint",
    required=True,
    metavar="CKPT",
    type=click.Path(exists=True, file_okay=False),
    help="Checkpoint to export: a --save-dir root (its `latest`) or one step directory.",
)
@hf_options
@click.option(
    "--tokenizer",
    "tokenizer",
    default=None,
    metavar="DIR",
    help="Tokenizer directory whose files to copy [default: the --hf-config directory's, if any].",
)
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(file_okay=False),
    help="Directory to write (new or empty): config.json, model.safetensors, the tokenizer.",
)
@lora_options
def export(checkpoint, hf_config, blocks, tokenizer, output, **lora):
    """Export a training checkpoint as a Hugging Face model directory (from_pretrained loads it).

    A `train --lora` checkpoint (adapters only) exports with --lora and the settings it was
    trained with, as `train --lora --export` does: the adapter in peft's format, for
    PeftModel.from_pretrained. The directory appears whole or not at all; a failed export
    leaves the checkpoint as it was.
    """
    from ..models.hf import export_checkpoint
    from .preflight import output_dir
    from .train import _tokenizer_dir

    if hf_config is None:
        raise click.UsageError(
            "give --hf-config PATH: the config the checkpoint's model was trained from"
        )
    output_dir(output, "--output", create=False, must_be_empty=True)
    model_name = model_option(None, hf_config, blocks, required=True)
    spec = lora_spec(**lora)
    tok = _tokenizer_dir(model_name, tokenizer)
    if spec is not None:
        from ..models.lora import export_checkpoint as export_adapter

        out = export_adapter(
            checkpoint, model_name, spec, output, tokenizer_dir=tok, given_name=hf_config
        )
    else:
        out = export_checkpoint(checkpoint, model_name, output, tokenizer_dir=tok)
    click.echo(
        f"exported {out} (peft.PeftModel.from_pretrained(base, DIR) loads the adapter)"
        if spec is not None
        else f"exported {out} (transformers.AutoModelForCausalLM.from_pretrained loads it)"
    )
