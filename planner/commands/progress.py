"""What a training run shows and logs as it goes: the progress bar on a terminal
(``ProgressBar``) and the metrics file (``Metrics``), whose write failures never end a run."""

from __future__ import annotations

import json
import sys
from pathlib import Path


class ProgressBar:
    """``train``'s bar: ``train ━━━╸   M/N  status  ETA`` fitted to the terminal's width at
    every step. The step count and the time left always show; the bar shrinks first (to
    nothing), then the status is cut with an ellipsis (rich's own layout cut the count and
    the ETA to "1…" and "-:-…" at 80 columns)."""

    BAR_MAX = 40
    ETA = 7  # "0:00:00"

    def __init__(self, steps: int, done: int, console=None):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )
        from rich.table import Column

        self.count = len(f"{steps}/{steps}")
        self._bar = BarColumn(bar_width=self.BAR_MAX)
        fixed = Column(no_wrap=True, overflow="crop")
        self.progress = Progress(
            TextColumn("[bold]train", table_column=fixed),
            self._bar,
            MofNCompleteColumn(table_column=Column(no_wrap=True, min_width=self.count)),
            TextColumn("{task.fields[status]}", table_column=Column(no_wrap=True)),
            TimeRemainingColumn(table_column=Column(no_wrap=True, min_width=self.ETA)),
            transient=False,
            console=console,
        )
        self.task = self.progress.add_task("train", total=steps, completed=done, status="")

    def fit(self, status: str, width: int) -> str:
        """Set the bar's width for ``width`` columns; returns ``status`` as it fits."""
        # train, bar, count, status, ETA: one space between columns, one column spare.
        room = width - 1 - len("train") - self.count - self.ETA - 4
        bar = min(self.BAR_MAX, room - len(status))
        if bar < 1:  # a one-column bar, the status cut to what is left
            bar, keep = 1, max(0, room - 1)
            status = status[: keep - 1] + "…" if 0 < keep < len(status) else status[:keep]
        self._bar.bar_width = bar
        return status

    def start(self) -> None:
        self.progress.update(self.task, status=self.fit("", self.progress.console.width))
        self.progress.start()

    def advance(self, status: str) -> None:
        status = self.fit(status, self.progress.console.width)
        self.progress.update(self.task, advance=1, status=status)

    def stop(self) -> None:
        self.progress.stop()


class Metrics:
    """The ``--metrics`` file. A write that fails (a full disk, a file-size limit) warns once,
    naming the file, and the run goes on without it: the metrics are a log of the run, and
    stopping would cost the steps still to train (the checkpoints, elsewhere or on the same
    disk, have their own handling: ``rescue``). The lines before the failure stay whole."""

    def __init__(self, path: str, echo):
        self.path, self.echo = path, echo
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close)

    def write(self, record: dict) -> None:
        if self.file is None:
            return
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as e:
            self.echo(
                f"warning: --metrics {self.path}: {e.strerror or e} at step {record.get('step')}; "
                "no more metrics are written there, training goes on"
            )
            self.close()

    def close(self) -> None:
        if self.file is not None:
            file, self.file = self.file, None
            try:
                file.close()
            except OSError:  # (the unwritten rest of the failed line)
                pass


class TokenisingBar:
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
