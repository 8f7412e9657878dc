"""Sharp edges a new user hit (issue #18), one test each, and no traceback without --debug.

Each test here failed on 754c22f (the commit before the fixes): a silent wrong result,
a traceback, or an option or message that did not exist.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from clihelpers import EXAMPLE, PROTRAIN, TRAIN, no_traceback, run


@pytest.fixture(scope="module")
def profile_3090(tmp_path_factory):
    out = tmp_path_factory.mktemp("p") / "gpt2-tiny.rtx3090.json"
    r = run(
        "profile",
        "--model",
        "gpt2-tiny",
        "--analytic",
        "--hardware",
        "rtx3090",
        "--batch",
        "2",
        "--seq",
        "32",
        "-o",
        out,
    )
    assert r.exit_code == 0, r.output
    return out


# 1 ---------------------------------------------------------------- budget vs card


@pytest.mark.parametrize("budget", ["70GiB", "1e3TiB"])
def test_budget_larger_than_the_card_is_refused(profile_3090, tmp_path, budget):
    r = run("plan", "--profile", profile_3090, "--budget", budget, "-o", tmp_path / "x.json")
    no_traceback(r)
    assert "exceeds" in r.output and "rtx3090" in r.output and "23.69 GiB" in r.output
    assert not (tmp_path / "x.json").exists()


def test_hardware_next_to_a_profile_is_refused_not_ignored(profile_3090, tmp_path):
    r = run("plan", "--profile", profile_3090, "--hardware", "a100-80g", "-o", tmp_path / "x.json")
    no_traceback(r)
    assert "--hardware a100-80g with --profile" in r.output and "rtx3090" in r.output


# 2 ---------------------------------------------------------------- I/O without tracebacks, paths
# checked first


def test_output_paths_are_checked_before_the_work(profile_3090, tmp_path):
    missing = tmp_path / "missing" / "x.json"
    r = run("plan", "--profile", profile_3090, "-o", missing)
    no_traceback(r)
    assert "does not exist" in r.output and "searched" not in r.output  # refused before the search
    r = run(
        "profile",
        "--model",
        "gpt2-tiny",
        "--analytic",
        "--hardware",
        "cpu",
        "--batch",
        "1",
        "--seq",
        "8",
        "-o",
        missing,
    )
    no_traceback(r)
    r = run("explain", EXAMPLE, "--profile", profile_3090, "--trace", missing)
    no_traceback(r)
    assert r.output.startswith("error: --trace"), r.output  # before the report
    r = run(*TRAIN, "--steps", "1", "--trace", missing)
    no_traceback(r)
    assert "step" not in r.output  # before training, not after it
    (tmp_path / "file").write_text("x")
    r = run("quickstart", "--out", tmp_path / "file" / "q")
    no_traceback(r)
    r = run(*TRAIN, "--steps", "1", "--save-dir", tmp_path / "file" / "ck")
    no_traceback(r)
    assert "--save-dir" in r.output and "step" not in r.output
    r = run("hardware", "probe", "-o", missing)
    no_traceback(r)
    assert (
        "does not exist" in r.output and "probing" not in r.output.lower()
    )  # before the measurements


def test_a_failed_save_cleans_up_and_says_what_it_needed(tmp_path, monkeypatch):
    import errno

    import safetensors.torch

    real = safetensors.torch.save_file

    def full(tensors, path, *a, **k):
        if Path(path).name == "model.safetensors":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    r = run(*TRAIN, "--steps", "2", "--save-dir", tmp_path / "ck")
    no_traceback(r)
    assert "No space left on device" in r.output and "MiB" in r.output and "free" in r.output
    assert not [p for p in (tmp_path / "ck").iterdir() if p.name.startswith(".tmp-")]


# 3 ---------------------------------------------------------------- --save-dir alone saves at the
# end


def test_save_dir_without_save_every_saves_at_the_end(tmp_path):
    r = run(*TRAIN, "--steps", "2", "--save-dir", tmp_path)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"


# 5 ---------------------------------------------------------------- hints


def test_model_mismatch_hint_names_the_model_being_trained():
    r = run("train", "--plan", EXAMPLE, "--model", "llama-tiny", "--steps", "1")
    no_traceback(r)
    assert "protrain plan --model llama-tiny" in r.output and "--model gpt2-tiny …" not in r.output


def test_resolve_hint_names_the_save_dir_flag(tmp_path):
    from protrain.executor.checkpoint import resolve
    from protrain.plans.errors import CheckpointError

    with pytest.raises(CheckpointError) as e:
        resolve(tmp_path)
    assert "--save-dir" in e.value.hint and "--save-every" not in e.value.hint


# 6 ---------------------------------------------------------------- logs for files, metrics for
# scripts


def test_plain_log_lines_and_a_metrics_file(tmp_path):
    metrics = tmp_path / "m.jsonl"
    r = run(*TRAIN, "--steps", "4", "--log-every", "2", "--metrics", metrics, "--eval-every", "2")
    assert r.exit_code == 0, r.output
    steps = [
        int(x.split()[1])
        for x in r.output.splitlines()
        if x.startswith("step") and " loss " in x and "held-out" not in x
    ]
    assert steps == [1, 2, 4]  # the first step, then every K
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [m["step"] for m in records] == [1, 2, 3, 4]
    assert all(m["loss"] > 0 and m["tokens_per_s"] > 0 for m in records)
    assert ["heldout_loss" in m for m in records] == [False, True, False, True]
    # Not a terminal (CliRunner's stdout): plain lines every 10 steps by default, no bar.
    r = run(*TRAIN, "--steps", "11")
    assert [int(x.split()[1]) for x in r.output.splitlines() if x.startswith("step")] == [1, 10, 11]
    assert "━" not in r.output


# 7 ---------------------------------------------------------------- size check before building on
# the CPU


def test_a_model_too_big_for_the_host_is_refused_before_building(monkeypatch):
    import protrain.planner.commands.preflight as pf

    monkeypatch.setattr(pf, "available_host_memory", lambda: 1 << 30)
    r = run("quickstart", "--model", "llama-7b", "--steps", "1")
    no_traceback(r)
    assert "host memory" in r.output and "1.00 GiB is available" in r.output and "GiB" in r.output
    r = run("train", "--plan", EXAMPLE, "--model", "llama-7b", "--steps", "1")
    no_traceback(r)
    assert "host memory" in r.output


# 8 ---------------------------------------------------------------- binary data


def test_binary_data_is_refused(tmp_path):
    blob = tmp_path / "weights.bin"
    blob.write_bytes(bytes(range(256)) * 64)
    r = run(*TRAIN, "--steps", "1", "--data", blob)
    no_traceback(r)
    assert "is not text" in r.output and "NUL" in r.output


# 9 ---------------------------------------------------------------- the rest


def test_resuming_a_finished_run_says_so_and_keep_prunes(tmp_path):
    r = run(*TRAIN, "--steps", "3", "--save-every", "1", "--save-dir", tmp_path, "--keep", "1")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "latest", "step-00000003"]
    r = run(*TRAIN, "--steps", "3", "--resume", tmp_path)
    assert r.exit_code == 0, r.output
    assert "nothing to train" in r.output and "--steps 6" in r.output


def test_hf_plans_name_their_model_from_any_directory(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            dict(
                model_type="llama",
                architectures=["LlamaForCausalLM"],
                vocab_size=256,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                max_position_embeddings=64,
            )
        )
    )
    monkeypatch.chdir(tmp_path)
    r = run(
        "plan",
        "--hf-config",
        "m",
        "--hardware",
        "cpu",
        "--batch",
        "1",
        "--seq",
        "16",
        "-o",
        "plan.json",
    )
    assert r.exit_code == 0, r.output
    monkeypatch.chdir(d)  # elsewhere: the plan still names its model
    from protrain import plans

    named = plans.load(tmp_path / "plan.json").model.name
    r = run("validate", tmp_path / "plan.json", "--model", named)
    assert r.exit_code == 0 and "fingerprint matches" in r.output, r.output


def test_probe_is_cached_per_machine_and_names_are_checked_first(tmp_path, monkeypatch):
    import protrain.planner.hardware.probe as H
    from protrain.planner.hardware.spec import find_spec

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls = []

    def counting(*a, **k):  # the committed CPU spec stands in for a 10 s measurement
        calls.append(1)
        return find_spec("cpu")

    monkeypatch.setattr(H, "probe", counting)
    r = run(
        "plan",
        "--model",
        "gpt2-tinyy",
        "--batch",
        "2",
        "--seq",
        "16",
        "--device",
        "cpu",
        "-o",
        tmp_path / "x",
    )
    no_traceback(r)
    assert "did you mean 'gpt2-tiny'" in r.output and calls == []  # no probe for a mistyped name
    args = [
        "plan",
        "--model",
        "gpt2-tiny",
        "--batch",
        "2",
        "--seq",
        "16",
        "--device",
        "cpu",
        "--budget",
        "4MiB",
    ]
    r = run(*args, "-o", tmp_path / "a.json")
    assert r.exit_code == 0 and len(calls) == 1, r.output
    assert next((tmp_path / "cache" / "protrain").glob("probe-*-cpu.json")).is_file()
    r = run(*args, "-o", tmp_path / "b.json")
    assert r.exit_code == 0 and len(calls) == 1 and "(--reprobe measures again)" in r.output, (
        r.output
    )
    r = run(*args, "--reprobe", "-o", tmp_path / "c.json")
    assert r.exit_code == 0 and len(calls) == 2, r.output


def test_models_table_builds_no_model_whole(monkeypatch):
    import protrain.planner.models.zoo as M

    def whole(*a, **k):
        raise AssertionError("`protrain models` built a whole model")

    monkeypatch.setattr(M, "describe", whole)
    monkeypatch.setattr(M, "build", whole)
    r = run("models")
    assert r.exit_code == 0, r.output
    assert "68.98B" in r.output


def test_explain_plot_without_profile_fails_before_the_report():
    r = run("explain", EXAMPLE, "--plot", "x.png")
    no_traceback(r)
    assert r.output.startswith("error: --trace and --plot need the profile"), (
        r.output
    )  # no report first


def test_peak_difference_has_no_minus_sign_before_less():
    import msgspec

    from protrain import plans
    from protrain.planner.views.show import _render_departures

    plan = plans.load(EXAMPLE)
    s = plan.provenance.search
    base = msgspec.structs.replace(
        s.chosen, peak_memory_bytes=s.chosen.peak_memory_bytes + (3 << 20)
    )
    # a plan off the paper's space, whose four-count runner-up needs more
    plan = msgspec.structs.replace(
        plan,
        placement=msgspec.structs.replace(
            plan.placement,
            homes=["persistent" if i == 1 else "host" for i in range(len(plan.placement.homes))],
        ),
        provenance=msgspec.structs.replace(
            plan.provenance, search=msgspec.structs.replace(s, runners_up=[base])
        ),
    )
    text = "\n".join(_render_departures(plan, None))
    assert "peak 3.00 MiB less" in text and "-3.00" not in text


# every command, bad inputs, as a user runs it: no Traceback on stderr


@pytest.mark.slow
def test_no_traceback_from_bad_inputs_in_a_real_process(tmp_path):
    blob = tmp_path / "b.bin"
    blob.write_bytes(b"\0" * 4096)
    (tmp_path / "file").write_text("x")
    cases = [
        ["plan", "--profile", EXAMPLE, "-o", tmp_path / "missing" / "x.json"],
        [
            "plan",
            "--model",
            "gpt2-tiny",
            "--hardware",
            "rtx3090",
            "--batch",
            "1",
            "--seq",
            "8",
            "--budget",
            "1e3TiB",
            "-o",
            tmp_path / "x.json",
        ],
        ["explain", EXAMPLE, "--plot", tmp_path / "x.png"],
        ["train", "--plan", EXAMPLE, "--model", "gpt2-tiny", "--data", blob, "--steps", "1"],
        [
            "train",
            "--plan",
            EXAMPLE,
            "--model",
            "gpt2-tiny",
            "--steps",
            "1",
            "--save-dir",
            tmp_path / "file" / "d",
        ],
        [
            "train",
            "--plan",
            EXAMPLE,
            "--model",
            "gpt2-tiny",
            "--steps",
            "1",
            "--trace",
            tmp_path / "no" / "t.json",
        ],
        ["quickstart", "--out", tmp_path / "file" / "q"],
        ["show", tmp_path / "missing.json"],
        ["validate", blob],
    ]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}

    def protrain(args):
        return subprocess.run(
            [sys.executable, "-m", "protrain.planner", *map(str, args)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )

    # Two at a time: each process spends most of its life importing torch on one core, and
    # the cases share nothing (each writes, if anything, under its own path).
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(protrain, cases))
    for args, p in zip(cases, done):
        assert p.returncode in (1, 2), (args, p.stdout, p.stderr)
        assert "Traceback" not in p.stderr + p.stdout, (args, p.stderr)
        assert p.stderr.startswith("error: ") or "Error:" in p.stderr, (args, p.stderr)


# ------------------------------------------------------------------ issue 31: bounds checked once


def _edited(tmp_path, section: str, field: str, value: int) -> Path:
    doc = json.loads(EXAMPLE.read_text())
    doc[section][field] = value
    path = tmp_path / f"{field}.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("chunks", "chunk_numel", 2**62),
        ("training", "micro_batch", 10**12),
        ("training", "grad_accum", 10**9),
        ("training", "seq_len", 2**40),
        ("training", "world_size", 10**9),
        ("placement", "n_buffer", 2**40),
    ],
)
def test_validate_refuses_what_cannot_be_allocated_or_iterated(tmp_path, section, field, value):
    path = _edited(tmp_path, section, field, value)
    for r in (run("validate", path), run(*TRAIN, "--plan", path, "--steps", "1")):
        no_traceback(r)
        assert f"at `$.{section}.{field}`" in r.output and "at most" in r.output


def test_flags_over_their_bounds_are_refused(tmp_path):
    r = run(
        "plan",
        "--model",
        "gpt2-tiny",
        "--hardware",
        "cpu",
        "--batch",
        "2",
        "--seq",
        "16",
        "--grad-accum",
        "1000000000",
        "-o",
        tmp_path / "p.json",
    )
    no_traceback(r)
    assert (
        "--grad-accum 1000000000" in r.output
        and "HINT: give --grad-accum 65536 or less" in r.output
    )
    r = run(
        "plan",
        "--model",
        "gpt2-tiny",
        "--hardware",
        "cpu",
        "--batch",
        "100000",
        "--seq",
        "100000",
        "-o",
        tmp_path / "p.json",
    )
    no_traceback(r)
    assert "tokens per micro-batch" in r.output
    assert not (tmp_path / "p.json").exists()


def test_train_refuses_a_plan_this_host_cannot_hold_before_the_build(tmp_path, monkeypatch):
    from protrain.planner.commands import preflight
    from protrain.planner.models import zoo as models

    monkeypatch.setattr(preflight, "available_host_memory", lambda: 1 << 20)  # 1 MiB free
    build = models.build
    monkeypatch.setattr(
        models,
        "build",
        lambda name, device="cpu", **k: (
            build(name, device=device, **k) if device == "meta" else pytest.fail("built the model")
        ),
    )
    r = run(*TRAIN, "--steps", "1")
    no_traceback(r)
    # both numbers: the plan's need (its accounting's host figures included) and what is available
    assert (
        "needs about" in r.output
        and "offloaded states" in r.output
        and "1.00 MiB is available" in r.output
    )
    # a longer sequence than the model's positions fails here too, not at the first forward
    r = run(*TRAIN, "--plan", _edited(tmp_path, "training", "seq_len", 4096), "--steps", "1")
    no_traceback(r)
    assert "longer than gpt2-tiny's 128 positions" in r.output


# issue 31 ------------------------------------------------------------- long runs never lose work


def test_a_second_run_in_one_save_dir_is_refused_naming_the_holder(tmp_path):
    from protrain.executor.checkpoint import lock_root

    lock = lock_root(tmp_path / "ck")  # the first run, in this process
    r = run(*TRAIN, "--steps", "1", "--save-dir", tmp_path / "ck")
    no_traceback(r)
    assert (
        f"in use by another protrain run (pid {os.getpid()} holds" in r.output
        and "step" not in r.output
    )
    lock.release()
    assert run(*TRAIN, "--steps", "1", "--save-dir", tmp_path / "ck").exit_code == 0


def test_a_save_dir_of_other_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    r = run(*TRAIN, "--steps", "1", "--save-dir", tmp_path)
    no_traceback(r)
    assert (
        "holds notes.txt and no checkpoint" in r.output
        and "HINT: give --save-dir a new" in r.output
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.slow
def test_two_concurrent_trainers_in_one_save_dir(tmp_path):
    """Run A trains and saves; run B, started meanwhile into the same directory, is refused at
    once naming A's pid; A, stopped by Ctrl-C only after that (so B surely ran while A held
    the directory, however fast A trains), keeps every checkpoint it wrote, newest in `latest`."""
    import signal

    ck = tmp_path / "ck"
    args = [
        "train",
        "--plan",
        str(EXAMPLE),
        "--model",
        "gpt2-tiny",
        "--save-dir",
        str(ck),
        "--save-every",
        "1",
        "--keep",
        "3000",  # (room for them is checked at start: ~1.5 MB each)
        "--log-every",
        "1",
    ]
    a = subprocess.Popen(
        [*PROTRAIN, *args, "--steps", "3000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        head = []  # data, model, optim, lr, ... then its first step
        while not (head and head[-1].startswith("step ")) and len(head) < 20:
            head.append(a.stdout.readline())
        assert head[-1].startswith("step "), head  # A holds the lock
        b = subprocess.run(
            [*PROTRAIN, *args, "--steps", "2"], capture_output=True, text=True, timeout=120
        )
        assert a.poll() is None, "run A ended before run B was refused"
    finally:
        a.send_signal(signal.SIGINT)  # A saves its step and exits 130
        rest, _ = a.communicate(timeout=300)
    assert b.returncode == 1 and f"pid {a.pid} holds" in b.stderr and "Traceback" not in b.stderr, (
        b.stderr
    )
    assert a.returncode == 130 and "interrupted after step" in rest, rest
    steps = sorted(p.name for p in ck.iterdir() if p.name.startswith("step-"))
    assert (ck / "latest").read_text() == steps[-1] + "\n" and steps[0] == "step-00000001"
    assert len(steps) == int(steps[-1].removeprefix("step-"))  # every one of A's, none deleted


@pytest.mark.slow
def test_a_diverging_run_keeps_its_last_finite_checkpoint(tmp_path):
    """--lr 10 makes a gradient infinite after the step-2 checkpoint (loss still finite): the run
    stops with the checkpoint's name, `--keep 1` has not deleted it, and a resume from it is
    refused at its first doomed update with the same name, the checkpoint kept."""
    ck = tmp_path / "ck"
    r = run(
        *TRAIN, "--steps", "30", "--lr", "10", "--save-dir", ck, "--save-every", "2", "--keep", "1"
    )
    no_traceback(r)
    assert (
        "NaN or infinite" in r.output
        and f"the last finite checkpoint is {ck / 'step-00000002'}" in r.output
    )
    assert sorted(p.name for p in ck.iterdir()) == [".lock", "latest", "step-00000002"]
    # It resumes from there. The checkpoint is finite, but lr 10 left weights whose gradients
    # square past float32 in the next update: Adam's exp_avg_sq is refused at that step (issue
    # 39 item 7; before, it went infinite and those parameters silently stopped training), and
    # the checkpoint the run came from is kept and named again.
    r = run(*TRAIN, "--steps", "3", "--resume", ck, "--save-dir", ck)
    no_traceback(r)
    assert "resumed from" in r.output and "exp_avg_sq became NaN or infinite" in r.output
    assert f"the last finite checkpoint is {ck / 'step-00000002'}" in r.output
    assert (ck / "latest").read_text() == "step-00000002\n"


def _disk_full_in(directory_prefix: str, monkeypatch) -> None:
    """safetensors' save_file fails as on a full disk (its own SafetensorError, not an OSError)
    for files written under a directory named ``directory_prefix…``."""
    import safetensors.torch
    from safetensors import SafetensorError

    real = safetensors.torch.save_file

    def full(tensors, path, *a, **k):
        if Path(path).parent.name.startswith(directory_prefix):
            raise SafetensorError(
                "Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                'message: "No space left on device" })'
            )
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(safetensors.torch, "save_file", full)


def test_a_failed_export_is_one_clean_error_and_leaves_nothing(tmp_path, monkeypatch):
    import torch

    from protrain.planner.models.hf_checkpoint import export
    from protrain.plans.errors import ConfigError

    (tmp_path / "config.json").write_text("{}")
    model = torch.nn.Linear(4, 4)
    _disk_full_in(".tmp-out", monkeypatch)
    with pytest.raises(
        ConfigError, match="cannot write the export .*out: Error while serializing.*No space left"
    ):
        export(
            model,
            dict(model.named_parameters()),
            tmp_path / "out",
            config_path=tmp_path / "config.json",
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]  # no .tmp-out, no out
    monkeypatch.undo()
    export(
        model,
        dict(model.named_parameters()),
        tmp_path / "out",
        config_path=tmp_path / "config.json",
    )
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]


@pytest.mark.slow
def test_a_failed_export_keeps_the_trained_model_and_export_resumes_it(tmp_path, monkeypatch):
    """--export without --save-dir on a full disk: one clean error naming the checkpoint kept
    for it; `protrain export --resume` then writes exactly the trained weights. Without the
    failure the kept checkpoint is gone after the export."""
    from safetensors.torch import load_file

    pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(
        json.dumps(
            dict(
                model_type="gpt2",
                architectures=["GPT2LMHeadModel"],
                vocab_size=320,
                n_embd=32,
                n_layer=2,
                n_head=2,
                n_positions=64,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
    )
    plan = tmp_path / "plan.json"
    r = run(
        "plan",
        "--hf-config",
        hf,
        "--hardware",
        "cpu",
        "--batch",
        "2",
        "--seq",
        "16",
        "--budget",
        "1MiB",
        "-o",
        plan,
    )
    assert r.exit_code == 0, r.output
    out, kept = tmp_path / "out", tmp_path / "out.checkpoint"
    _disk_full_in(".tmp-out", monkeypatch)
    r = run("train", "--plan", plan, "--hf-config", hf, "--steps", "2", "--export", out)
    no_traceback(r)
    assert (
        "No space left on device" in r.output
        and f"safe in the checkpoint {kept / 'step-00000002'}" in r.output
    )
    assert f"HINT: free space on the disk of {tmp_path}, then `protrain export --resume" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out.checkpoint", "plan.json"]
    monkeypatch.undo()
    r = run("export", "--resume", kept, "--hf-config", hf, "-o", out)
    assert r.exit_code == 0, r.output
    saved, exported = (
        load_file(kept / "step-00000002" / "model.safetensors"),
        load_file(out / "model.safetensors"),
    )
    assert exported.keys() <= saved.keys() and all(
        torch_equal(exported[k], saved[k]) for k in exported
    )
    r = run(
        "train", "--plan", plan, "--hf-config", hf, "--steps", "2", "--export", tmp_path / "out2"
    )
    assert r.exit_code == 0, r.output
    assert (
        not (tmp_path / "out2.checkpoint").exists()
        and (tmp_path / "out2" / "model.safetensors").is_file()
    )


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


@pytest.mark.parametrize(
    "args",
    [
        ["--seed", str(2**64)],
        ["--seed", str(-(2**63) - 1)],
        ["--lr", "nan"],
        ["--lr", "inf"],
        ["--lr", "-1"],
        ["--lr", "0"],
    ],
)
def test_seed_and_learning_rate_out_of_range_are_usage_errors(args):
    r = run(*TRAIN, "--steps", "1", *args)
    no_traceback(r, code=2)
    assert args[0] in r.output and ("range" in r.output or "positive finite" in r.output)


def test_an_edited_data_position_is_refused_not_skipped_forever(tmp_path):
    r = run(*TRAIN, "--steps", "2", "--save-dir", tmp_path)
    assert r.exit_code == 0, r.output
    manifest = tmp_path / "step-00000002" / "manifest.json"
    doc = json.loads(manifest.read_text())
    assert doc["data"]["draws"] == 2 and doc["data"]["max_grad_accum"] == 1
    doc["data"]["draws"] = 10**15
    manifest.write_text(json.dumps(doc))
    r = run(*TRAIN, "--steps", "3", "--resume", tmp_path)
    no_traceback(r)
    assert (
        "data position (draws 1000000000000000, global_micro_batch" in r.output
        and "at most 2 draws" in r.output
    )


@pytest.mark.parametrize(
    "shard", ["../outside.safetensors", "/etc/passwd", "a/../../b.safetensors", ""]
)
def test_an_hf_index_names_only_shards_in_its_directory(tmp_path, shard):
    from protrain.planner.models.hf_checkpoint import weight_files
    from protrain.plans.errors import ConfigError

    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a.weight": "model-00001.safetensors", "b.weight": shard}})
    )
    with pytest.raises(ConfigError, match="which is not a file in"):
        weight_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "sub/../m.safetensors"}})
    )
    assert weight_files(tmp_path) == [tmp_path / "m.safetensors"]
