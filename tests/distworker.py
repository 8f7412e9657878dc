"""Rank bodies for tests/test_dist.py, started by torch.multiprocessing.spawn (gloo, CPU).

Each rank builds the same model from the same seed, makes the same plan (world size
W), wraps it and trains on its slice of every global batch. Results go to files in
``out`` so the parent compares them with single-process training.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import tools.emulation  # noqa: F401  (PROTRAIN_ASYNC_CPU in this process too: executor/transfer.py EMULATION)
from protrain import plans
from protrain.executor import AdamWConfig, wrap
from protrain.executor.dist import RankFailure
from protrain.planner.models.data import batches, load_tokens
from protrain.planner.models.zoo import block_paths, build
from protrain.planner.search.emit import emit
from protrain.plans import plan as P

MICRO, SEQ, LR = 2, 32, 2e-3


def make_plan(
    name: str,
    world: int,
    persistent,
    n_buffer: int,
    policies: list[str],
    micro: int = MICRO,
    chunk_numel: int = 65536,
    dtype: str = "float32",
    grad_accum: int = 1,
    lora=None,
    **config,
) -> P.Plan:
    """``config``: more of ``emit.assemble``'s options (``cpu_adam``, ``shard_persistent_states``).
    ``lora``: a ``planner.lora.LoraSpec`` injected into the model (its base frozen)."""
    meta = build(name, device="meta") if lora is None else build_lora(name, lora, device="meta")
    training = P.Training(
        micro_batch=micro,
        seq_len=SEQ,
        compute_dtype=dtype,
        master_dtype="float32",
        world_size=world,
        grad_accum=grad_accum,
    )
    return emit(
        meta,
        name=name,
        blocks=block_paths(meta),
        training=training,
        chunk_numel=chunk_numel,
        persistent=persistent,
        n_buffer=n_buffer,
        policies=policies,
        **config,
    )


def build_lora(name: str, lora, **kw):
    """The zoo model ``name`` with ``lora``'s adapters (planner/models/lora.py), seeded as ``kw``
    says."""
    from protrain.planner.models.lora import build_model

    return build_model(name, lora, **kw)


def _exit_cleanly() -> None:
    """End a rank whose results are on disk without the interpreter's finalisation: gloo's
    worker threads may still hold a finished collective's work (and its tensors) then, and
    releasing it without the GIL aborts the process ("terminate called without an active
    exception", no Python frame: pytorch/pytorch#179291) in a few percent of runs, also
    before this session's changes (1 of 20 at ab3aefa). Only reached when the rank succeeded."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def init(rank: int, world: int, port: int, timeout_s: float = 60.0) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )


def train(
    rank: int,
    world: int,
    port: int,
    out: str,
    name: str,
    persistent,
    n_buffer: int,
    policies: list[str],
    steps: int,
    load: str | None = None,
    save: str | None = None,
    skip: int = 0,
    micro: int = MICRO,
    chunk_numel: int = 65536,
    lora=None,
) -> None:
    """Train ``steps`` steps (after skipping ``skip`` global batches); write losses and state."""
    init(rank, world, port)
    try:
        plan = make_plan(name, world, persistent, n_buffer, policies, micro, chunk_numel, lora=lora)
        model = build(name, seed=1) if lora is None else build_lora(name, lora, seed=1)
        engine = wrap(model, plan, AdamWConfig(lr=LR, weight_decay=0.1), device="cpu")
        if load:
            engine.load(load)  # the checkpoint saved on another world size
        data = batches(load_tokens(), micro, SEQ, 0, rank=rank, world_size=world)
        for _ in range(skip):
            next(data)
        results = [engine.step(next(data)) for _ in range(steps)]
        losses = [r.loss for r in results]
        peak = max(r.peak_bytes for r in results)
        sd = engine.state_dict()
        if save:
            engine.save(save)  # every rank: collectives and barriers inside
        if rank == 0:
            torch.save(sd, Path(out) / "state.pt")
        Path(out, f"rank{rank}.json").write_text(
            json.dumps({"losses": losses, "host": engine.ledger.host_bytes, "peak": peak})
        )
        engine.close()
    finally:
        dist.destroy_process_group()
    _exit_cleanly()


def run_plans(rank: int, world: int, port: int, out: str, runs: list[tuple]) -> None:
    """Train each ``(label, model name, plan file, steps, max_grad_norm)`` of ``runs`` in turn,
    in one process group; write each run's losses, gradient norms and the optimizer's
    device bytes per rank, and rank 0's state dict."""
    init(rank, world, port)
    try:
        for label, name, path, steps, clip in runs:
            plan = plans.load(path)
            engine = wrap(
                build(name, seed=1),
                plan,
                AdamWConfig(lr=LR, weight_decay=0.1, max_grad_norm=clip),
                device="cpu",
                nvme_dir=out,
            )
            data = batches(
                load_tokens(), plan.training.micro_batch, SEQ, 0, rank=rank, world_size=world
            )
            results = [engine.step(next(data)) for _ in range(steps)]
            sd = engine.state_dict()
            if rank == 0:
                torch.save(sd, Path(out) / f"{label}.pt")
            Path(out, f"{label}-rank{rank}.json").write_text(
                json.dumps(
                    {
                        "losses": [r.loss for r in results],
                        "norms": [r.grad_norm for r in results],
                        "optim": engine.ledger.bytes["optim"],
                        "host": engine.ledger.host_bytes,
                    }
                )
            )
            engine.close()
    finally:
        dist.destroy_process_group()
    _exit_cleanly()


def die(rank: int, world: int, port: int, out: str, timeout_s: float) -> None:
    """Rank 1 dies after two steps; rank 0 must fail with a clear RankFailure, not hang."""
    init(rank, world, port, timeout_s)
    plan = make_plan("gpt2-tiny", world, [0], 2, ["keep", "keep"])
    engine = wrap(build("gpt2-tiny", seed=1), plan, device="cpu")
    data = batches(load_tokens(), MICRO, SEQ, 0, rank=rank, world_size=world)
    for _ in range(2):
        engine.step(next(data))
    if rank == 1:
        os._exit(3)
    t0 = time.perf_counter()
    try:
        for _ in range(50):
            engine.step(next(data))
        Path(out, "rank0.txt").write_text("no error")
    except RankFailure as e:
        Path(out, "rank0.txt").write_text(f"{time.perf_counter() - t0:.1f}\n{e}")


def events(rank: int, world: int, port: int, out: str, name: str, persistent, shards) -> None:
    """One step per ``shards`` entry (persistent states sharded or not), one after another in
    one process group; write rank 0's event stream (kind, edge, phase, segment, detail) of
    each to ``events-{sharded|replicated}.json``."""
    init(rank, world, port)
    try:
        for shard in shards:
            plan = make_plan(
                name, world, persistent, 2, ["keep", "keep"], shard_persistent_states=shard
            )
            engine = wrap(build(name, seed=1), plan, AdamWConfig(lr=LR), device="cpu")
            seen = []
            engine.on_event(
                lambda e, seen=seen: seen.append([e.kind, e.edge, e.phase, e.segment, e.detail])
            )
            engine.step(next(batches(load_tokens(), MICRO, SEQ, 0, rank=rank, world_size=world)))
            if rank == 0:
                Path(out, f"events-{'sharded' if shard else 'replicated'}.json").write_text(
                    json.dumps(
                        {
                            "events": seen,
                            "persistent": plan.placement.persistent,
                            "blocks": list(plan.model.blocks),
                        }
                    )
                )
            engine.close()
    finally:
        dist.destroy_process_group()
    _exit_cleanly()


def disagree(rank: int, world: int, port: int, out: str, changes: list[dict]) -> None:
    """For each of ``changes`` in turn, in one process group: rank 1 wraps a plan made with
    the change (grad_accum, micro, policies); every rank writes what happened at wrap and
    two steps to ``rank{rank}-{i}.txt``: "trained", or its error's class and message. (A
    refusal at wrap comes from the same all-gather on every rank, so the group stays in step
    for the next change.)"""
    init(rank, world, port, timeout_s=15.0)
    try:
        for i, change in enumerate(changes):
            kwargs = {"policies": ["keep", "keep"], **(change if rank == 1 else {})}
            plan = make_plan("gpt2-tiny", world, [0], 2, **kwargs)
            try:
                engine = wrap(build("gpt2-tiny", seed=1), plan, device="cpu")
                data = batches(
                    load_tokens(), plan.training.micro_batch, SEQ, 0, rank=rank, world_size=world
                )
                for _ in range(2):
                    engine.step(itertools.islice(data, plan.training.grad_accum))
                result = "trained"
            except Exception as e:  # noqa: BLE001 (the parent asserts which)
                result = f"{type(e).__name__}: {e}"
            Path(out, f"rank{rank}-{i}.txt").write_text(result)
    finally:
        dist.destroy_process_group()
    _exit_cleanly()


def train_packed(rank: int, world: int, port: int, out: str, name: str, steps: int) -> None:
    """Train ``steps`` steps of packed micro-batches, rank r's of step s from seed 10 * s + r
    (the ranks' supervised counts differ); write the losses and rank 0's state."""
    from harness import packed_micro_batch

    init(rank, world, port)
    try:
        plan = make_plan(name, world, [0], 2, ["swap", "checkpoint"])
        engine = wrap(build(name, seed=1), plan, AdamWConfig(lr=LR, weight_decay=0.1), device="cpu")
        losses = [
            engine.step(packed_micro_batch(10 * s + rank, MICRO, SEQ)).loss for s in range(steps)
        ]
        sd = engine.state_dict()
        if rank == 0:
            torch.save(sd, Path(out) / "state.pt")
        Path(out, f"rank{rank}.json").write_text(json.dumps({"losses": losses}))
        engine.close()
    finally:
        dist.destroy_process_group()
    _exit_cleanly()
