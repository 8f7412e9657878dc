"""The ``protrain`` command line: one click group, one function per command.

Heavy imports (torch, networkx) happen inside the commands that need them, so
``protrain --help``, ``show`` and ``validate`` of a plan start fast and never import
torch unless a model must be built. User errors (``ProtrainError``) print as one
paragraph and exit 1; ``--debug`` shows the traceback instead. Usage errors exit 2.
"""

from __future__ import annotations

import sys

import click

from protrain.executor.errors import ProtrainError


class _Group(click.Group):
    """Turns ``ProtrainError`` into one clear paragraph and exit status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except ProtrainError as e:
            if ctx.meta.get("protrain.debug"):
                raise
            click.echo(f"error: {e}", err=True)
            sys.exit(1)


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
    from .models import ZOO, describe

    rows = [describe(name) for name in ZOO]
    click.echo(f"{'name':<14}{'family':<8}{'params':>10}{'blocks':>8}{'hidden':>8}{'heads':>7}{'vocab':>8}")
    for r in rows:
        click.echo(f"{r.name:<14}{r.family:<8}{_count(r.n_params):>10}{r.n_blocks:>8}"
                   f"{r.hidden:>8}{r.n_head:>7}{r.vocab_size:>8}")


def _count(n: int) -> str:
    from .report import human_count

    return human_count(n)


@main.command()
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False))
def show(plan_path: str) -> None:
    """Summarise a plan: model, hardware, placement, per-block policy strip, prediction."""
    from protrain.executor.plan import load

    from .report import render_show

    click.echo(render_show(load(plan_path), plan_path))


@main.command()
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False))
@click.option("--model", "model_name", metavar="NAME", default=None,
              help="Zoo model to check the plan against (default: the plan's model, if it is a zoo name).")
def validate(plan_path: str, model_name: str | None) -> None:
    """Check a plan's structure and, against a zoo model, its fingerprint.

    The model is built on the meta device, so checking a plan for a 70B model
    allocates nothing.
    """
    from protrain.executor.plan import load

    plan = load(plan_path)
    click.echo(f"{plan_path}: structure ok (schema v{plan.schema_version}, "
               f"{len(plan.chunks.items)} chunks, {len(plan.model.blocks)} blocks)")
    from .models import ZOO

    name = model_name or (plan.model.name if plan.model.name in ZOO else None)
    if name is None:
        click.echo(f"{plan_path}: model {plan.model.name!r} is not in the zoo; "
                   "fingerprint not checked (pass --model NAME)")
        return
    from protrain.executor.check import check

    from .models import build

    check(plan, build(name, device="meta"), where=plan_path)
    click.echo(f"{plan_path}: fingerprint matches {name}")


@main.command()
@click.option("--model", "model_name", default="gpt2-tiny", show_default=True, metavar="NAME",
              help="Zoo model to train (small ones only: it trains on this machine's device).")
@click.option("--steps", default=30, show_default=True, type=click.IntRange(1),
              help="Optimizer steps to train.")
@click.option("--data", "data_path", default=None, metavar="FILE",
              help="Text file to train on (byte-level tokens); default: the embedded Python docs.")
@click.option("--out", "out_dir", default="quickstart", show_default=True, metavar="DIR",
              help="Directory for the plan file.")
@click.option("--seed", default=0, show_default=True, help="Seed of the model init and the data order.")
def quickstart(model_name: str, steps: int, data_path: str | None, out_dir: str, seed: int) -> None:
    """Plan and train a small model end to end on whatever device is present."""
    from .quickstart import run

    run(model_name=model_name, steps=steps, data_path=data_path, out_dir=out_dir, seed=seed,
        echo=click.echo)


if __name__ == "__main__":
    main()
