"""Issue 39, "Work lost": no run loses its trained state to a careless command line or a full disk.

One test (or two) per item: a second run into a finished run's --save-dir (1), outputs that
cannot fit and late writes that fail (2), ranks given other output directories (3), SIGHUP
(4), a metrics or trace file on a full disk (5), an adapter export that fails partway and
`protrain export` of a LoRA checkpoint (6); and two of the issue's smaller points: a resume is
marked in the metrics file, the header says how many parameters train. Full disks are
simulated without root: /dev/full (every write ENOSPC), a patched ``shutil.disk_usage`` or
safetensors ``save_file``, and RLIMIT_FSIZE in a child process for EFBIG (Python ignores
SIGXFSZ, so the write fails instead of killing the process).
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from clihelpers import EXAMPLE, PROTRAIN, TRAIN, no_traceback, run

from protrain.executor.checkpoint import read_manifest, resolve
from protrain.planner.commands.train import train
from protrain.plans.errors import CheckpointError, ConfigError

PLAN = str(EXAMPLE)
QUIET = dict(echo=lambda _: None, progress=False)


# 1 ------------------------------------------------------------ a save directory belongs to one run


def test_a_new_run_refuses_a_save_dir_holding_another_runs_checkpoints(tmp_path):
    ck = tmp_path / "ck"
    train(PLAN, "gpt2-tiny", steps=2, save_dir=str(ck), **QUIET)
    with pytest.raises(CheckpointError) as info:  # other seed, fewer steps, no --resume
        train(PLAN, "gpt2-tiny", steps=1, seed=7, save_dir=str(ck), keep=1, **QUIET)
    assert "holds another run's checkpoints (step-00000002)" in info.value.message
    assert "--overwrite" in info.value.hint and f"--resume {ck}" in info.value.hint
    assert (ck / "latest").read_text() == "step-00000002\n" and (ck / "step-00000002").is_dir()
    # resuming it is that run's own business; --overwrite starts over (the old ones go once
    # the new run has saved)
    train(PLAN, "gpt2-tiny", steps=3, resume=str(ck), save_dir=str(ck), **QUIET)
    assert (ck / "latest").read_text() == "step-00000003\n"
    lines = []
    train(PLAN, "gpt2-tiny", steps=1, seed=7, save_dir=str(ck), overwrite=True, echo=lines.append)
    assert sorted(p.name for p in ck.iterdir()) == [".lock", "latest", "step-00000001"]
    with pytest.raises(ConfigError, match="--overwrite"):
        train(PLAN, "gpt2-tiny", steps=2, resume=str(ck), save_dir=str(ck), overwrite=True)


# 2 ------------------------------------------------------- outputs checked for room before the
# first step


def _free(small: dict[Path, int], monkeypatch) -> None:
    """``shutil.disk_usage`` reports ``small[d]`` bytes free under each directory ``d``."""
    real = shutil.disk_usage

    def usage(path):
        p = Path(path).resolve()
        for d, free in small.items():
            if p == d.resolve() or d.resolve() in p.parents:
                return real(path)._replace(free=free)
        return real(path)

    monkeypatch.setattr(shutil, "disk_usage", usage)


def test_a_save_dir_on_a_disk_without_room_is_refused_before_the_first_step(tmp_path, monkeypatch):
    disk = tmp_path / "small"
    disk.mkdir()
    _free({disk: 200_000}, monkeypatch)
    lines = []
    with pytest.raises(ConfigError) as info:
        train(PLAN, "gpt2-tiny", steps=2, save_dir=str(disk / "ck"), echo=lines.append)
    assert "not enough disk space" in info.value.message and "--save-dir" in info.value.message
    assert "free space on the disk of" in info.value.hint
    assert not [line for line in lines if line.startswith("step")]


@pytest.mark.slow  # a child process (~6 s)
def test_a_file_size_limit_is_refused_before_the_first_step_not_called_a_full_disk(tmp_path):
    limit = 64 << 10  # gpt2-tiny's checkpoint files are larger

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    r = subprocess.run(
        [*PROTRAIN, *TRAIN, "--steps", "2", "--save-dir", str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        preexec_fn=limited,
        timeout=300,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "ulimit -f unlimited" in r.stderr and "free space" not in r.stderr, r.stderr
    assert "step " not in r.stdout and "Traceback" not in r.stderr


def _disk_full_under(directory: Path, monkeypatch, code: int = errno.ENOSPC) -> None:
    """safetensors' ``save_file`` fails with ``code`` for every file under ``directory``."""
    import safetensors.torch

    real = safetensors.torch.save_file

    def full(tensors, path, *a, **k):
        if directory.resolve() in Path(path).resolve().parents:
            raise OSError(code, os.strerror(code), str(path))
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(safetensors.torch, "save_file", full)


def test_a_late_full_disk_saves_the_trained_state_where_there_is_room(tmp_path, monkeypatch):
    ck, spare = tmp_path / "full" / "ck", tmp_path / "spare"
    spare.mkdir()
    monkeypatch.setenv("TMPDIR", str(spare))
    _disk_full_under(tmp_path / "full", monkeypatch)
    with pytest.raises(CheckpointError) as info:
        train(PLAN, "gpt2-tiny", steps=2, save_dir=str(ck), **QUIET)
    (rescued,) = spare.iterdir()
    assert f"saved to {rescued} instead" in info.value.message
    assert f"--resume {rescued}" in info.value.hint and "free space" in info.value.hint
    assert read_manifest(resolve(rescued)).step == 2
    monkeypatch.undo()
    assert train(PLAN, "gpt2-tiny", steps=3, resume=str(rescued), **QUIET)  # it resumes


def test_a_late_file_size_limit_is_not_called_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "nowhere"))  # (no rescue: the hint is the point)
    monkeypatch.setattr(Path, "home", lambda: tmp_path / "nowhere")
    monkeypatch.setenv("HOME", str(tmp_path / "nowhere"))
    _disk_full_under(tmp_path / "ck", monkeypatch, errno.EFBIG)
    with pytest.raises(CheckpointError) as info:
        train(PLAN, "gpt2-tiny", steps=1, save_dir=str(tmp_path / "ck"), **QUIET)
    assert "ulimit -f" in info.value.hint and "free space" not in info.value.hint


def _hf_gpt2(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny GPT-2 config directory and a CPU plan for it."""
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
    args = ["--hardware", "cpu", "--batch", "2", "--seq", "16", "--budget", "1MiB", "-o", plan]
    r = run("plan", "--hf-config", hf, *args)
    assert r.exit_code == 0, r.output
    return hf, plan


@pytest.mark.slow  # a plan and a training run of a transformers model (~8 s)
def test_an_export_on_a_full_disk_is_refused_before_and_rescued_after(tmp_path, monkeypatch):
    hf, plan = _hf_gpt2(tmp_path)
    disk, spare = tmp_path / "disk", tmp_path / "spare"
    disk.mkdir()
    spare.mkdir()
    out = disk / "out"
    # before: the export and the checkpoint kept beside it do not fit, so nothing trains
    _free({disk: 300_000}, monkeypatch)
    r = run("train", "--plan", plan, "--hf-config", hf, "--steps", "2", "--export", out)
    no_traceback(r)
    assert "not enough disk space" in r.output and "--export" in r.output
    assert "kept until the export" in r.output and "step " not in r.output
    monkeypatch.undo()
    # after: the disk fills during the run; the state goes to $TMPDIR and the hint recovers it
    monkeypatch.setenv("TMPDIR", str(spare))
    _disk_full_under(disk, monkeypatch)
    r = run("train", "--plan", plan, "--hf-config", hf, "--steps", "2", "--export", out)
    no_traceback(r)
    (rescued,) = spare.iterdir()
    assert f"the trained model is safe in the checkpoint {rescued}" in r.output
    assert f"`protrain export --resume {rescued / 'step-00000002'} --hf-config" in r.output
    assert sorted(p.name for p in disk.iterdir()) == []  # nothing half-written there
    monkeypatch.undo()
    r = run("export", "--resume", rescued, "--hf-config", hf, "-o", out)
    assert r.exit_code == 0, r.output
    assert (out / "model.safetensors").is_file()


# 3 ----------------------------------------------------------------- ranks agree on where they
# write


def test_ranks_agree_on_their_output_directories_before_the_first_step(tmp_path, monkeypatch):
    from protrain.executor.dist import Comm

    seen: list[dict] = []
    real = Comm.agree

    def agree(self, fields, device="cpu"):
        seen.append(dict(fields))
        return real(self, fields, device)

    monkeypatch.setattr(Comm, "agree", agree)
    train(PLAN, "gpt2-tiny", steps=1, save_dir=str(tmp_path / "ck"), **QUIET)
    fields = {k: v for f in seen for k, v in f.items()}
    assert fields["--save-dir"] == str((tmp_path / "ck").absolute())
    assert {"--resume", "--export", "--export-merged", "--keep"} <= fields.keys()


def test_a_rank_with_another_save_dir_is_named_by_agree():
    import dataclasses

    import torch

    from protrain.executor.dist import Comm, _agreement_value
    from protrain.plans.errors import PlanError

    comm = Comm.__new__(Comm)
    comm.world, comm.rank, comm.runner = 2, 0, lambda fn: fn()
    comm.events = dataclasses.make_dataclass("E", [])()
    comm.events.emit = lambda *a, **k: None
    mine, other = {"--save-dir": "/ck/run"}, {"--save-dir": "/ck/rnu"}

    def gather(table, own):
        table[: own.numel()] = own
        table[own.numel() :] = torch.tensor([_agreement_value(v) for v in other.values()])

    comm._all_gather = gather
    with pytest.raises(PlanError, match="rank 1's --save-dir differs from rank 0's"):
        comm.agree(mine)


# 4 ---------------------------------------------------------------------------------- SIGHUP


@pytest.mark.slow  # a child process that trains until it has saved (~8 s)
def test_sighup_checkpoints_then_stops_like_sigterm(tmp_path):
    out = tmp_path / "ck"
    proc = subprocess.Popen(
        [*PROTRAIN, *TRAIN, "--steps", "100000", "--save-every", "3", "--save-dir", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 120
    while not (out / "latest").exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGHUP)
    text, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, text
    step = int(text.split("interrupted after step ")[1].split(";")[0])
    assert read_manifest(resolve(out)).step == step >= 3


# 5 ---------------------------------------------------------- a metrics or trace file on a full
# disk


class _FullDiskFile:
    """A file on a full disk: every write fails with ENOSPC (as its flush would)."""

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        pass

    def close(self):
        pass


def _full_disk_at(path: Path, monkeypatch) -> None:
    """The metrics file (opened by progress.py's ``Metrics``) and the trace
    (``views.trace.write_trace``) at ``path`` are on a full disk. (/dev/full does not fail
    writes in every sandbox.)"""
    import builtins

    from protrain.planner.commands import progress as module
    from protrain.planner.views import trace

    def fake_open(file, *a, **k):
        return _FullDiskFile() if str(file) == str(path) else builtins.open(file, *a, **k)

    def write_trace(doc, to):
        if str(to) == str(path):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(module, "open", fake_open, raising=False)
    monkeypatch.setattr(trace, "write_trace", write_trace)


@pytest.mark.parametrize("flag", ["metrics_path", "trace_path"])
def test_a_full_disk_under_metrics_or_trace_warns_and_the_run_checkpoints(
    tmp_path, flag, monkeypatch
):
    lines: list[str] = []
    ck, target = tmp_path / "ck", tmp_path / "full" / "m.out"
    target.parent.mkdir()
    _full_disk_at(target, monkeypatch)
    losses = train(
        PLAN, "gpt2-tiny", steps=3, save_dir=str(ck), echo=lines.append, progress=False,
        **{flag: str(target)},
    )  # fmt: skip
    assert len(losses) == 3 and (ck / "latest").read_text() == "step-00000003\n"
    (warning,) = [line for line in lines if line.startswith("warning:")]
    assert str(target) in warning and "No space left on device" in warning


# 6 --------------------------------------------------------------- exports whole or not at all


def _tokenizer_dir(tmp_path: Path) -> Path:
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}, "pad": "x" * 4096}))
    (d / "tokenizer_config.json").write_text("{}")
    return d


def test_a_failed_adapter_export_leaves_nothing_and_names_the_export(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    from protrain.planner.commands.lora_options import LoraSpec
    from protrain.planner.models import lora as L

    spec = LoraSpec(r=4)
    model = L.build_model("llama-tiny", spec, device="cpu")
    state = {n: p.detach() for n, p in model.named_parameters()}
    tok, out = _tokenizer_dir(tmp_path), tmp_path / "exports" / "A"
    out.parent.mkdir()
    real = shutil.copyfile

    def truncating(src, dst, *a, **k):  # half of tokenizer.json, then a full disk
        if Path(src).name == "tokenizer.json":
            Path(dst).write_bytes(Path(src).read_bytes()[:100])
            raise OSError(errno.ENOSPC, "No space left on device", str(src))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(shutil, "copyfile", truncating)
    with pytest.raises(ConfigError) as info:
        L.export_adapter(model, state, spec, out, tokenizer_dir=tok)
    assert f"cannot write the adapter export {out}" in info.value.message
    assert str(tok) not in info.value.message and "free space" in info.value.hint
    assert list(out.parent.iterdir()) == []  # no A, no .tmp-A
    monkeypatch.undo()
    L.export_adapter(model, state, spec, out, tokenizer_dir=tok)
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


@pytest.mark.slow  # plans and trains a transformers model with peft (~10 s)
def test_protrain_export_writes_a_lora_checkpoints_adapter(tmp_path):
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    hf, _ = _hf_gpt2(tmp_path)
    plan, ck = tmp_path / "lora.json", tmp_path / "ck"
    lora = ["--lora", "--lora-r", "4", "--lora-alpha", "8"]
    args = ["--hardware", "cpu", "--batch", "2", "--seq", "16", "--budget", "1MiB"]
    r = run("plan", "--hf-config", hf, *lora, *args, "-o", plan)
    assert r.exit_code == 0, r.output
    a = tmp_path / "A"
    r = run(
        "train", "--plan", plan, "--hf-config", hf, *lora, "--steps", "2", "--lr", "1e-2",
        "--save-dir", ck, "--export", a,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    header = r.output
    r = run("export", "--resume", ck, "--hf-config", hf, "-o", tmp_path / "full")
    no_traceback(r)
    assert "a LoRA checkpoint" in r.output and "add --lora" in r.output
    b = tmp_path / "B"
    r = run("export", "--resume", ck, "--hf-config", hf, *lora, "-o", b)
    assert r.exit_code == 0, r.output
    assert json.loads((b / "adapter_config.json").read_text())["lora_alpha"] == 8
    ours, theirs = (
        load_file(a / "adapter_model.safetensors"),
        load_file(b / "adapter_model.safetensors"),
    )
    assert ours.keys() == theirs.keys() and all((ours[k] == theirs[k]).all() for k in ours)
    r = run(
        "export", "--resume", ck, "--hf-config", hf, "--lora", "--lora-r", "8", "-o", tmp_path / "C"
    )
    no_traceback(r)
    assert "checkpoint of another model" in r.output and "--lora settings" in r.output
    assert "parameters train (" in header  # the header says how many of how many train


# smaller ---------------------------------------------------------- a resume marked; the header


def test_a_resume_is_marked_in_the_metrics_file(tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    train(
        PLAN,
        "gpt2-tiny",
        steps=2,
        save_every=1,
        save_dir=str(ck),
        metrics_path=str(metrics),
        **QUIET,
    )
    train(PLAN, "gpt2-tiny", steps=3, resume=str(ck / "step-00000001"), save_dir=str(ck),
          metrics_path=str(metrics), **QUIET)  # fmt: skip
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r.get("step") for r in records] == [1, 2, 1, 2, 3]
    assert records[2] == {
        "event": "resume",
        "step": 1,
        "resumed_from": str(ck / "step-00000001"),
    }
    assert all("loss" in r for i, r in enumerate(records) if i != 2)


def test_the_train_header_says_how_many_parameters_train():
    lines: list[str] = []
    train(PLAN, "gpt2-tiny", steps=1, echo=lines.append, progress=False)
    (model,) = [line for line in lines if line.startswith("model ")]
    assert "parameters, all trained" in model
