"""Checkpoints: bit-identical resume on CPU, resume under another plan, atomicity under
SIGKILL, and refusal of damaged or foreign checkpoints before any tensor is read."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import make_model, make_plan

from protrain.executor import AdamWConfig, wrap
from protrain.executor.checkpoint import read_manifest, resolve
from protrain.planner.models.data import batches, load_tokens
from protrain.plans.errors import CheckpointError

TESTS = Path(__file__).resolve().parent
CONFIG = AdamWConfig(lr=2e-3, weight_decay=0.1)
MIXED = dict(persistent=[0], n_buffer=2, policies="swap checkpoint keep checkpoint")


def _run(plan, steps, *, resume=None, save=None, save_at=None, seed=1):
    """Train ``steps`` steps; optionally resume from / save to a checkpoint root."""
    engine = wrap(make_model("gpt2-4", seed=seed), plan, CONFIG, device="cpu")
    t = plan.training
    data = batches(load_tokens(), t.micro_batch, t.seq_len, 0)
    torch.manual_seed(1234)
    if resume is not None:
        m = engine.load(resume)
        for _ in range(m.data["micro_batches"]):
            next(data)
    losses = []
    while engine.steps_done < steps:
        losses.append(engine.step(next(data)).loss)
        if save is not None and engine.steps_done == save_at:
            engine.save(save, data={"micro_batches": engine.steps_done})
    engine.close()
    return losses


def test_resume_gives_bit_identical_losses(tmp_path):
    plan = make_plan("gpt2-4", **MIXED)
    full = _run(plan, 6, save=tmp_path, save_at=3)
    resumed = _run(plan, 6, resume=tmp_path, seed=99)  # other init: everything comes from the file
    assert resumed == full[3:]  # dropout on: RNG, moments, masters all restored exactly


@pytest.mark.parametrize(
    "other",
    [
        dict(persistent="all", n_buffer=0, policies="keep"),
        dict(persistent=[], n_buffer=2, policies="checkpoint"),
    ],
)
def test_resume_under_another_plan(tmp_path, other):
    full = _run(make_plan("gpt2-4", **MIXED), 5, save=tmp_path, save_at=2)
    resumed = _run(make_plan("gpt2-4", **other), 5, resume=tmp_path, seed=99)
    # Same fp32 arithmetic per element; only the chunk layout differs. Stated tolerance
    # 1e-6 relative for summation-order effects in the gradient-norm-free update path.
    assert resumed == pytest.approx(full[2:], rel=1e-6)


def test_layout_and_pruning(tmp_path):
    plan = make_plan("gpt2-4", **MIXED)
    engine = wrap(make_model("gpt2-4"), plan, CONFIG, device="cpu")
    data = batches(load_tokens(), 4, 32, 0)
    for _ in range(4):
        engine.step(next(data))
        engine.save(tmp_path, keep=2)
    engine.save(tmp_path, keep=2)  # again at step 4: a new directory, not a replaced one
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".lock", "latest", "step-00000004", "step-00000004.1"]
    assert (tmp_path / "latest").read_text() == "step-00000004.1\n"
    m = read_manifest(resolve(tmp_path))
    assert m.step == 4 and set(m.files) == {
        "model.safetensors",
        "optim.safetensors",
        "rng-rank0.safetensors",
    }
    engine.close()


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory) -> Path:
    """A checkpoint root after 2 steps under MIXED, trained and saved once for the module."""
    root = tmp_path_factory.mktemp("saved")
    _run(make_plan("gpt2-4", **MIXED), 2, save=root, save_at=2)
    return root


@pytest.fixture
def saved(saved_once, tmp_path) -> Path:
    """``saved_once`` copied to this test's ``tmp_path`` (its own, to damage): the checkpoint
    directory in it that ``latest`` names."""
    shutil.copytree(saved_once, tmp_path, dirs_exist_ok=True)
    return resolve(tmp_path)


def _load_into_fresh(root):
    engine = wrap(make_model("gpt2-4"), make_plan("gpt2-4", **MIXED), CONFIG, device="cpu")
    try:
        return engine.load(root)
    finally:
        engine.close()


@pytest.mark.parametrize(
    "damage",
    [
        "flip_tensor_byte",
        "truncate",
        "drop_file",
        "extra_file_name",
        "path_traversal",
        "garbage_manifest",
        "huge_manifest",
        "bad_latest",
    ],
)
def test_damaged_checkpoints_are_refused(tmp_path, damage, saved):
    d = saved
    manifest = json.loads((d / "manifest.json").read_text())
    if damage == "flip_tensor_byte":
        f = d / "model.safetensors"
        raw = bytearray(f.read_bytes())
        raw[-5] ^= 0xFF
        f.write_bytes(bytes(raw))
    elif damage == "truncate":
        f = d / "optim.safetensors"
        f.write_bytes(f.read_bytes()[:100])
    elif damage == "drop_file":
        (d / "rng-rank0.safetensors").unlink()
    elif damage in ("extra_file_name", "path_traversal"):
        name = "notes.txt" if damage == "extra_file_name" else "../../x.safetensors"
        manifest["files"][name] = {"bytes": 1, "sha256": "0" * 64}
        (d / "manifest.json").write_text(json.dumps(manifest))
    elif damage == "garbage_manifest":
        manifest["params"] = {"x": "not a shape"}
        (d / "manifest.json").write_text(json.dumps(manifest))
    elif damage == "huge_manifest":
        with open(d / "manifest.json", "r+b") as f:
            f.truncate(2 << 20)
    elif damage == "bad_latest":
        (tmp_path / "latest").write_text("../../etc\n")
    with pytest.raises(CheckpointError):
        _load_into_fresh(tmp_path)


def test_checkpoint_of_another_model_is_refused(tmp_path, saved):
    plan = make_plan("llama-4", persistent=[0], n_buffer=2, policies="keep")
    engine = wrap(make_model("llama-4"), plan, CONFIG, device="cpu")
    with pytest.raises(CheckpointError, match="another model"):
        engine.load(tmp_path)
    engine.close()


# Phases of a save (executor/checkpoint.py [Note: atomicity]) and which checkpoint
# `latest` names after a SIGKILL right after each: the previous one until `latest` is replaced.
KILL_PHASES = {
    "directory": 1,
    "rng": 1,
    "tensors": 1,
    "manifest": 1,
    "renamed": 1,
    "latest": 2,
    "pruned": 2,
}


@pytest.mark.slow
def test_sigkill_during_save_leaves_a_loadable_checkpoint(tmp_path):
    """Kill the saving process after each phase of a save in turn (a hook in the save picks
    the point, so no run depends on timing); the root always resolves to a complete
    checkpoint — the previous one or the new one, never a broken one — and the next save
    clears what the killed one left."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    out = subprocess.run(
        [sys.executable, str(TESTS / "ckptworker.py"), str(tmp_path), ",".join(KILL_PHASES)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:-1] == [f"killed {p} {int(signal.SIGKILL)}" for p in KILL_PHASES]
    for phase, expected in KILL_PHASES.items():
        m = read_manifest(resolve(tmp_path / phase))  # complete, checksums match
        assert m.data["micro_batches"] == expected, phase
        leftovers = sorted(
            p.name for p in (tmp_path / phase).iterdir() if p.name.startswith(".tmp-")
        )
        if phase in ("directory", "rng", "tensors", "manifest"):
            assert leftovers == [".tmp-step-00000002"], (
                phase
            )  # the half-written one, until the next save
    # The next save into a killed root clears the partial directory, and what it names loads.
    root = tmp_path / "tensors"
    _run(make_plan("gpt2-4", **MIXED), 1, save=root, save_at=1)
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert _load_into_fresh(tmp_path / "pruned").step == 2


def test_pruning_keeps_the_checkpoint_latest_names(tmp_path):
    """Resumed from an older step into the same root, the new (lower-step) save survives."""
    plan = make_plan("gpt2-4", **MIXED)
    _run(plan, 4, save=tmp_path, save_at=4)
    _run(plan, 5, resume=tmp_path, save=tmp_path, save_at=5)  # step-4, step-5
    _run(plan, 3, resume=tmp_path / "step-00000004", seed=1)  # nothing saved
    engine = wrap(make_model("gpt2-4"), plan, CONFIG, device="cpu")
    engine.load(tmp_path / "step-00000004")
    engine.steps_done = 2  # as a run resumed from an early step would be
    engine.save(tmp_path, keep=2)
    assert (tmp_path / "latest").read_text() == "step-00000002\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".lock",
        "latest",
        "step-00000002",
        "step-00000005",
    ]
    assert read_manifest(resolve(tmp_path)).step == 2
    engine.close()


def test_checkpoint_before_any_update_loads(tmp_path):
    """fp16: the first step overflowed and was skipped, so there are no moments yet."""
    plan = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep", compute_dtype="float16")
    engine = wrap(make_model("gpt2-4"), plan, AdamWConfig(loss_scale=2.0**60), device="cpu")
    assert engine.step(next(batches(load_tokens(), 4, 32, 0))).skipped
    engine.save(tmp_path)
    assert not read_manifest(resolve(tmp_path)).optimizer_state
    engine.close()
    other = wrap(make_model("gpt2-4"), plan, AdamWConfig(), device="cpu")
    m = other.load(tmp_path)
    assert m.step == 1 and other.scaler.scale == 2.0**59
    other.close()


def test_a_save_never_writes_a_nonfinite_tensor(tmp_path):
    plan = make_plan("gpt2-4", **MIXED)
    engine = wrap(make_model("gpt2-4"), plan, CONFIG, device="cpu")
    engine.step(next(batches(load_tokens(), 4, 32, 0)))
    good = engine.save(tmp_path)
    engine.optim.exp_avg_sq[1][7] = float("nan")  # (not through a step: the guard stops those)
    with pytest.raises(
        CheckpointError, match=f"(?s)holds NaN or infinite values; not written.*--resume {good}"
    ):
        engine.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "latest", good.name]
    engine.close()


def test_load_refuses_a_nonfinite_checkpoint(tmp_path, saved):
    """Written by something else (the manifest's checksums updated to match): refused by name,
    before the engine changes."""
    from safetensors.torch import load_file, save_file

    from protrain.executor.checkpoint import _sha256

    d = saved
    tensors = load_file(d / "model.safetensors")
    tensors["transformer.h.1.mlp.c_fc.weight"][0, 0] = float("inf")
    save_file(tensors, d / "model.safetensors")
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["files"]["model.safetensors"] = {
        "bytes": (d / "model.safetensors").stat().st_size,
        "sha256": _sha256(d / "model.safetensors"),
    }
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        CheckpointError, match="transformer.h.1.mlp.c_fc.weight holds NaN or infinite"
    ):
        _load_into_fresh(tmp_path)


def test_a_root_is_owned_by_one_run(tmp_path):
    from protrain.executor.checkpoint import lock_root

    lock = lock_root(tmp_path)
    with pytest.raises(
        CheckpointError, match=f"in use by another protrain run \\(pid {os.getpid()} "
    ):
        lock_root(tmp_path)
    engine = wrap(make_model("gpt2-4"), make_plan("gpt2-4", **MIXED), CONFIG, device="cpu")
    engine.save(tmp_path)  # this process holds it: saves go on
    lock.release()
    lock_root(tmp_path).release()  # free again
    engine.close()


def test_a_save_sweeps_and_prunes_only_its_own_names(tmp_path):
    """A user's `.tmp-notes/` and `step-notes` stay; a killed save's `.tmp-step-…` goes."""
    for name in (".tmp-notes", ".tmp-step-00000001", "step-notes"):
        (tmp_path / name).mkdir()
    engine = wrap(make_model("gpt2-4"), make_plan("gpt2-4", **MIXED), CONFIG, device="cpu")
    for _ in range(3):
        engine.step(next(batches(load_tokens(), 4, 32, 0)))
        engine.save(tmp_path, keep=1)
    engine.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".lock",
        ".tmp-notes",
        "latest",
        "step-00000003",
        "step-notes",
    ]


def test_a_directory_of_other_files_is_not_a_checkpoint_root(tmp_path):
    from protrain.planner.commands.checks import check_root

    (tmp_path / ".lock").touch()
    (tmp_path / ".tmp-step-00000001").mkdir()
    check_root(tmp_path)  # what a killed first run leaves: still a root
    (tmp_path / "thesis.tex").touch()
    with pytest.raises(CheckpointError, match="holds thesis.tex and no checkpoint"):
        check_root(tmp_path)
    (tmp_path / "latest").write_text("step-00000001\n")
    check_root(tmp_path)  # a root the user also keeps notes in: their files are never touched


def test_a_full_disk_while_pointing_latest_says_where_the_checkpoint_is(tmp_path, monkeypatch):
    import errno

    from protrain.executor import checkpoint

    engine = wrap(make_model("gpt2-4"), make_plan("gpt2-4", **MIXED), CONFIG, device="cpu")
    first = engine.save(tmp_path)
    engine.step(next(batches(load_tokens(), 4, 32, 0)))

    def full(path, *a, **k):  # as the kernel does: the file is created, the write fails
        if Path(path).name != ".latest.tmp":
            return open(path, *a, **k)
        open(path, "w").close()
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint, "open", full, raising=False)
    with pytest.raises(
        CheckpointError,
        match="(?s)step-00000001 is complete, but .*latest could not be pointed at "
        "it: No space left on device.*--resume .*step-00000001",
    ):
        engine.save(tmp_path)
    assert not (tmp_path / ".latest.tmp").exists()
    assert resolve(tmp_path) == first
    engine.close()
