"""protrain under a TRL SFTTrainer script started by torchrun (planner/commands/hf_trainer.py
[Note: several processes]): 2 ranks of micro-batch 2 train a ZeRO-3 plan as one rank group
to the per-step losses and gradient norms of the same script without protrain in one process
on micro-batch 4 (the same rows: accelerate hands rank r every W-th batch of the sampler's
order). Tolerance 1e-5 relative, as tests/test_dist.py's: the ranks' gradients are summed by
gloo's collectives, not inside one backward, so they agree to fp32 rounding.

Also: the split phases under ZeRO-3 take the gradient norm after the persistent chunks'
reductions (Trainer clips before ``optimizer.step()``), and a Trainer checkpoint under
several processes is refused by name."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from tools.chatdata import chats, tokenizer_dir, write_jsonl

pytest.importorskip("trl")

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "sft_trainer.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_json(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_sft_under_torchrun_equals_one_process(tmp_path):
    cfg = {
        "tokenizer": tokenizer_dir(tmp_path / "tok"),
        "data": write_jsonl(tmp_path / "chat.jsonl", chats(200)),
        "steps": 8,
        "threads": 1,
    }
    one = [sys.executable, str(SCRIPT), json.dumps({**cfg, "out": str(tmp_path / "a"), "batch": 4})]
    ref = _last_json(subprocess.run(one, capture_output=True, text=True, timeout=600))
    ours_cfg = {**cfg, "out": str(tmp_path / "b"), "batch": 2, "protrain": True}
    two = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    two += ["--master-port", str(_port()), str(SCRIPT), json.dumps(ours_cfg)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    ours = _last_json(subprocess.run(two, capture_output=True, text=True, timeout=600, env=env))
    assert ours["plan"]["world_size"] == 2, ours["plan"]  # a ZeRO-3 plan, made by plan_for
    assert len(ours["losses"]) == len(ref["losses"]) == 8
    for key in ("losses", "grad_norms"):
        for a, b in zip(ours[key], ref[key]):
            assert abs(a - b) <= 1e-5 * abs(b), (key, ours[key], ref[key])


def _norms(rank: int, world: int, port: int, out: str) -> None:
    """Each rank trains 3 steps of a ZeRO-3 plan (a persistent chunk, clipping) with
    ``engine.step``, then again through the split phases, ``grad_norm()`` before
    ``finish_step()`` as Trainer's clipping asks it; rank 0 writes both runs' norms and losses."""
    from distworker import LR, MICRO, SEQ, _exit_cleanly, init, make_plan

    from protrain.executor import AdamWConfig, wrap
    from protrain.planner.models.data import batches, load_tokens
    from protrain.planner.models.zoo import build

    init(rank, world, port)
    plan = make_plan(
        "gpt2-tiny", world, [0], 2, ["swap", "checkpoint"], grad_accum=2, cpu_adam="after_backward"
    )
    got = {}
    for split in (False, True):
        model = build("gpt2-tiny", seed=1)
        engine = wrap(model, plan, AdamWConfig(lr=LR, max_grad_norm=0.5), device="cpu")
        data = batches(load_tokens(), MICRO, SEQ, 0, rank=rank, world_size=world)
        norms = []
        for _ in range(3):
            mbs = [next(data) for _ in range(2)]
            if not split:
                norms.append(engine.step(mbs).grad_norm)
                continue
            for x, y in mbs:
                (model(x, y) / 2).backward()
            norms.append(engine.grad_norm().item())
            engine.finish_step()
        got[split] = {"norms": norms, "state": engine.state_dict()["model"]}
        engine.close()
    if rank == 0:
        torch.save(got, Path(out) / "norms.pt")
    torch.distributed.destroy_process_group()
    _exit_cleanly()


@pytest.mark.slow  # two ranks spawned (~4 s)
def test_split_phase_norm_under_zero3_is_the_steps(tmp_path):
    mp.spawn(_norms, args=(2, _port(), str(tmp_path)), nprocs=2, join=True)
    got = torch.load(tmp_path / "norms.pt", weights_only=True)
    assert got[True]["norms"] == got[False]["norms"]
    torch.testing.assert_close(got[True]["state"], got[False]["state"], rtol=0, atol=0)


def test_checkpoints_under_several_processes_refused(tmp_path):
    """Trainer writes a checkpoint from rank 0 alone; the plan's chunks are sharded."""
    from distworker import make_plan

    from protrain.planner.commands.hf_trainer import refusals

    plan = make_plan("gpt2-tiny", 2, [0], 2, ["swap", "checkpoint"])
    args = SimpleNamespace(world_size=2, per_device_train_batch_size=2, max_length=32)
    assert refusals(SimpleNamespace(**vars(args), save_strategy="no"), plan) == []
    found = refusals(SimpleNamespace(**vars(args), save_strategy="steps"), plan)
    assert len(found) == 1 and "save_strategy=steps with 2 processes" in found[0][0], found
    assert "save_strategy='no'" in found[0][1] and "torchrun" in found[0][1]
