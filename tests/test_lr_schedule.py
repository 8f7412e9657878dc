"""Learning-rate schedules: the rates are transformers', bit for bit; ``Engine.set_lr`` reaches
every chunk's step (the CPU worker's included) exactly as plain PyTorch's param group does; the
rate and the schedule live in checkpoints and a resume continues them; bad flags are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from harness import assert_same_state, lockstep, make_model, make_plan, sleeper
from test_parity import _plan

from protrain.executor import AdamWConfig, wrap
from protrain.executor.checkpoint import decode_manifest, read_manifest, resolve
from protrain.planner.commands.cli import main
from protrain.planner.commands.lr_schedule import SCHEDULES, Flags, LrSchedule
from protrain.planner.commands.lr_schedule import resolve as resolve_schedule
from protrain.planner.commands.train import train
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


def test_help_names_every_schedule():
    out = CliRunner().invoke(main, ["train", "--help"]).output
    for name in SCHEDULES:
        assert name in out


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


# -- protrain train


def _records(path: Path) -> list[dict]:
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return [r for r in lines if "event" not in r]


def test_train_logs_each_steps_rate_and_resumes_the_schedule_exactly(tmp_path):
    """An 8-step cosine run with a 2-step warm-up; resumed from its step-4 checkpoint (flags left
    out: the checkpoint's schedule), steps 5-8 equal the uninterrupted run's, bit for bit."""
    cosine = dict(lr=1e-2, lr_schedule="cosine", warmup_steps=2, min_lr_rate=0.1)
    metrics = tmp_path / "m.jsonl"
    full = train(
        PLAN,
        "gpt2-tiny",
        steps=8,
        save_every=4,
        save_dir=str(tmp_path / "ckpt"),
        metrics_path=str(metrics),
        **cosine,
        **QUIET,
    )
    assert [r["lr"] for r in _records(metrics)] == [COSINE.rate(k) for k in range(1, 9)]
    assert _records(metrics)[0]["lr"] == 0.0
    step4 = str(tmp_path / "ckpt" / "step-00000004")
    assert read_manifest(step4).lr_schedule == COSINE.saved()
    rest = train(PLAN, "gpt2-tiny", steps=8, resume=step4, **QUIET)
    assert rest == full[4:]
    # the schedule is what trained: a constant rate gives other losses
    constant = train(PLAN, "gpt2-tiny", steps=8, lr=1e-2, **QUIET)
    assert constant[2:] != full[2:]


def test_resume_refuses_other_schedule_flags_naming_both(tmp_path):
    train(
        PLAN,
        "gpt2-tiny",
        steps=4,
        save_dir=str(tmp_path),
        lr_schedule="cosine",
        warmup_steps=1,
        **QUIET,
    )
    for flags, words in (
        (dict(lr_schedule="linear"), "--lr-schedule linear.*saved with --lr-schedule cosine"),
        (dict(warmup_steps=2), "--warmup-steps 2.*saved with --warmup-steps 1"),
        (dict(steps=6), "--steps 6.*saved with --steps 4"),
        (dict(min_lr_rate=0.2), "--min-lr-rate 0.2.*saved with --min-lr-rate 0"),
    ):
        kw = dict(steps=4) | flags
        with pytest.raises(ConfigError, match=words):
            train(PLAN, "gpt2-tiny", resume=str(tmp_path), **kw, **QUIET)


def test_resume_of_a_checkpoint_without_a_schedule_takes_the_flags():
    saved = {}  # a checkpoint written before schedules were saved
    got = resolve_schedule(Flags(name="linear", lr=1e-3), 10, saved)
    assert got == LrSchedule("linear", 1e-3, 10)
    # and a constant run may be extended; a new peak is taken, the shape kept
    kept = resolve_schedule(Flags(lr=5e-4), 12, LrSchedule("constant", 1e-3, 8, 2).saved())
    assert kept == LrSchedule("constant", 5e-4, 12, 2)


@pytest.mark.parametrize(
    "flags,words",
    [
        (dict(warmup_steps=2, warmup_ratio=0.1), "--warmup-steps 2 and --warmup-ratio 0.1"),
        (dict(warmup_ratio=1.5), "--warmup-ratio 1.5"),
        (dict(warmup_ratio=-0.1), "--warmup-ratio -0.1"),
        (dict(min_lr_rate=0.1, lr_schedule="linear"), "--lr-schedule linear has none"),
        (dict(min_lr_rate=0.1), "--lr-schedule constant has none"),
        (dict(min_lr_rate=1.5, lr_schedule="cosine"), "--min-lr-rate 1.5"),
        (dict(warmup_steps=9), r"warm-up \(9 steps\) is longer than the run \(--steps 4\)"),
        (dict(lr_schedule="cosin"), "did you mean --lr-schedule cosine"),
    ],
)
def test_bad_flags_are_refused_before_the_build(flags, words):
    with pytest.raises(ConfigError, match=words):
        train(PLAN, "no-such-model", steps=4, **flags, **QUIET)


@pytest.mark.parametrize(
    "args",
    [["--warmup-ratio", "2"], ["--min-lr-rate", "nan"], ["--lr-schedule", "step"]],
)
def test_cli_refuses_out_of_range_values_as_usage_errors(args):
    r = CliRunner().invoke(main, ["train", "--plan", PLAN, "--model", "gpt2-tiny", *args])
    assert r.exit_code == 2, r.output
