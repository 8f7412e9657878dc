"""``protrain data``: the rows fine-tuning will read, after templating, masking and packing.

The readable view prints each row's examples as decoded text, the tokens that train (labels)
marked ``⟦like this⟧`` (and green on a terminal), the rest as they are, after a header with the
counts and the supervised share. ``--json`` prints one object per row instead (the rows
``load_sft`` gives, without padding), for scripts and for comparing with TRL. Rows come in file
order; ``show_rows`` takes any order, so a plan's training order can be shown the same way.
"""

from __future__ import annotations

import json
import sys
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
@click.option("--seq", "seq_len", type=click.IntRange(min=2), required=True, help="Row length.")
@click.option(
    "--packing",
    type=_table_choice("..models.packing", "PACKING"),
    default="bfd",
    show_default=True,
    help=_packing_help(),
)
@click.option(
    "--loss-on",
    "loss_on",
    type=_table_choice("..models.sft_tokens", "LOSS_ON"),
    default="auto",
    show_default=True,
    help=_loss_on_help(),
)
@click.option(
    "--chat-template",
    "chat_template",
    metavar="FILE",
    default=None,
    help="Jinja chat template [default: the tokenizer's chat_template.jinja or "
    "tokenizer_config.json's chat_template]. Needs {% generation %} markers for --loss-on "
    "assistant.",
)
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
):
    """Show the rows fine-tuning reads: templated, masked and packed, in file order."""
    from ..models.sft import load_sft

    tokenizer_dir = Path(hf_config)
    if tokenizer_dir.is_file():
        tokenizer_dir = tokenizer_dir.parent
    with _Bar() as bar:
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
    order = range(rows.n_rows)
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
    supervised = sum(rows.supervised(i) for i in range(rows.n_rows))
    share = supervised / (rows.n_rows * seq_len)
    return (
        f"{rows.name}: {rows.n_rows:,} rows of {seq_len} from {int(kept.sum()):,} examples "
        f"({rows.n_examples - int(kept.sum()):,} dropped, {truncated:,} truncated); "
        f"{supervised:,} supervised targets, {share:.1%} of the rows' positions"
    )


def _lengths(rows):
    import numpy as np

    return np.concatenate([c.lengths for c in rows.caches])


def show_rows(rows, order: Iterable[int], limit: int | None, decode) -> None:
    """Print rows ``order`` (the seam for a training order): JSON objects when ``decode`` is
    None, else the readable view."""
    for n, i in enumerate(order):
        if limit is not None and n >= limit:
            break
        ids, labels, pos = rows.row(i)
        if decode is None:
            obj = {
                "input_ids": ids.tolist(),
                "labels": labels.tolist(),
                "position_ids": pos.tolist(),
            }
            click.echo(json.dumps(obj, separators=(",", ":")))
            continue
        _show_row(i, ids, labels, pos, rows.supervised(i), decode)


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


class _Bar:
    """A progress bar on stderr while files are tokenised, shown only on a terminal."""

    def __enter__(self):
        self.progress = self.task = None
        return self

    def update(self, name: str, done: int, total: int) -> None:
        if not sys.stderr.isatty():
            return
        if self.progress is None:
            from rich.console import Console
            from rich.progress import Progress

            self.progress = Progress(console=Console(stderr=True), transient=True)
            self.progress.start()
        if self.task is None or self.name != name:
            self.name = name
            self.task = self.progress.add_task(f"tokenising {Path(name).name}", total=total)
        self.progress.update(self.task, completed=done, total=total)

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.stop()
        return False
