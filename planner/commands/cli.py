"""The ``protrain`` command line: one click group, one function per command.

Heavy imports (torch, networkx) happen inside the commands that need them, so
``protrain --help``, ``show`` and ``validate`` of a plan start fast and never import
torch unless a model must be built. User errors (``ProtrainError``) print as one
paragraph and exit 1, and so do OS errors on files (a full disk, a permission) that
reach the top; ``--debug`` shows the traceback instead. Usage errors exit 2;
Ctrl-C exits 130 (128 + SIGINT, what shells report for an interrupted command); a
closed stdout pipe (``protrain models | head -1``) exits 141 (128 + SIGPIPE) silently.
"""

from __future__ import annotations

import os
import sys

import click

from protrain.plans.errors import ProtrainError

from ..hardware.units import human_bytes, human_count
from .cli_data import data
from .cli_train import export, tokenize, train
from .floats import FiniteFloatRange
from .lora_options import click_options as lora_options
from .lora_options import spec_from as lora_spec
from .options import (
    DTYPES,
    EXIT_INTERRUPTED,
    REPROBE_HELP,
    SEED,
    hf_options,
    model_option,
)


class _Group(click.Group):
    """Turns ``ProtrainError`` (and ``OSError``) into one clear paragraph and exit status 1."""

    def invoke(self, ctx: click.Context):
        try:
            result = super().invoke(ctx)
            sys.stdout.flush()  # a closed pipe shows here when the output fit in the buffer
            return result
        except BrokenPipeError:
            _closed_pipe()
        except ProtrainError as e:
            if ctx.meta.get("protrain.debug"):
                raise
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except OSError as e:
            if ctx.meta.get("protrain.debug"):
                raise
            where = f"{e.filename}: " if e.filename else ""
            click.echo(
                f"error: {where}{e.strerror or e}\nHINT: check the path exists, is writable and "
                "the disk has space (--debug shows where it happened)",
                err=True,
            )
            sys.exit(1)
        except KeyboardInterrupt:
            if ctx.meta.get("protrain.debug"):
                raise
            click.echo("interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)


EXIT_CLOSED_PIPE = 141
"""Exit status when the reader of stdout went away (``protrain models | head -1``): 128 +
SIGPIPE."""


def _closed_pipe() -> None:
    """Leave quietly, as Unix tools do when their reader closes the pipe (the Python docs'
    recipe, "Note on SIGPIPE"): stdout goes to devnull so the interpreter's last flush
    cannot fail again, and nothing is printed."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(EXIT_CLOSED_PIPE)


def _status(line: str) -> None:
    """A progress line for a person watching: on stderr when it is a terminal (as git shows its
    progress), so logs, pipes and ``2>&1`` captures get only the command's output and errors."""
    if sys.stderr.isatty():
        click.echo(line, err=True)


@click.group(cls=_Group)
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.version_option(package_name="protrain", prog_name="protrain")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """protrain: train large language models on a few GPUs with an automatic memory plan.

    The planner profiles a model and writes a plan file (chunk layout, what stays on
    the device, per-block activation policy, the prefetch/release schedule); the
    executor replays the plan on every rank.
    """
    ctx.meta["protrain.debug"] = debug


@main.command()
def models() -> None:
    """List the model zoo: parameters, blocks, hidden size, heads, vocabulary."""
    from ..models.zoo import ZOO
    from ..models.zoo_table import rows_for

    rows = rows_for(ZOO)
    click.echo(
        f"{'name':<14}{'family':<8}{'params':>10}{'blocks':>8}{'hidden':>8}{'heads':>7}{'vocab':>8}"
    )
    for r in rows:
        click.echo(
            f"{r.name:<14}{r.family:<8}{human_count(r.n_params):>10}{r.n_blocks:>8}"
            f"{r.hidden:>8}{r.n_head:>7}{r.vocab_size:>8}"
        )


@main.command()
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False))
def show(plan_path: str) -> None:
    """Summarise a plan: model, hardware, placement, per-block policy strip, prediction."""
    from protrain.plans import load

    from ..views.show import render_show

    click.echo(render_show(load(plan_path), plan_path))


@main.command()
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False))
@click.option(
    "--model",
    "model_name",
    metavar="NAME",
    default=None,
    help="Zoo model to check the plan against (default: the plan's model, if it is a zoo name).",
)
def validate(plan_path: str, model_name: str | None) -> None:
    """Check a plan's structure and, with --model, its fingerprint against that model and what
    `train` checks before training (the model's context, this machine's memory).

    Without --model only the plan file is read (no torch, no runtime: a plan can be checked
    on a machine without either). The model is built on the meta device, so checking a plan
    for a 70B model allocates nothing.
    """
    from protrain.plans import load

    plan = load(plan_path)
    click.echo(
        f"{plan_path}: structure ok (schema v{plan.schema_version}, "
        f"{len(plan.chunks.items)} chunks, {len(plan.model.blocks)} blocks)"
    )
    if model_name is None:
        click.echo(
            f"{plan_path}: fingerprint not checked; `protrain validate {plan_path} "
            f"--model {plan.model.name or 'NAME'}` checks it against the model"
        )
        return
    from protrain.executor.check import check

    from ..models.zoo import build

    check(plan, build(model_name, device="meta"), where=plan_path, name=model_name)
    click.echo(f"{plan_path}: fingerprint matches {model_name}")
    from .train import default_device, prechecks

    # what `train` checks before it builds the model, on the device it would train on
    need = prechecks(plan, model_name, device=default_device(), where=plan_path)
    click.echo(
        f"{plan_path}: fits this machine (about {human_bytes(need)} of host memory to train)"
    )


@main.command()
@click.option(
    "--model", "model_name", metavar="NAME", default=None, help="Zoo model (or hf:PATH) to profile."
)
@hf_options
@click.option(
    "--batch", type=click.IntRange(1), required=True, help="Micro-batch (sequences per step)."
)
@click.option("--seq", type=click.IntRange(1), required=True, help="Sequence length in tokens.")
@click.option(
    "--dtype",
    type=DTYPES,
    default=None,
    help="Compute dtype [default: bfloat16 on CUDA, float32 on CPU].",
)
@click.option(
    "--device",
    type=click.Choice(["cuda", "cpu"]),
    default=None,
    help="Device to measure on [default: cuda if present].",
)
@click.option("--analytic", is_flag=True, help="Estimate from --hardware instead of measuring.")
@click.option(
    "--hardware",
    "hardware",
    metavar="SPEC",
    default=None,
    help="Hardware spec (name in plans/hardware/ or a file); required with --analytic.",
)
@click.option(
    "--iterations",
    type=click.IntRange(1),
    default=5,
    show_default=True,
    help="Measured iterations (medians).",
)
@click.option("--reprobe", is_flag=True, help=REPROBE_HELP)
@click.option(
    "-o", "--output", required=True, type=click.Path(dir_okay=False), help="Profile file to write."
)
def profile(
    model_name,
    hf_config,
    blocks,
    batch,
    seq,
    dtype,
    device,
    analytic,
    hardware,
    iterations,
    reprobe,
    output,
):
    """Profile a model once (per block time, activations, link and Adam rates) for planning."""
    from .checks import check_flags
    from .profile_plan import run_profile

    check_flags(micro_batch=batch, seq_len=seq)
    model_name = model_option(model_name, hf_config, blocks, required=True)
    run_profile(
        model_name=model_name,
        batch=batch,
        seq=seq,
        dtype=dtype,
        device=device,
        analytic=analytic,
        hardware=hardware,
        iterations=iterations,
        output=output,
        echo=click.echo,
        reprobe=reprobe,
    )


@main.command()
@click.option(
    "--profile",
    "profile_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Profile to plan from (from `protrain profile`).",
)
@click.option(
    "--model",
    "model_name",
    metavar="NAME",
    default=None,
    help="Zoo model (or hf:PATH): profile on the way (analytic with --hardware, else measured).",
)
@hf_options
@click.option(
    "--hardware",
    metavar="SPEC",
    default=None,
    help="Hardware spec for an analytic profile (with --model; a --profile carries its own).",
)
@click.option("--batch", type=click.IntRange(1), default=None, help="Micro-batch (with --model).")
@click.option("--seq", type=click.IntRange(1), default=None, help="Sequence length (with --model).")
@click.option("--dtype", type=DTYPES, default=None, help="Compute dtype (with --model).")
@click.option(
    "--device",
    type=click.Choice(["cuda", "cpu"]),
    default=None,
    help="Measure on this device instead of estimating (with --model).",
)
@click.option(
    "--budget",
    default=None,
    metavar="SIZE",
    help="Device memory budget, e.g. 20GiB [default: the hardware's usable memory].",
)
@click.option("--world-size", type=click.IntRange(1), default=1, show_default=True, help="Ranks.")
@click.option(
    "--grad-accum",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Micro-batches per optimizer step.",
)
@click.option(
    "--solver",
    type=click.Choice(["exhaustive", "milp"]),
    default=None,
    help="Search: the paper's four counts (exhaustive) or per-chunk/per-block MILP (HiGHS; "
    "never worse, falls back to exhaustive) [default: exhaustive].",
)
@click.option(
    "--host-memory",
    default=None,
    metavar="SIZE",
    help="Host memory per rank a plan may use [default: the spec's RAM less 10% and 2 GiB].",
)
@click.option(
    "--max-grad-norm",
    type=FiniteFloatRange(min=0, min_open=True),
    default=None,
    metavar="X",
    help="Training will clip gradients to this global norm: the plan runs the CPU AdamW steps "
    "after backward (clipping needs every gradient first) and is predicted that way.",
)
@click.option(
    "--nvme",
    is_flag=True,
    help="Where host memory binds, the plan may keep offloaded chunks' optimizer states on a disk "
    "(train with --nvme DIR); the spec must carry the disk's bandwidth "
    "(`protrain hardware probe --nvme DIR`).",
)
@click.option("--reprobe", is_flag=True, help=REPROBE_HELP)
@click.option(
    "--save-profile",
    "save_profile",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="FILE",
    help="With --model/--hf-config: also write the profile made on the way, which "
    "`protrain explain PLAN --profile FILE --trace/--plot` needs.",
)
@lora_options
@click.option(
    "-o", "--output", required=True, type=click.Path(dir_okay=False), help="Plan file to write."
)
def plan(
    profile_path,
    model_name,
    hf_config,
    blocks,
    hardware,
    batch,
    seq,
    dtype,
    device,
    budget,
    world_size,
    grad_accum,
    solver,
    host_memory,
    max_grad_norm,
    nvme,
    reprobe,
    save_profile,
    output,
    **lora,
):
    """Search the fastest plan that fits the budget and write it."""
    from .checks import check_flags
    from .profile_plan import run_plan

    check_flags(micro_batch=batch, seq_len=seq, world_size=world_size, grad_accum=grad_accum)
    model_name = model_option(model_name, hf_config, blocks, required=False)
    run_plan(
        profile_path=profile_path,
        model_name=model_name,
        hardware=hardware,
        batch=batch,
        seq=seq,
        dtype=dtype,
        device=device,
        budget=budget,
        world_size=world_size,
        grad_accum=grad_accum,
        output=output,
        echo=click.echo,
        solver=solver,
        host_memory=host_memory,
        max_grad_norm=max_grad_norm,
        reprobe=reprobe,
        nvme=nvme,
        save_profile=save_profile,
        status=_status,
        lora=lora_spec(**lora),
    )


@main.command()
@click.argument("a_path", metavar="A", type=click.Path(dir_okay=False))
@click.argument("b_path", metavar="B", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def diff(a_path: str, b_path: str, as_json: bool) -> None:
    """Semantic diff of two plans; exit 0 when equal, 1 when they differ, 2 on errors."""
    import json

    from protrain.plans import load

    from ..views.diff import diff_json, render_diff

    try:
        a, b = load(a_path), load(b_path)
    except ProtrainError as e:  # 1 means "differ" here, as for diff(1)
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    if as_json:
        doc = diff_json(a, b)
        click.echo(json.dumps(doc, indent=2))
        sys.exit(0 if doc["equal"] else 1)
    text, equal = render_diff(a, b, a_path, b_path)
    click.echo(text)
    sys.exit(0 if equal else 1)


@main.command()
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False))
@click.option(
    "--profile",
    "profile_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="The profile the plan was made from (needed for --trace and --plot).",
)
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the predicted iteration as a Chrome/Perfetto trace.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Draw the predicted memory walk with the budget line (PNG; the plot extra).",
)
def explain(
    plan_path: str, profile_path: str | None, trace_path: str | None, plot_path: str | None
) -> None:
    """Why this plan: runners-up, the Pareto front, what bounds each phase."""
    from protrain.plans import load

    from ..views.show import render_explain
    from .preflight import output_file

    if (trace_path or plot_path) and profile_path is None:  # before the report, not after it
        raise ProtrainError(
            "--trace and --plot need the profile the plan was made from",
            "add --profile PROFILE.json: the file given to `protrain plan --profile`, or the "
            "one `protrain plan --model/--hf-config … --save-profile PROFILE.json` wrote "
            "(a plan made without it: plan again with --save-profile)",
        )
    if plot_path:
        from ..views.memory_plot import require_matplotlib

        require_matplotlib()  # before the report and the trace, not after them
    output_file(trace_path, "--trace")
    output_file(plot_path, "--plot")
    plan = load(plan_path)
    departures = None
    if profile_path is not None:
        from ..profiling.profile import load_profile
        from ..search.milp import explain_departures

        departures = explain_departures(load_profile(profile_path), plan)
    click.echo(render_explain(plan, plan_path, departures=departures))
    if profile_path is not None:
        from ..profiling.profile import load_profile

        profile = load_profile(profile_path)
        if trace_path:
            from ..views.trace import predicted_trace, write_trace

            write_trace(predicted_trace(profile, plan), trace_path)
            click.echo(f"wrote {trace_path} (open in ui.perfetto.dev or chrome://tracing)")
        if plot_path:
            from ..views.memory_plot import plot_memory

            plot_memory(profile, plan, plot_path)
            click.echo(f"wrote {plot_path}")


@main.command()
@click.option("--hardware", required=True, metavar="SPEC", help="Hardware spec (name or file).")
@click.option(
    "--budget", default=None, metavar="SIZE", help="Device memory budget [default: usable memory]."
)
@click.option(
    "--seq", type=click.IntRange(1), default=1024, show_default=True, help="Sequence length."
)
@click.option(
    "--model",
    "model_name",
    metavar="NAME",
    default=None,
    help="A zoo model (`protrain models`) or hf:PATH: whether it trains on this card and "
    "host, instead of the family ladders.",
)
@hf_options
@click.option(
    "--host-memory",
    default=None,
    metavar="SIZE",
    help="Host RAM of the machine, shared by the --world-size ranks: each rank may use "
    "SIZE/N less 10% and 2 GiB [default: N times the spec's RAM, which is one rank's share].",
)
@click.option(
    "--world-size",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Ranks (ZeRO-3), one device each, sharing --host-memory.",
)
@click.option(
    "--nvme",
    is_flag=True,
    help="Let plans keep optimizer states on disk where host memory binds (train with "
    "--nvme DIR); the spec must carry the disk's bandwidth (`protrain hardware probe --nvme DIR`).",
)
@lora_options
def fit(
    hardware, budget, seq, model_name, hf_config, blocks, host_memory, world_size, nvme, **lora
):
    """The largest GPT-2 and LLaMA family model (and batch) that trains on N devices.

    Prints, per family, the largest size, its plan's time and memory, which resource
    binds at that size (device or host memory) and which stops the next size up.
    With --model (a zoo model) or --hf-config: whether that model trains on this card
    and host instead (total and active parameters, the best micro-batch, what binds);
    exit status 1 when it does not fit.
    """
    from .checks import check_flags

    check_flags(seq_len=seq, world_size=world_size)
    if hf_config is None and model_name is None:
        if blocks is not None:
            raise click.UsageError("--blocks goes with --hf-config (a model to fit)")
        from .fit import run_fit

        run_fit(
            hardware,
            budget=budget,
            seq_len=seq,
            echo=click.echo,
            host_memory=host_memory,
            world_size=world_size,
            nvme=nvme,
            lora=lora_spec(**lora),
        )
        return
    from ..models.zoo import check_name
    from .fit_config import run_model_fit

    model_name = model_option(model_name, hf_config, blocks, required=True)
    check_name(model_name)  # a mistyped name fails before the probes
    run_model_fit(
        model_name,
        hardware,
        budget=budget,
        host_memory=host_memory,
        seq_len=seq,
        echo=click.echo,
        world_size=world_size,
        nvme=nvme,
        lora=lora_spec(**lora),
    )


@main.group()
def hardware() -> None:
    """Hardware specs: probe this machine."""


@hardware.command()
@click.option(
    "-o", "--output", required=True, type=click.Path(dir_okay=False), help="Spec file to write."
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cuda", "cpu"]),
    default="auto",
    show_default=True,
    help="Device to probe.",
)
@click.option("--quick", is_flag=True, help="Smaller, faster measurements.")
@click.option(
    "--nvme",
    default=None,
    metavar="DIR",
    type=click.Path(file_okay=False),
    help="Also measure the read and write bandwidth of the disk under DIR, for plans that keep "
    "optimizer states there (`protrain plan --nvme`).",
)
def probe(output, device, quick, nvme):
    """Measure this machine (GPU via NVML, copy bandwidth, Adam rates) into a spec file."""
    from ..hardware.probe import probe_to_file
    from .preflight import output_file

    output_file(output, "--output")  # before the measurements, not after them
    probe_to_file(output, device=device, quick=quick, echo=click.echo, nvme=nvme)


@main.command()
@click.option(
    "--model",
    "model_name",
    default="gpt2-tiny",
    show_default=True,
    metavar="NAME",
    help="Zoo model to train (small ones only: it trains on this machine's device).",
)
@click.option(
    "--steps",
    default=30,
    show_default=True,
    type=click.IntRange(1),
    help="Optimizer steps to train.",
)
@click.option(
    "--data",
    "data_path",
    default=None,
    metavar="FILE",
    help="Text file to train on (byte-level tokens); default: the embedded Python docs.",
)
@click.option(
    "--out",
    "out_dir",
    default="quickstart",
    show_default=True,
    metavar="DIR",
    help="Directory for the profile and the plan.",
)
@click.option(
    "--budget",
    default=None,
    metavar="SIZE",
    help="Memory budget [default: 60% of the predicted peak of the fastest plan with all of "
    "the device's usable memory, so the plan must trade memory for time].",
)
@click.option(
    "--seed",
    type=SEED,
    default=0,
    show_default=True,
    help="Seed of the model init and the data order (a 64-bit signed integer).",
)
def quickstart(model_name, steps, data_path, out_dir, budget, seed):
    """Profile → plan → train a small model end to end on whatever device is present."""
    from .preflight import output_dir
    from .quickstart import run

    output_dir(out_dir, "--out")
    run(
        model_name=model_name,
        steps=steps,
        data_path=data_path,
        out_dir=out_dir,
        budget=budget,
        seed=seed,
        echo=click.echo,
    )


if __name__ == "__main__":
    main()


for _command in (train, tokenize, export):  # (cli_train.py: the training commands)
    main.add_command(_command)
main.add_command(data)  # (cli_data.py: the fine-tuning rows)
