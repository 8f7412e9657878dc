"""`protrain train --save-every K --save-dir D` / `--resume D`: a resumed run continues
the uninterrupted run's losses bit for bit on CPU; Ctrl-C checkpoints and stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from protrain.executor.checkpoint import read_manifest, resolve
from protrain.planner.commands.train import train
from protrain.plans.errors import ConfigError

PLAN = str(Path(__file__).resolve().parents[1] / "plans/gpt2-tiny/example.json")
QUIET = dict(echo=lambda _: None, progress=False)


def test_resume_continues_the_same_losses(tmp_path):
    full = train(PLAN, "gpt2-tiny", steps=6, **QUIET)
    first = train(PLAN, "gpt2-tiny", steps=4, save_every=2, save_dir=str(tmp_path), **QUIET)
    assert first == full[:4]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".lock",
        "latest",
        "step-00000002",
        "step-00000004",
    ]
    rest = train(PLAN, "gpt2-tiny", steps=6, resume=str(tmp_path), **QUIET)
    assert rest == full[4:]


def test_save_every_needs_a_directory():
    with pytest.raises(ConfigError, match="--save-dir"):
        train(PLAN, "gpt2-tiny", steps=2, save_every=1, **QUIET)


def test_ctrl_c_checkpoints_then_stops(tmp_path):
    out = tmp_path / "ck"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "protrain.planner",
            "train",
            "--plan",
            PLAN,
            "--model",
            "gpt2-tiny",
            "--steps",
            "100000",
            "--save-every",
            "3",
            "--save-dir",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 120
    while not (out / "latest").exists():  # the loop is running once the first checkpoint is
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    text, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, text  # 128 + SIGINT, as shells report an interrupted command
    assert "interrupted after step" in text and "--resume" in text
    step = int(text.split("interrupted after step ")[1].split(";")[0])
    assert read_manifest(resolve(out)).step == step >= 1
