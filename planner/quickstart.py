"""``protrain quickstart``: plan → check → train a small model on the device at hand.

Stages that later issues complete are said out loud rather than faked: until the
profiler and the search land (issues 4 and 5), the plan's configuration is a fixed
hand-chosen one (first chunk persistent, the rest offloaded through the fewest
buffers that fit, one more for prefetch; blocks alternating checkpoint/keep). The
training stage is the real executor replaying that plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from protrain.executor import AdamWConfig, wrap
from protrain.executor import plan as P
from protrain.executor.check import check

from .data import batches, load_tokens, vocab_check
from .emit import emit
from .models import block_paths, build
from .report import render_show

MICRO_BATCH, SEQ_LEN = 4, 64


def run(*, model_name: str, steps: int, data_path: str | None, out_dir: str, seed: int,
        echo: Callable[[str], None] = print) -> list[float]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    source = load_tokens(data_path)
    model = build(model_name, device="meta")
    vocab_check(source, model.lm_head.weight.shape[0])
    blocks = block_paths(model)
    echo(f"[1/3] plan    {model_name} on {device} (hand-chosen configuration until the "
         "planner's search lands)")
    training = P.Training(micro_batch=MICRO_BATCH, seq_len=SEQ_LEN, compute_dtype="float32",
                          master_dtype="float32", world_size=1, grad_accum=1)
    chunk_numel = max(p.numel() for p in model.parameters()) * 4
    probe = emit(model, name=model_name, blocks=blocks, training=training, chunk_numel=chunk_numel,
                 persistent=[], n_buffer=64, policies=["keep"] * len(blocks))
    n_buffer = max(len(need & set(probe.placement.offloaded))
                   for need in P.segment_chunks(probe).values()) + 1
    plan = emit(model, name=model_name, blocks=blocks, training=training, chunk_numel=chunk_numel,
                persistent=[0], n_buffer=n_buffer,
                policies=["checkpoint" if i % 2 == 0 else "keep" for i in range(len(blocks))],
                request=P.Request(model=model_name, hardware=device, micro_batch=MICRO_BATCH,
                                  seq_len=SEQ_LEN, compute_dtype="float32", world_size=1,
                                  grad_accum=1),
                hardware=P.Hardware(name=device))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{model_name}.json"
    path.write_bytes(P.dump(plan))
    echo(f"        wrote {path}")
    echo(render_show(P.load(path), str(path)))

    echo("[2/3] check   plan against the live model")
    live = build(model_name, device=device, seed=seed)
    check(P.load(path), live, where=str(path))
    echo("        fingerprint matches")

    echo(f"[3/3] train   {steps} steps with the executor replaying the plan")
    engine = wrap(live, P.load(path), AdamWConfig(lr=3e-3), device=device)
    data = batches(source, MICRO_BATCH, SEQ_LEN, seed)
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        result = engine.step(next(data))
        losses.append(result.loss)
        if step % 10 == 0 or step == steps - 1:
            echo(f"        step {step:4d}  loss {result.loss:.4f}  "
                 f"{result.timings['total'] * 1e3:6.1f} ms  peak {result.peak_bytes / 2**20:.2f} MiB")
    engine.close()
    echo(f"done: loss {losses[0]:.3f} → {losses[-1]:.3f} in {time.perf_counter() - t0:.1f} s")
    return losses
