"""``protrain`` behaves like a Unix tool (issue 32): quiet on a closed pipe, a progress bar on a
terminal and lines through a pipe, one note for a plan made for another machine, the
optimizer's settings as options, and the smaller edges a user met. Each test failed before
its fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from clihelpers import EXAMPLE, PROTRAIN, TRAIN, no_traceback, run

from protrain.planner.commands.cli import main


@pytest.mark.parametrize(
    "args",
    [
        ["models"],
        ["plan", "--model", "gpt2", "--hardware", "rtx3090", "--batch", "1", "--seq", "128"],
        ["fit", "--hardware", "rtx3090", "--seq", "512"],
    ],
    ids=["models", "plan", "fit"],
)
def test_a_closed_pipe_exits_quietly(tmp_path, args):
    """`protrain models | head -1`: the reader is gone before the first write; exit 0 or 141,
    stderr empty."""
    if args[0] == "plan":
        args = [*args, "-o", str(tmp_path / "plan.json")]
    p = subprocess.Popen(
        [*PROTRAIN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path
    )
    p.stdout.close()  # long before the interpreter has started: every write meets a closed pipe
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) in (0, 141) and err == "", (p.returncode, err)


def _under_a_terminal(args: list[str], cwd, timeout: float = 300, columns: int = 120) -> str:
    """What a user sees running ``protrain ARGS`` in a terminal: stdout and stderr on a
    pseudo-terminal."""
    import pty
    import select
    import time

    main_fd, tty = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": str(columns), "LINES": "40"}
    p = subprocess.Popen(
        [*PROTRAIN, *args], stdin=tty, stdout=tty, stderr=tty, cwd=cwd, env=env, close_fds=True
    )
    os.close(tty)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([main_fd], [], [], 1.0)[0]:
                try:
                    chunk = os.read(main_fd, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif p.poll() is not None:
                break
    finally:
        os.close(main_fd)
        p.wait(timeout=60)
    assert p.returncode == 0, out.decode(errors="replace")
    return out.decode(errors="replace")


@pytest.mark.slow
def test_train_draws_its_progress_bar_on_a_terminal_and_log_lines_through_a_pipe(tmp_path):
    shown = _under_a_terminal([*TRAIN, "--steps", "3"], tmp_path)
    assert "━" in shown and "3/3" in shown, shown  # rich's bar and its M/N column
    assert "step     1  loss" not in shown  # the bar, not the log lines
    piped = subprocess.run(
        [*PROTRAIN, *TRAIN, "--steps", "3"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert piped.returncode == 0, piped.stderr
    assert "━" not in piped.stdout and "\x1b" not in piped.stdout
    assert [x.split()[1] for x in piped.stdout.splitlines() if x.startswith("step ")] == ["1", "3"]


@pytest.mark.slow
def test_the_progress_bar_keeps_its_step_count_and_eta_at_80_columns(tmp_path):
    # Issue 39: at 80 columns rich's layout cut the count and the time left to "1…" and
    # "-:-…" to make room for the status; the bar now shrinks first, then the status.
    import re

    shown = _under_a_terminal([*TRAIN, "--steps", "3"], tmp_path, columns=80)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown).replace("\r", "\n")
    last = [line for line in text.splitlines() if line.startswith("train ")][-1]
    assert " 3/3 " in last and re.search(r"\d:\d\d:\d\d$", last.rstrip()), last
    assert len(last.rstrip()) <= 80, last


@pytest.mark.parametrize("columns", [40, 60, 80, 120])
def test_the_progress_bar_shrinks_before_the_count_and_eta(columns):
    import io
    import re

    from rich.console import Console

    from protrain.planner.commands.progress import ProgressBar

    out = io.StringIO()
    console = Console(file=out, width=columns, force_terminal=True, color_system=None)
    bar = ProgressBar(1000, 136, console=console)
    bar.progress.auto_refresh = False
    bar.start()
    bar.advance("loss 5.5123  12,345 tok/s  peak 4.35 MiB / predicted 4.35 MiB")
    bar.progress.refresh()
    bar.stop()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue()).replace("\r", "\n")
    line = [x for x in text.splitlines() if x.strip()][-1].rstrip()
    assert len(line) < columns and " 137/1000 loss 5.5" in line, line
    assert line.endswith("-:--:--") or re.search(r"\d:\d\d:\d\d$", line), line
    if columns >= 120:
        assert "━" in line and "predicted 4.35 MiB" in line  # room for all: nothing cut


def test_a_plan_for_another_machine_says_so_once_at_the_start(tmp_path):
    plan = tmp_path / "plan.json"
    assert (
        run(
            "plan",
            "--model",
            "gpt2-tiny",
            "--hardware",
            "rtx4090",
            "--batch",
            "2",
            "--seq",
            "32",
            "-o",
            plan,
        ).exit_code
        == 0
    )
    r = run("train", "--plan", plan, "--model", "gpt2-tiny", "--steps", "2", "--log-every", "1")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    notes = [x for x in lines if "was made for rtx4090" in x]
    assert len(notes) == 1 and lines.index(notes[0]) < min(
        i for i, x in enumerate(lines) if x.startswith("step")
    )
    assert "predicted times and peak are rtx4090's, not this machine's" in notes[0]
    # A plan that recorded no machine (the example, made by hand) says nothing.
    assert "was made for" not in run(*TRAIN, "--steps", "1").output


def test_a_plan_for_this_machine_says_nothing(monkeypatch):
    import msgspec
    import torch

    from protrain import plans
    from protrain.planner.commands.preflight import other_machine
    from protrain.planner.hardware import probe as hardware
    from protrain.plans import plan as P

    plan = plans.load(EXAMPLE)
    total = 24 << 30
    monkeypatch.setattr(hardware, "_host_memory", lambda: (total, total))
    here = msgspec.structs.replace(
        plan, hardware=P.Hardware(name="cpu", device_memory_bytes=total - (1 << 30))
    )
    assert other_machine(here, "cpu") is None
    small = msgspec.structs.replace(
        plan, hardware=P.Hardware(name="cpu", device_memory_bytes=8 << 30)
    )
    assert "was made for cpu" in other_machine(small, "cpu")
    if not torch.cuda.is_available():
        assert "was made for h100" in other_machine(
            msgspec.structs.replace(
                plan, hardware=P.Hardware(name="h100", device_memory_bytes=total)
            ),
            "cpu",
        )


def test_adamw_settings_are_options_reach_the_optimizer_and_head_the_run(monkeypatch):
    import protrain.planner.commands.train as T

    seen = []
    real = T.wrap

    def spy(model, plan, config, device=None, nvme_dir=None):
        seen.append(config)
        return real(model, plan, config, device=device, nvme_dir=nvme_dir)

    monkeypatch.setattr(T, "wrap", spy)
    r = run(*TRAIN, "--steps", "1")
    assert r.exit_code == 0, r.output
    assert (seen[-1].weight_decay, seen[-1].betas, seen[-1].eps) == (
        0.01,
        (0.9, 0.999),
        1e-8,
    )  # as before
    assert "optim    AdamW lr 0.003, betas (0.9, 0.999), eps 1e-08, weight decay 0.01" in r.output
    r = run(
        *TRAIN, "--steps", "1", "--weight-decay", "0", "--betas", "0.8", "0.95", "--eps", "1e-6"
    )
    assert r.exit_code == 0, r.output
    assert (seen[-1].weight_decay, seen[-1].betas, seen[-1].eps) == (0.0, (0.8, 0.95), 1e-6)
    assert "optim    AdamW lr 0.003, betas (0.8, 0.95), eps 1e-06, weight decay 0" in r.output
    for bad in (["--betas", "1", "0.9"], ["--eps", "0"], ["--weight-decay", "-1"]):
        assert run(*TRAIN, "--steps", "1", *bad).exit_code == 2


def test_one_step_saved_after_its_line_and_units_named_right(tmp_path):
    r = run(*TRAIN, "--steps", "1", "--save-dir", tmp_path / "ck")
    assert r.exit_code == 0, r.output
    assert "trained 1 step in" in r.output
    lines = r.output.splitlines()
    step = next(i for i, x in enumerate(lines) if x.startswith("step     1  loss"))
    saved = next(i for i, x in enumerate(lines) if x.startswith("saved "))
    assert step < saved, r.output
    plan = tmp_path / "plan.json"
    assert (
        run(
            "plan",
            "--model",
            "gpt2-tiny",
            "--hardware",
            "cpu",
            "--batch",
            "2",
            "--seq",
            "32",
            "-o",
            plan,
        ).exit_code
        == 0
    )
    shown = run("show", plan).output
    assert " t_bwd " in shown and "_us" not in shown, shown


def test_a_model_directory_without_a_tokenizer_says_what_byte_level_means(tmp_path):
    pytest.importorskip("transformers")
    import transformers

    transformers.AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=256,
        max_position_embeddings=64,
    ).save_pretrained(tmp_path / "m")
    plan = tmp_path / "plan.json"
    r = run(
        "plan",
        "--hf-config",
        tmp_path / "m",
        "--hardware",
        "cpu",
        "--batch",
        "1",
        "--seq",
        "16",
        "--dtype",
        "float32",
        "-o",
        plan,
    )
    assert r.exit_code == 0, r.output
    r = run("train", "--plan", plan, "--hf-config", tmp_path / "m", "--steps", "1")
    assert r.exit_code == 0, r.output
    assert (
        "holds no tokenizer" in r.output and "each byte of the UTF-8 text is one token" in r.output
    )
    assert "--tokenizer DIR" in r.output
    quiet = run(
        "train",
        "--plan",
        plan,
        "--hf-config",
        tmp_path / "m",
        "--steps",
        "1",
        "--tokenizer",
        "bytes",
    )
    assert "holds no tokenizer" not in quiet.output


def test_plan_saves_the_profile_explain_needs_for_a_trace_and_a_plot(tmp_path):
    from protrain.planner.views.trace import validate_trace

    plan, profile = tmp_path / "plan.json", tmp_path / "profile.json"
    r = run("explain", EXAMPLE, "--trace", tmp_path / "t.json")
    assert "--save-profile" in r.output  # the hint names the way to get one
    r = run(
        "plan",
        "--model",
        "gpt2-tiny",
        "--hardware",
        "cpu",
        "--batch",
        "2",
        "--seq",
        "32",
        "-o",
        plan,
        "--save-profile",
        profile,
    )
    assert r.exit_code == 0, r.output
    r = run("explain", plan, "--profile", profile, "--trace", tmp_path / "t.json")
    assert r.exit_code == 0, r.output
    validate_trace(json.loads((tmp_path / "t.json").read_text()))
    r = run(
        "plan",
        "--profile",
        profile,
        "-o",
        tmp_path / "again.json",
        "--save-profile",
        tmp_path / "p2.json",
    )
    no_traceback(r)
    assert "the profile is" in r.output and not (tmp_path / "p2.json").exists()


def test_explain_plot_without_matplotlib_fails_before_printing_or_writing(tmp_path, monkeypatch):
    plan, profile = tmp_path / "plan.json", tmp_path / "profile.json"
    assert (
        run(
            "plan",
            "--model",
            "gpt2-tiny",
            "--hardware",
            "cpu",
            "--batch",
            "2",
            "--seq",
            "32",
            "-o",
            plan,
            "--save-profile",
            profile,
        ).exit_code
        == 0
    )
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    r = run(
        "explain",
        plan,
        "--profile",
        profile,
        "--trace",
        tmp_path / "t.json",
        "--plot",
        tmp_path / "m.png",
    )
    no_traceback(r)
    assert r.output.startswith("error: plotting needs matplotlib"), r.output  # no report first
    assert not (tmp_path / "t.json").exists() and not (tmp_path / "m.png").exists()


def test_plan_announces_its_slow_phases_on_a_terminal(tmp_path):
    shown = _under_a_terminal(
        [
            "plan",
            "--model",
            "gpt2-tiny",
            "--hardware",
            "a100-80g",
            "--batch",
            "2",
            "--seq",
            "32",
            "-o",
            str(tmp_path / "plan.json"),
        ],
        tmp_path,
    )
    lines = shown.splitlines()
    first = next(
        i for i, x in enumerate(lines) if "profile  gpt2-tiny: loading torch and the model" in x
    )
    search = next(i for i, x in enumerate(lines) if "searching for the fastest plan under a" in x)
    assert first < search < next(i for i, x in enumerate(lines) if "searched" in x)
    # Not a terminal (a log, a pipe, a test's capture): stdout and stderr carry no progress lines.
    r = CliRunner().invoke(
        main,
        [
            "plan",
            "--model",
            "gpt2-tiny",
            "--hardware",
            "a100-80g",
            "--batch",
            "2",
            "--seq",
            "32",
            "-o",
            str(tmp_path / "plan.json"),
        ],
    )
    assert r.exit_code == 0 and "loading torch" not in r.output, r.output


def test_readme_pins_torch_as_ci_does():
    import re

    root = Path(__file__).resolve().parent.parent
    pinned = re.search(r"pip install -q (torch==[\w.]+)", (root / ".ci" / "run").read_text()).group(
        1
    )
    readme = (root / "README.md").read_text()
    lines = [x for x in readme.splitlines() if x.startswith("pip install torch")]
    assert lines and all(x.startswith(f"pip install {pinned}") for x in lines), lines
    assert (
        f"`pip install {pinned}`" in readme
    )  # the route without PyTorch's index, as CI installs it


def test_hf_config_names_a_shipped_config_when_no_such_path_exists(tmp_path, monkeypatch):
    """``--hf-config mixtral-8x7b`` from any directory is the config shipped in plans/configs
    (what an installed wheel has; tests/test_wheel.py runs it there); a path that exists wins,
    and a name with a separator is never looked up among the shipped ones."""
    from protrain.planner.models.hf import config_path
    from protrain.planner.shipped import plans_dir

    monkeypatch.chdir(tmp_path)
    assert config_path("mixtral-8x7b") == plans_dir() / "configs" / "mixtral-8x7b"
    (tmp_path / "mixtral-8x7b").mkdir()
    assert config_path("mixtral-8x7b") == tmp_path / "mixtral-8x7b"
    traversal = "../configs/mixtral-8x7b"  # (from plans/configs it would reach a shipped config)
    assert config_path(traversal) == (tmp_path / traversal).resolve()
    assert config_path("no-such-config") == tmp_path / "no-such-config"
