"""The command line: --help of every command, exit codes, messages, the frozen option set."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from protrain.planner.commands.cli import main

EXAMPLE = Path(__file__).resolve().parent.parent / "plans" / "gpt2-tiny" / "example.json"

# Adding, removing or renaming an option is a visible diff here (torchtitan's
# test_no_new_cli_options): the CLI is an interface users script against.
FROZEN_OPTIONS = {
    "": ["--debug", "--help", "--version"],
    "data": [
        "--chat-template",
        "--data",
        "--epochs",
        "--eval-split",
        "--help",
        "--hf-config",
        "--json",
        "--limit",
        "--loss-on",
        "--packing",
        "--plan",
        "--seed",
        "--seq",
        "--steps",
        "--text-field",
    ],
    "diff": ["--help", "--json"],
    "explain": ["--help", "--plot", "--profile", "--trace"],
    "export": [
        "--blocks",
        "--help",
        "--hf-config",
        "--lora",
        "--lora-alpha",
        "--lora-dropout",
        "--lora-r",
        "--lora-targets",
        "--output",
        "--resume",
        "--tokenizer",
    ],
    "fit": [
        "--blocks",
        "--budget",
        "--hardware",
        "--help",
        "--hf-config",
        "--host-memory",
        "--lora",
        "--lora-alpha",
        "--lora-dropout",
        "--lora-r",
        "--lora-targets",
        "--model",
        "--nvme",
        "--seq",
        "--world-size",
    ],
    "hardware": ["--help"],
    "hardware probe": ["--device", "--help", "--nvme", "--output", "--quick"],
    "models": ["--help"],
    "plan": [
        "--batch",
        "--blocks",
        "--budget",
        "--device",
        "--dtype",
        "--grad-accum",
        "--hardware",
        "--help",
        "--hf-config",
        "--host-memory",
        "--lora",
        "--lora-alpha",
        "--lora-dropout",
        "--lora-r",
        "--lora-targets",
        "--max-grad-norm",
        "--model",
        "--nvme",
        "--output",
        "--profile",
        "--reprobe",
        "--save-profile",
        "--seq",
        "--solver",
        "--world-size",
    ],
    "profile": [
        "--analytic",
        "--batch",
        "--blocks",
        "--device",
        "--dtype",
        "--hardware",
        "--help",
        "--hf-config",
        "--iterations",
        "--model",
        "--output",
        "--reprobe",
        "--seq",
    ],
    "quickstart": ["--budget", "--data", "--help", "--model", "--out", "--seed", "--steps"],
    "show": ["--help"],
    "train": [
        "--betas",
        "--blocks",
        "--chat-template",
        "--data",
        "--epochs",
        "--eps",
        "--eval-data",
        "--eval-every",
        "--eval-split",
        "--export",
        "--export-merged",
        "--help",
        "--hf-config",
        "--keep",
        "--log-every",
        "--lora",
        "--lora-alpha",
        "--lora-dropout",
        "--lora-r",
        "--lora-targets",
        "--loss-on",
        "--lr",
        "--lr-schedule",
        "--max-grad-norm",
        "--metrics",
        "--min-lr-rate",
        "--model",
        "--nvme",
        "--overwrite",
        "--packing",
        "--plan",
        "--resume",
        "--save-dir",
        "--save-every",
        "--seed",
        "--steps",
        "--text-field",
        "--timeout",
        "--tokenizer",
        "--trace",
        "--warmup-ratio",
        "--warmup-steps",
        "--weight-decay",
    ],
    "tokenize": ["--data", "--help", "--output", "--text-field", "--tokenizer"],
    "validate": ["--help", "--model"],
}


def _options(cmd: click.Command) -> list[str]:
    ctx = click.Context(cmd)
    return sorted(o for p in cmd.get_params(ctx) for o in p.opts if o.startswith("--"))


def test_option_set_is_frozen():
    got = {"": _options(main)}
    for name, cmd in main.commands.items():
        got[name] = _options(cmd)
        for sub, subcmd in getattr(cmd, "commands", {}).items():
            got[f"{name} {sub}"] = _options(subcmd)
    assert got == FROZEN_OPTIONS


@pytest.mark.parametrize("command", ["", *sorted(FROZEN_OPTIONS.keys() - {""})])
def test_help_of_every_command(command):
    result = CliRunner().invoke(main, [*command.split(), "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_models_lists_every_size():
    from protrain.planner.models.zoo import ZOO

    result = CliRunner().invoke(main, ["models"])
    assert result.exit_code == 0, result.output
    for name in ZOO:
        assert f"\n{name} " in result.output
    assert "124.44M" in result.output and "68.98B" in result.output


def test_show_summarises_the_plan():
    result = CliRunner().invoke(main, ["show", str(EXAMPLE)])
    assert result.exit_code == 0, result.output
    assert "gpt2-tiny" in result.output and "C K" in result.output
    assert "1 persistent [0], 2 offloaded, 2 device buffers" in result.output


def test_validate_accepts_the_example_and_checks_the_fingerprint():
    result = CliRunner().invoke(main, ["validate", str(EXAMPLE), "--model", "gpt2-tiny"])
    assert result.exit_code == 0, result.output
    assert "fingerprint matches gpt2-tiny" in result.output
    # Without --model only the file is read (no torch): it says so and how to check more.
    result = CliRunner().invoke(main, ["validate", str(EXAMPLE)])
    assert result.exit_code == 0, result.output
    assert "fingerprint not checked" in result.output and "--model gpt2-tiny" in result.output


def test_validate_refuses_another_model_with_the_differences():
    result = CliRunner().invoke(main, ["validate", str(EXAMPLE), "--model", "llama-tiny"])
    assert result.exit_code == 1
    assert "made for another model" in result.output and "missing in the model" in result.output
    assert "Traceback" not in result.output


def test_bad_plan_is_one_paragraph_and_exit_1(tmp_path):
    doc = json.loads(EXAMPLE.read_bytes())
    doc["placement"]["n_buffer"] = "two"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    result = CliRunner().invoke(main, ["show", str(bad)])
    assert result.exit_code == 1
    assert result.output.startswith("error: ") and "$.placement.n_buffer" in result.output
    assert "HINT:" in result.output and "Traceback" not in result.output


def test_debug_shows_the_exception(tmp_path):
    result = CliRunner().invoke(main, ["--debug", "show", str(tmp_path / "missing.json")])
    assert result.exit_code != 0 and result.exception is not None


def test_unknown_model_suggests_a_name():
    result = CliRunner().invoke(main, ["validate", str(EXAMPLE), "--model", "gpt2-tinyy"])
    assert result.exit_code == 1 and "did you mean 'gpt2-tiny'?" in result.output


def test_usage_error_exits_2():
    assert CliRunner().invoke(main, ["show"]).exit_code == 2


def test_quickstart_profiles_plans_and_trains(tmp_path):
    result = CliRunner().invoke(main, ["quickstart", "--steps", "20", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "gpt2-tiny.profile.json").exists() and (
        tmp_path / "gpt2-tiny.plan.json"
    ).exists()
    from protrain import plans

    plan = plans.load(tmp_path / "gpt2-tiny.plan.json")
    # The default budget (60% of the fastest plan's peak) forces a trade: offload, swap or
    # recompute.
    assert plan.placement.offloaded or any(a.policy != "keep" for a in plan.activations)
    assert (
        "the predicted peak of the fastest plan" in result.output
        and "keeping everything" not in result.output
    )
    first, last = result.output.split("trained 20 steps")[1].split("loss ")[1].split(" → ")
    assert float(last.strip()) < float(first)
    # The measured peak equals the prediction on CPU (the ledger model is exact there).
    line = [x for x in result.output.splitlines() if x.startswith("step    20")][0]
    peak, predicted = line.split("peak ")[1].split(" / predicted ")
    assert peak.strip() == predicted.strip()


def test_quickstart_missing_data_file(tmp_path):
    result = CliRunner().invoke(main, ["quickstart", "--data", str(tmp_path / "none.txt")])
    assert result.exit_code == 1 and "none.txt" in result.output


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("p") / "gpt2-tiny.profile.json"
    r = CliRunner().invoke(
        main,
        [
            "profile",
            "--model",
            "gpt2-tiny",
            "--batch",
            "2",
            "--seq",
            "32",
            "--device",
            "cpu",
            "--hardware",
            "cpu",
            "--iterations",
            "1",
            "-o",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    return out


def test_plan_explain_and_train_from_a_profile(tiny_profile, tmp_path):
    plan = tmp_path / "plan.json"
    r = CliRunner().invoke(
        main, ["plan", "--profile", str(tiny_profile), "--budget", "2MiB", "-o", str(plan)]
    )
    assert r.exit_code == 0, r.output
    assert "searched" in r.output
    again = tmp_path / "again.json"
    CliRunner().invoke(
        main, ["plan", "--profile", str(tiny_profile), "--budget", "2MiB", "-o", str(again)]
    )
    assert plan.read_bytes() == again.read_bytes()  # planning is deterministic
    r = CliRunner().invoke(main, ["explain", str(plan)])
    assert r.exit_code == 0 and "runners-up" in r.output and "Pareto front" in r.output
    r = CliRunner().invoke(
        main, ["train", "--plan", str(plan), "--model", "gpt2-tiny", "--steps", "3"]
    )
    assert r.exit_code == 0, r.output
    assert "trained 3 steps" in r.output


def test_plan_with_clipping_runs_cpu_adam_after_backward(tiny_profile, tmp_path):
    from protrain import plans

    base, clip = tmp_path / "base.json", tmp_path / "clip.json"
    args = ["plan", "--profile", str(tiny_profile), "--budget", "2MiB"]
    assert CliRunner().invoke(main, [*args, "-o", str(base)]).exit_code == 0
    r = CliRunner().invoke(main, [*args, "--max-grad-norm", "1.0", "-o", str(clip)])
    assert r.exit_code == 0, r.output
    assert (
        "cpu adam      after backward (clipping to 1 requested)" in r.output
    )  # the `show` it prints
    a, b = plans.load(base), plans.load(clip)
    assert a.schedule.cpu_adam == "during_backward" and a.request.max_grad_norm is None
    assert b.schedule.cpu_adam == "after_backward" and b.request.max_grad_norm == 1.0
    assert b.prediction.iter_time_us >= a.prediction.iter_time_us
    r = CliRunner().invoke(main, ["explain", str(clip)])
    assert r.exit_code == 0 and "T_iter = T_fwd + T_bwd + max(T_gpu_optim, T_cpu_optim)" in r.output
    r = CliRunner().invoke(main, ["diff", str(base), str(clip)])
    assert (
        r.exit_code == 1
        and "cpu_adam" in r.output
        and "during_backward → after_backward" in r.output
    )


@pytest.mark.parametrize(
    "value,code,words",
    [
        ("0", 2, "x>0"),
        ("-1", 2, "x>0"),
        ("nan", 2, "not a finite number"),  # (a usage error, as every float flag's: floats.py)
        ("inf", 2, "not a finite number"),
    ],
)
def test_plan_refuses_a_bad_max_grad_norm(tiny_profile, tmp_path, value, code, words):
    r = CliRunner().invoke(
        main,
        [
            "plan",
            "--profile",
            str(tiny_profile),
            "--max-grad-norm",
            value,
            "-o",
            str(tmp_path / "x.json"),
        ],
    )
    assert r.exit_code == code and words in r.output, r.output
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("budget", ["lots", "-3GiB", "20 GiBs", "0"])
def test_unparseable_budget_is_one_line(tiny_profile, tmp_path, budget):
    r = CliRunner().invoke(
        main,
        [
            "plan",
            "--profile",
            str(tiny_profile),
            "--budget",
            budget,
            "-o",
            str(tmp_path / "x.json"),
        ],
    )
    assert r.exit_code == 1 and "cannot read the budget" in r.output and "HINT:" in r.output


def test_no_feasible_plan_is_one_line(tiny_profile, tmp_path):
    r = CliRunner().invoke(
        main,
        [
            "plan",
            "--profile",
            str(tiny_profile),
            "--budget",
            "100KiB",
            "-o",
            str(tmp_path / "x.json"),
        ],
    )
    assert r.exit_code == 1 and "fits" in r.output and "--budget" in r.output
    assert not (tmp_path / "x.json").exists()


def test_profile_for_another_model_or_shape_is_refused(tiny_profile, tmp_path):
    r = CliRunner().invoke(
        main,
        [
            "plan",
            "--profile",
            str(tiny_profile),
            "--model",
            "llama-tiny",
            "-o",
            str(tmp_path / "x.json"),
        ],
    )
    assert r.exit_code == 1 and "is a profile of gpt2-tiny, not of llama-tiny" in r.output
    r = CliRunner().invoke(
        main,
        ["plan", "--profile", str(tiny_profile), "--batch", "8", "-o", str(tmp_path / "x.json")],
    )
    assert r.exit_code == 1 and "profiled with --batch 2, not 8" in r.output


def test_train_refuses_a_plan_for_another_model(tiny_profile, tmp_path):
    plan = tmp_path / "plan.json"
    CliRunner().invoke(main, ["plan", "--profile", str(tiny_profile), "-o", str(plan)])
    r = CliRunner().invoke(
        main, ["train", "--plan", str(plan), "--model", "llama-tiny", "--steps", "1"]
    )
    assert r.exit_code == 1 and "made for another model" in r.output


def test_diff_exit_codes(tmp_path):
    import msgspec

    from protrain import plans
    from protrain.plans import plan as P

    same = CliRunner().invoke(main, ["diff", str(EXAMPLE), str(EXAMPLE)])
    assert same.exit_code == 0 and "plans are equal" in same.output
    plan = plans.load(EXAMPLE)
    other = tmp_path / "other.json"
    acts = [msgspec.structs.replace(a, policy="keep") for a in plan.activations]
    other.write_bytes(P.dump(msgspec.structs.replace(plan, activations=acts)))
    differ = CliRunner().invoke(main, ["diff", str(EXAMPLE), str(other)])
    assert differ.exit_code == 1 and "^" in differ.output
    js = CliRunner().invoke(main, ["diff", "--json", str(EXAMPLE), str(other)])
    assert js.exit_code == 1 and json.loads(js.output)["equal"] is False
    bad = CliRunner().invoke(main, ["diff", str(EXAMPLE), str(tmp_path / "missing.json")])
    assert bad.exit_code == 2 and "missing.json" in bad.output


def test_explain_trace_and_train_trace(tiny_profile, tmp_path):
    from protrain.planner.views.trace import validate_trace

    plan = tmp_path / "plan.json"
    CliRunner().invoke(
        main, ["plan", "--profile", str(tiny_profile), "--budget", "2MiB", "-o", str(plan)]
    )
    r = CliRunner().invoke(main, ["explain", str(plan), "--trace", str(tmp_path / "t.json")])
    assert r.exit_code == 1 and "--profile" in r.output
    r = CliRunner().invoke(
        main,
        ["explain", str(plan), "--profile", str(tiny_profile), "--trace", str(tmp_path / "t.json")],
    )
    assert r.exit_code == 0, r.output
    validate_trace(json.loads((tmp_path / "t.json").read_text()))
    r = CliRunner().invoke(
        main,
        [
            "train",
            "--plan",
            str(plan),
            "--model",
            "gpt2-tiny",
            "--steps",
            "2",
            "--trace",
            str(tmp_path / "m.json"),
        ],
    )
    assert r.exit_code == 0, r.output
    validate_trace(json.loads((tmp_path / "m.json").read_text()))


# ------------------------------------------------------------------ train: eval and clipping

CLIP_PLAN = Path(__file__).resolve().parent / "fixtures" / "plans" / "v2" / "gpt2-tiny-clip.json"


def test_train_eval_every_prints_held_out_losses():
    r = CliRunner().invoke(
        main,
        [
            "train",
            "--plan",
            str(EXAMPLE),
            "--model",
            "gpt2-tiny",
            "--steps",
            "5",
            "--eval-every",
            "2",
        ],
    )
    assert r.exit_code == 0, r.output
    lines = [x for x in r.output.splitlines() if "held-out loss" in x]
    assert [x.split()[1] for x in lines] == [
        "0",
        "2",
        "4",
    ]  # the start, then every K steps, not at the end
    assert all(0 < float(x.split()[-1]) < 10 for x in lines)
    assert "trained 5 steps" in r.output


def test_train_help_states_the_held_out_split():
    from protrain.planner.models.data import HELDOUT_BATCHES, HELDOUT_FRACTION

    r = CliRunner().invoke(main, ["train", "--help"])
    text = " ".join(r.output.split()).replace("- ", "-")  # (click wraps after a hyphen)
    assert (
        f"over {HELDOUT_BATCHES} fixed micro-batches from the last {HELDOUT_FRACTION:.0%} of "
        "the corpus"
    ) in text
    assert "never sees a held-out token" in text


def test_eval_changes_only_what_training_reads(tmp_path):
    # With --eval-every, training reads the corpus without its tail, and evaluating
    # between steps changes nothing else: the losses equal a run without evaluation on
    # that shortened corpus written to a file (byte-level tokens are the file's bytes).
    import torch

    from protrain.planner.commands.train import train
    from protrain.planner.models.data import load_tokens, split_heldout

    head, _ = split_heldout(load_tokens(), 64)
    path = tmp_path / "head.txt"
    path.write_bytes(bytes(head.tokens.to(torch.uint8).tolist()))
    quiet = dict(echo=lambda _: None, progress=False, device="cpu")
    with_eval = train(str(EXAMPLE), "gpt2-tiny", steps=4, eval_every=1, **quiet)
    plain = train(str(EXAMPLE), "gpt2-tiny", steps=4, data_path=str(path), **quiet)
    assert with_eval == plain


def test_train_max_grad_norm_reaches_the_optimizer(monkeypatch):
    import protrain.planner.commands.train as T

    seen = []
    real = T.wrap

    def spy(model, plan, config, device=None, nvme_dir=None):
        seen.append((plan.schedule.cpu_adam, config.max_grad_norm))
        return real(model, plan, config, device=device, nvme_dir=nvme_dir)

    monkeypatch.setattr(T, "wrap", spy)
    r = CliRunner().invoke(
        main,
        [
            "train",
            "--plan",
            str(CLIP_PLAN),
            "--model",
            "gpt2-tiny",
            "--steps",
            "2",
            "--max-grad-norm",
            "0.5",
        ],
    )
    assert r.exit_code == 0, r.output
    assert seen == [("after_backward", 0.5)]
    r = CliRunner().invoke(
        main,
        [
            "train",
            "--plan",
            str(CLIP_PLAN),
            "--model",
            "gpt2-tiny",
            "--steps",
            "1",
            "--max-grad-norm",
            "0",
        ],
    )
    assert r.exit_code == 2 and "x>0" in r.output


def test_train_max_grad_norm_on_an_overlapping_plan_names_the_fix():
    import protrain.executor.engine as E

    if not hasattr(E, "_check_cpu_adam"):
        pytest.skip("the engine does not check schedule.cpu_adam against clipping yet")
    r = CliRunner().invoke(
        main,
        [
            "train",
            "--plan",
            str(EXAMPLE),
            "--model",
            "gpt2-tiny",
            "--steps",
            "1",
            "--max-grad-norm",
            "1.0",
        ],
    )
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "protrain plan" in r.output and "--max-grad-norm" in r.output


@pytest.mark.parametrize("interrupted,code", [(False, 0), (True, 130)])
def test_a_finished_rank_of_a_multi_rank_run_exits_without_finalisation(
    monkeypatch, interrupted, code
):
    """Under torchrun (WORLD_SIZE > 1) `train` leaves by os._exit once training returned: gloo's
    teardown at interpreter finalisation aborted ~7% of finished ranks (cli_train.py's comment)."""
    import protrain.planner.commands.cli as cli
    import protrain.planner.commands.train as T

    class Done(list):
        pass

    done = Done([1.0])
    done.interrupted = interrupted
    monkeypatch.setattr(T, "train", lambda *a, **k: done)
    exits = []

    def fake_exit(c):
        exits.append(c)
        raise SystemExit(c)

    monkeypatch.setattr(cli.os, "_exit", fake_exit)
    monkeypatch.setenv("WORLD_SIZE", "2")
    r = CliRunner().invoke(
        main, ["train", "--plan", "p.json", "--model", "gpt2-tiny", "--steps", "1"]
    )
    assert exits == [code] and r.exit_code == code
    monkeypatch.setenv("WORLD_SIZE", "1")
    exits.clear()
    r = CliRunner().invoke(
        main, ["train", "--plan", "p.json", "--model", "gpt2-tiny", "--steps", "1"]
    )
    assert exits == [] and r.exit_code == code


def test_explain_says_each_decision_in_plain_words_first():
    # Issue 39: explain spoke only the paper's vocabulary (n_persist, n_buffer, …). Each
    # decision now has one plain sentence with its reason, the paper's symbol after it.
    plan = EXAMPLE.parent.parent / "llama-7b" / "rtx3090-w1.json"
    r = CliRunner().invoke(main, ["explain", str(plan)])
    assert r.exit_code == 0, r.output
    plain = r.output[r.output.index("in plain words") : r.output.index("  time ")]
    chunks, acts, time = [x for x in plain.splitlines() if x.startswith("    - ")]
    assert "29 of 34 chunks of parameters live in host memory" in chunks
    assert "5 stay on the device, because keeping one more there would add about 3.02 GiB" in chunks
    assert chunks.index("because") < chunks.index("[n_persist = 5, n_buffer = 2]")
    assert "16 recompute their activations in backward" in acts and "[n_checkpoint = 16" in acts
    assert "predicted to take 9.54 s" in time and "the CPU sets the pace" in time
