"""Subprocess for the checkpoint kill test: fork one saver per trial; each trains and
saves in a loop until the test kills it.

The parent imports everything and builds the plan once (one thread, so forking is
safe: no OpenMP pool exists), then for each trial forks a child that builds the engine, prints ``child T PID`` and waits for
it to die. The child prints ``begin N`` before and ``saved N`` after each save, so
the test knows whether its SIGKILL landed inside a save.
"""

from __future__ import annotations

import os
import sys

import torch
from harness import make_model, make_plan

from protrain.executor import AdamWConfig, wrap
from protrain.planner.data import batches, load_tokens

torch.set_num_threads(1)
root, trials = sys.argv[1], int(sys.argv[2])
plan = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep")
src = load_tokens()
for trial in range(trials):
    pid = os.fork()
    if pid == 0:  # the engine (and its CPU-Adam thread) exists only in the child
        engine = wrap(make_model("gpt2-4"), plan, AdamWConfig(lr=1e-3), device="cpu")
        data = batches(src, plan.training.micro_batch, plan.training.seq_len, 0)
        for i in range(1, 1_000_000):
            engine.step(next(data))
            print(f"begin {i}", flush=True)
            engine.save(os.path.join(root, f"t{trial}"), data={"micro_batches": i})
            print(f"saved {i}", flush=True)
    print(f"child {trial} {pid}", flush=True)
    os.waitpid(pid, 0)
