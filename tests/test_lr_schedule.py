"""Learning-rate schedules: the rates are transformers', bit for bit; ``Engine.set_lr`` reaches
every chunk's step (the CPU worker's included) exactly as plain PyTorch's param group does; the
rate and the schedule live in checkpoints and a resume continues them; bad flags are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from protrain.planner.commands.lr_schedule import SCHEDULES, Flags, LrSchedule
from protrain.planner.commands.lr_schedule import resolve as resolve_schedule

PLAN = str(Path(__file__).resolve().parents[1] / "plans/gpt2-tiny/example.json")
QUIET = dict(echo=lambda _: None, progress=False)
COSINE = LrSchedule("cosine", peak_lr=1e-2, total_steps=8, warmup_steps=2, min_lr_rate=0.1)


# -- the table against transformers


def _cases():
    for name, shape in SCHEDULES.items():
        for total in (1, 2, 3, 8, 10, 37, 100):
            for warmup in sorted({0, 1, 2, total // 3, total}):
                for floor in (0.0, 0.1, 0.5, 1.0) if shape.floor else (0.0,):
                    yield name, total, warmup, floor


def test_every_rate_equals_transformers_get_scheduler():
    """Each (schedule, warm-up, total, floor) and each step, past the end too: the rate of step k
    is the float LambdaLR gives the optimizer before its k-th step, to the last bit."""
    transformers = pytest.importorskip("transformers")
    compared = 0
    for name, total, warmup, floor in _cases():
        for peak in (3e-3, 1e-4, 0.7):
            ours = LrSchedule(name, peak, total, warmup, floor)
            # the table's transformers name, and the plain names it equals where it should
            names = [SCHEDULES[name].transformers]
            names += ["constant"] if name == "constant" and not warmup else []
            names += ["cosine"] if name == "cosine" and not floor else []
            for hf_name in names:
                param = torch.nn.Parameter(torch.zeros(1))
                opt = torch.optim.SGD([param], lr=peak)
                kwargs = {"min_lr_rate": floor} if hf_name == "cosine_with_min_lr" else None
                sched = transformers.get_scheduler(
                    hf_name,
                    opt,
                    num_warmup_steps=warmup,
                    num_training_steps=total,
                    scheduler_specific_kwargs=kwargs,
                )
                for step in range(1, total + 3):
                    want = opt.param_groups[0]["lr"]
                    got = ours.rate(step)
                    assert float(got).hex() == float(want).hex(), (hf_name, total, warmup, step)
                    compared += 1
                    opt.step()
                    sched.step()
    assert compared > 5000  # (the loops ran)


def test_warmup_ratio_rounds_up_as_transformers():
    """``math.ceil(R × total)``: TrainingArguments.get_warmup_steps for a ratio."""
    assert Flags(warmup_ratio=0.1).warmup(25) == 3
    assert Flags(warmup_ratio=0.0).warmup(25) == 0
    assert resolve_schedule(Flags(name="linear", warmup_ratio=0.25), 8).warmup_steps == 2
