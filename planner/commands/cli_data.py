"""``protrain data``: the rows fine-tuning will read, after templating, masking and packing.

The readable view prints each row's examples as decoded text, the tokens that train (labels)
marked ``⟦like this⟧`` (and green on a terminal), the rest as they are, after a header with the
counts and the supervised share. ``--json`` prints one object per row instead (the rows
``load_sft`` gives, without padding), for scripts and for comparing with TRL. Rows come in file
order; ``show_rows`` takes any order, so a plan's training order can be shown the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import click


def _choices(table: dict) -> str:
    return "; ".join(f"{name}: {entry.help}" for name, entry in table.items())


def _loss_on_help() -> str:
    from ..models.sft_tokens import LOSS_ON

    return "Which tokens train. " + _choices(LOSS_ON) + "."


def _packing_help() -> str:
    from ..models.packing import PACKING

    return "How examples fill rows of --seq tokens. " + _choices(PACKING) + "."


def _formats_help() -> str:
    from ..models.sft_records import FORMATS, SOURCES

    return (
        "Fine-tuning data (repeatable): "
        + "; ".join(f.help for f in FORMATS.values())
        + ". Read from "
        + ", ".join(SOURCES)
        + "."
    )


def _table_choice(module: str, table: str) -> click.Choice:
    import importlib

    return click.Choice(list(getattr(importlib.import_module(module, __package__), table)))


def row_options(defaults: bool):
    """--packing, --loss-on and --chat-template, for ``data`` and ``train`` alike. ``defaults``:
    fill in bfd and auto (``data``); else None when not given (``train``: a flag given means
    fine-tuning rows; left out, the data decides)."""

    def decorate(f):
        for option in reversed(
            [
                click.option(
                    "--packing",
                    type=_table_choice("..models.packing", "PACKING"),
                    default="bfd" if defaults else None,
                    help=_packing_help() + " [default: bfd]",
                ),
                click.option(
                    "--loss-on",
                    "loss_on",
                    type=_table_choice("..models.sft_tokens", "LOSS_ON"),
                    default="auto" if defaults else None,
                    help=_loss_on_help() + " [default: auto]",
                ),
                click.option(
                    "--chat-template",
                    "chat_template",
                    metavar="FILE",
                    type=click.Path(exists=True, dir_okay=False),
                    default=None,
                    help="Jinja chat template [default: the tokenizer's chat_template.jinja or "
                    "tokenizer_config.json's chat_template]. Needs {% generation %} markers for "
                    "--loss-on assistant; written into exports as chat_template.jinja.",
                ),
            ]
        ):
            f = option(f)
        return f

    return decorate


@click.command()
@click.option(
    "--hf-config",
    "hf_config",
    metavar="DIR",
    required=True,
    help="Model directory (or its config.json) holding the tokenizer; read locally.",
)
@click.option(
    "--data",
    "data_paths",
    multiple=True,
    required=True,
    metavar="FILE",
    help=_formats_help(),
)
@click.option(
    "--seq",
    "seq_len",
    type=click.IntRange(min=2),
    default=None,
    help="Row length [required without --plan; with it, the plan's].",
)
@row_options(defaults=True)
@click.option(
    "--text-field",
    default="text",
    show_default=True,
    help="Field holding the text of plain-text records.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per row, no padding.")
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=None,
    help="Show the first K rows only [default: all].",
)
@click.option(
    "--plan",
    "plan_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Show the rows in the order `protrain train --plan` consumes them (its micro-batch, "
    "gradient accumulation and ranks), each tagged with its step, micro-batch and rank; a "
    "row that fills an epoch's last step is shown empty.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="With --plan: train's --seed.")
@click.option(
    "--steps",
    type=click.IntRange(1),
    default=None,
    help="With --plan: train's --steps [default: one epoch].",
)
@click.option(
    "--epochs", type=click.IntRange(1), default=None, help="With --plan: train's --epochs."
)
@click.option(
    "--eval-split",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    default=None,
    help="With --plan: train's --eval-split (the held-out rows are not shown).",
)
def data(
    hf_config,
    data_paths,
    seq_len,
    packing,
    loss_on,
    chat_template,
    text_field,
    as_json,
    limit,
    plan_path,
    seed,
    steps,
    epochs,
    eval_split,
):
    """Show the rows fine-tuning reads: templated, masked and packed, in file order (or, with
    --plan, in the order training consumes them)."""
    from protrain.plans.errors import ConfigError

    from ..models.sft import load_sft

    plan = None
    if plan_path is not None:
        from protrain import plans

        plan = plans.load(plan_path)
        if seq_len not in (None, plan.training.seq_len):
            raise ConfigError(
                f"--seq {seq_len}, but {plan_path} was made for seq_len {plan.training.seq_len}",
                "drop --seq: the plan's is used",
            )
        seq_len = plan.training.seq_len
    elif seq_len is None:
        raise click.UsageError("give --seq N (the row length), or --plan PLAN")
    elif steps is not None or epochs is not None or eval_split is not None:
        raise click.UsageError("--steps, --epochs and --eval-split order rows as a plan trains")
    if steps is not None and epochs is not None:
        raise click.UsageError("give --steps or --epochs, not both")

    tokenizer_dir = Path(hf_config)
    if tokenizer_dir.is_file():
        tokenizer_dir = tokenizer_dir.parent
    from .progress import TokenisingBar

    with TokenisingBar() as bar:
        rows = load_sft(
            list(data_paths),
            tokenizer_dir=str(tokenizer_dir),
            seq_len=seq_len,
            chat_template=chat_template,
            text_field=text_field,
            loss_on=loss_on,
            packing=packing,
            progress=bar.update,
        )
    order = (
        range(rows.n_rows)
        if plan is None
        else training_order(rows, plan.training, seed, steps, epochs, eval_split)
    )
    if not as_json:
        from ..models.data import _transformers_tokenizer

        click.echo(header(rows, seq_len))
        show_rows(rows, order, limit, _transformers_tokenizer(str(tokenizer_dir)).decode)
    else:
        show_rows(rows, order, limit, None)


def header(rows, seq_len: int) -> str:
    """Rows, examples, truncated examples and the supervised share of all row positions."""
    import numpy as np

    packed = rows.packed
    kept = np.zeros(rows.n_examples, dtype=bool)
    kept[packed.example] = True
    # An example is truncated when its rows hold fewer of its tokens than it has (summed over
    # its segments: ``wrapped`` splits an example over two rows without losing any).
    held = np.bincount(packed.example, weights=packed.length, minlength=rows.n_examples)  # (E,)
    truncated = int(np.count_nonzero(kept & (held < _lengths(rows))))
    supervised = int(rows.supervised_counts().sum())
    share = supervised / (rows.n_rows * seq_len)
    return (
        f"{rows.name}: {rows.n_rows:,} rows of {seq_len} from {int(kept.sum()):,} examples "
        f"({rows.n_examples - int(kept.sum()):,} dropped, {truncated:,} truncated); "
        f"{supervised:,} supervised targets, {share:.1%} of the rows' positions"
    )


def _lengths(rows):
    import numpy as np

    return np.concatenate([c.lengths for c in rows.caches])


def training_order(rows, t, seed: int, steps, epochs, eval_split):
    """(row, {"step", "micro_batch", "rank"}) in the order ``protrain train`` under a plan of
    training shape ``t`` consumes them (``sft_feed``; one epoch unless told), every rank's."""
    from ..models.epochs import RowOrder, heldout_split

    train = (
        range(rows.n_rows)
        if eval_split is None
        else heldout_split(rows.n_rows, eval_split, seed)[0].tolist()
    )
    order = RowOrder(len(train), seed, t.micro_batch, t.grad_accum, t.world_size)
    if steps is None:
        steps = (epochs or 1) * order.steps_per_epoch
    for step in range(steps):
        for m in range(t.grad_accum):
            glob = order.global_rows_at(step * t.grad_accum + m)
            for slot, i in enumerate(glob.tolist()):
                tags = {"step": step + 1, "micro_batch": m, "rank": slot // t.micro_batch}
                yield (i if i < 0 else train[i]), tags


def show_rows(rows, order: Iterable, limit: int | None, decode) -> None:
    """Print rows ``order`` (row indices, or (index, tags) pairs of a training order; index -1:
    a row of padding only): JSON objects when ``decode`` is None, else the readable view."""
    for n, item in enumerate(order):
        if limit is not None and n >= limit:
            break
        i, tags = item if isinstance(item, tuple) else (item, {})
        if decode is None:
            from .sft_feed import rows_json

            click.echo(rows_json(rows, i, **tags))
            continue
        where = "".join(f", {k.replace('_', '-')} {v}" for k, v in tags.items())
        if i < 0:
            click.echo(f"── padding only{where}")
            continue
        ids, labels, pos = rows.row(i)
        _show_row(f"{i}{where}", ids, labels, pos, rows.supervised(i), decode)


def _show_row(i, ids, labels, pos, supervised, decode) -> None:
    from rich.console import Console
    from rich.text import Text

    console = Console(highlight=False, soft_wrap=True)
    starts = [int(t) for t in (pos == 0).nonzero()[0]] + [len(ids)]
    console.print(
        Text(
            f"── row {i}: {len(ids)} tokens, {len(starts) - 1} examples, {supervised} targets",
            style="bold",
        )
    )
    for k in range(len(starts) - 1):
        a, b = starts[k], starts[k + 1]
        text = Text(f"[{k}] ", style="dim")
        trained = labels[a:b] != -100
        t = a
        while t < b:  # runs of tokens that train or not, each decoded as one piece
            u = t
            while u < b and trained[u - a] == trained[t - a]:
                u += 1
            piece = decode(ids[t:u].tolist())
            if trained[t - a]:
                text.append("⟦" + piece + "⟧", style="bold green")
            else:
                text.append(piece)
            t = u
        console.print(text)
