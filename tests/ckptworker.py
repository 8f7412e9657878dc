"""Subprocess for the checkpoint kill test: one forked saver per phase of a save, each
SIGKILLed by the save's phase hook at that phase of its second save.

The parent imports everything and builds the plan once (one thread, so forking is
safe: no OpenMP pool exists), then for each phase forks a child that builds the
engine, trains a step and saves (complete), trains another and saves again with
``checkpoint._after_phase`` set to kill itself when the chosen phase completes. The
parent prints ``killed PHASE SIGNAL`` once the child is dead. The kill point is chosen,
not timed, so every phase is exercised on every run.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from harness import make_model, make_plan

import tools.emulation  # noqa: F401  (PROTRAIN_ASYNC_CPU in this process too: executor/transfer.py EMULATION)
from protrain.executor import AdamWConfig, checkpoint, wrap
from protrain.planner.models.data import batches, load_tokens

torch.set_num_threads(1)
root, phases = sys.argv[1], sys.argv[2].split(",")
plan = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep")
src = load_tokens()
for phase in phases:
    pid = os.fork()
    if pid == 0:  # the engine (and its CPU-Adam thread) exists only in the child
        engine = wrap(make_model("gpt2-4"), plan, AdamWConfig(lr=1e-3), device="cpu")
        data = batches(src, plan.training.micro_batch, plan.training.seq_len, 0)
        where = os.path.join(root, phase)
        engine.step(next(data))
        engine.save(where, data={"micro_batches": 1})

        def kill(done: str, phase=phase) -> None:
            if done == phase:
                os.kill(os.getpid(), signal.SIGKILL)

        checkpoint._after_phase = kill
        engine.step(next(data))
        engine.save(where, data={"micro_batches": 2})
        os._exit(3)  # not reached: the hook kills the process
    _, status = os.waitpid(pid, 0)
    print(f"killed {phase} {os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1}", flush=True)
