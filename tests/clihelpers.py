"""What the CLI edge tests share: the example plan, an in-process ``protrain`` and its check that
no exception escaped, and the command line of a real ``protrain`` process."""

from __future__ import annotations

import sys
from pathlib import Path

from click.testing import CliRunner

from protrain.planner.commands.cli import main

EXAMPLE = Path(__file__).resolve().parent.parent / "plans" / "gpt2-tiny" / "example.json"
TRAIN = ["train", "--plan", str(EXAMPLE), "--model", "gpt2-tiny"]
PROTRAIN = [sys.executable, "-m", "protrain.planner"]


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def no_traceback(r, code: int = 1) -> None:
    """Exit ``code`` through sys.exit, as one paragraph: no exception escaped to click."""
    assert r.exit_code == code, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
