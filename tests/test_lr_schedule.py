"""Learning-rate schedules: the rates are transformers', bit for bit; ``Engine.set_lr`` reaches
every chunk's step (the CPU worker's included) exactly as plain PyTorch's param group does; the
rate and the schedule live in checkpoints and a resume continues them; bad flags are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import assert_same_state, lockstep, make_model, make_plan, sleeper
from test_parity import _plan

from protrain.executor import AdamWConfig, wrap
from protrain.executor.checkpoint import decode_manifest, read_manifest, resolve
from protrain.planner.commands.lr_schedule import SCHEDULES, Flags, LrSchedule
from protrain.planner.commands.lr_schedule import resolve as resolve_schedule
from protrain.planner.models.data import batches, load_tokens
from protrain.plans.errors import CheckpointError, ConfigError

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


# -- the engine's rate


@pytest.mark.parametrize(
    "case,delay_s",
    [("mixed", 0.0), ("interleaved", 0.0), ("offloaded-buf2", 0.02), ("mixed", 0.02)],
)
def test_set_lr_reaches_offloaded_chunks_exactly(case, delay_s):
    """Offloaded chunks step on the CPU worker during backward, persistent ones on the device
    after it; each step's rate (a cosine with warm-up: 0 first) must reach both, bit for bit
    against ``torch.optim.AdamW(fused=True)`` given the same rate per step. With the worker
    slowed, step k's CPU steps run after the caller has already set step k+1's rate: they must
    still use step k's (optim.py [Note: learning rate])."""
    rates = [COSINE.rate(k) for k in range(1, 9)]
    run = lockstep(
        "gpt2-4",
        _plan("gpt2-4", case),
        steps=8,
        lrs=rates,
        on_event=sleeper(before_cpu_adam=delay_s) if delay_s else None,
    )
    assert run.losses == run.ref_losses
    assert_same_state(run)
    assert run.engine.lr == rates[-1]
    run.engine.close()


def test_set_lr_refuses_what_trains_nothing_and_a_step_in_flight():
    engine = wrap(make_model("gpt2-4"), _plan("gpt2-4", "mixed"), AdamWConfig(lr=1e-3), "cpu")
    try:
        for bad in (float("nan"), float("inf"), -1e-3, "1e-3", True, None):
            with pytest.raises(ConfigError, match="learning rate"):
                engine.set_lr(bad)
        assert engine.lr == 1e-3
        engine.set_lr(0)  # a warm-up's first step
        assert engine.lr == 0.0
        engine.on_event(lambda ev: engine.set_lr(1.0) if ev.kind == "step" else None)
        with pytest.raises(ConfigError, match="while a step is running"):
            engine.step(next(batches(load_tokens(), 4, 32, 0)))
        assert engine.lr == 0.0
    finally:
        engine.close()


def test_checkpoint_saves_and_restores_the_rate(tmp_path):
    plan = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep")
    engine = wrap(make_model("gpt2-4"), plan, AdamWConfig(lr=1e-3), "cpu")
    engine.set_lr(2.5e-4)
    engine.step(next(batches(load_tokens(), 4, 32, 0)))
    engine.save(tmp_path, lr_schedule=COSINE.saved())
    engine.close()
    manifest = read_manifest(resolve(tmp_path))
    assert manifest.lr == 2.5e-4 and manifest.lr_schedule == COSINE.saved()
    engine = wrap(make_model("gpt2-4", seed=7), plan, AdamWConfig(lr=1e-3), "cpu")
    try:
        assert engine.load(tmp_path).lr_schedule == COSINE.saved()
        assert engine.lr == 2.5e-4
    finally:
        engine.close()
    raw = (resolve(tmp_path) / "manifest.json").read_bytes()
    with pytest.raises(CheckpointError, match="learning rate"):
        decode_manifest(raw.replace(b'"lr": 0.00025', b'"lr": -1.0'))
