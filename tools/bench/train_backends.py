"""The back-ends tools/bench/train.py measures: protrain, FSDP2 offload (with full or
selective activation checkpointing), DeepSpeed ZeRO-3 offload and plain PyTorch, each set up
in the worker process that times it (train.py's docstring says what each one runs), and
the process-group and budget helpers they share."""

from __future__ import annotations

import gc
import os
import socket
import statistics
import time
from pathlib import Path

from tools.bench.train_models import Measured, accumulate_step, build_model, hidden_size, log

# ---------------------------------------------------------------------------
# Back-ends: each takes (args, config, label, device, record), adds its settings to the
# record and returns (step, finish): step(micro-batches) -> mean loss, finish(Measured)
# closes the back-end and adds what only it can measure.


def setup_protrain(args, cfg, label, dev, rec):
    import torch

    from protrain.executor import AdamWConfig, wrap
    from protrain.planner.commands.measure import measure
    from protrain.planner.hardware.spec import dump_spec, find_spec
    from protrain.planner.models.zoo import block_paths
    from protrain.planner.profiling.profile import dump_profile, load_profile
    from protrain.planner.search.planning import make_plan
    from protrain.plans import plan as P
    from protrain.plans.errors import BudgetError

    art = Path(args.artifacts) if args.artifacts else None
    stem = f"{label.replace('[', '-').replace(']', '')}-b{args.micro_batch}-s{args.seq}"
    t0 = time.perf_counter()
    if args.profile:
        profile = load_profile(args.profile)
        t = profile.training
        if (t.micro_batch, t.seq_len, t.compute_dtype) != (args.micro_batch, args.seq, args.dtype):
            raise ValueError(
                f"{args.profile} was profiled at micro-batch {t.micro_batch} × seq "
                f"{t.seq_len}, {t.compute_dtype}; this run asks for {args.micro_batch} × "
                f"{args.seq}, {args.dtype}: profile again, or match the options"
            )
        rec["profile_source"] = args.profile
    else:
        if args.hardware:
            spec = find_spec(args.hardware)
        else:
            from protrain.planner.hardware.probe import probe

            log("  probing this machine (copy bandwidth, Adam rates)")
            spec = probe(str(dev), quick=True)
            if art:
                (art / f"spec-{dev.type}.json").write_bytes(dump_spec(spec))
        log(f"  profiling {label} on {dev} ({args.dtype})")
        pmodel = build_model(cfg, args.seed)
        profile = measure(
            pmodel,
            name=label,
            blocks=block_paths(pmodel),
            micro_batch=args.micro_batch,
            seq_len=args.seq,
            compute_dtype=args.dtype,
            device=str(dev),
            spec=spec,
            iterations=args.profile_iters,
        )
        del pmodel
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        rec["profile_source"] = f"measured on {dev}, spec {spec.name} ({spec.source})"
        if art:
            (art / f"{stem}.profile.json").write_bytes(dump_profile(profile))
    rec["profile_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    try:
        plan, _ = make_plan(profile, rec["budget_bytes"], grad_accum=args.grad_accum)
    except BudgetError as e:
        raise DoesNotFit(f"planner: {e}") from None
    rec["plan_s"] = round(time.perf_counter() - t0, 3)
    if art:
        (art / f"{stem}-{human(rec['budget_bytes']).replace(' ', '')}.plan.json").write_bytes(
            P.dump(plan)
        )
    pol = [a.policy for a in plan.activations]
    rec["plan"] = {
        "n_chunks": len(plan.chunks.items),
        "n_persist": plan.placement.n_persist,
        "n_buffer": plan.placement.n_buffer,
        "n_swap": pol.count("swap"),
        "n_checkpoint": pol.count("checkpoint"),
        "chunk_numel": plan.chunks.chunk_numel,
    }
    rec["predicted_iter_s"] = plan.prediction.iter_time_us / 1e6
    rec["predicted_peak_bytes"] = plan.prediction.peak_memory_bytes
    log(
        f"  plan: {rec['plan']}, predicted {rec['predicted_iter_s'] * 1e3:.1f} ms/iter, "
        f"peak {human(rec['predicted_peak_bytes'])}"
    )

    enforce_budget(args, dev, rec)
    model = build_model(cfg, args.seed)
    engine = wrap(model, plan, AdamWConfig(lr=args.lr), device=dev)
    peaks: list[int] = []
    reserved: list[int | None] = []  # StepResult.reserved_peak_bytes, when the executor has it
    retries: list[int | None] = []  # StepResult.alloc_retries (the allocator's count so far)

    def step(micro):
        res = engine.step(micro)
        peaks.append(res.peak_bytes)
        reserved.append(getattr(res, "reserved_peak_bytes", None))
        retries.append(getattr(res, "alloc_retries", None))
        return res.loss

    def finish(measured: Measured):
        engine.close()
        # StepResult.peak_bytes: the allocator's peak on CUDA, the ledger's count on CPU.
        measured_peak = max(peaks[args.warmup :])
        measured_iter = statistics.median(measured.step_s)
        rec["measured_peak_bytes"] = measured_peak
        rec["measured_peak_source"] = "allocator" if dev.type == "cuda" else "ledger"
        rec["measured_iter_s"] = measured_iter
        rec["peak_ratio"] = measured_peak / rec["predicted_peak_bytes"]
        rec["iter_ratio"] = (
            measured_iter / rec["predicted_iter_s"] if rec["predicted_iter_s"] else None
        )
        # The engine's own view of the allocator over the measured steps (None before the
        # executor reported it; 0 on CPU). The max of a running count is its last value.
        r, n = reserved[args.warmup :], retries[args.warmup :]
        rec["engine_reserved_peak_bytes"] = None if None in r else max(r)
        rec["engine_alloc_retries"] = None if None in n else max(n)

    return step, finish  # batches stay on the host: the engine moves them


def setup_fsdp2(args, cfg, label, dev, rec, every: int):
    # every=1: fsdp2-offload; every=2: fsdp2-offload-sac (checkpoint blocks 0, 2, 4, ...).
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from protrain.planner.models.zoo import block_paths

    init_process_group(dev)
    enforce_budget(args, dev, rec)
    model = build_model(cfg, args.seed)
    paths = block_paths(model)
    ckpt = {id(model.get_submodule(p)) for i, p in enumerate(paths) if i % every == 0}
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: id(m) in ckpt
    )
    pin = dev.type == "cuda"  # pinning needs an accelerator: torch refuses it on a CPU-only build
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, args.dtype), reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=pin)
    try:
        for p in paths:
            fully_shard(model.get_submodule(p), mp_policy=mp, offload_policy=offload)
        fully_shard(model, mp_policy=mp, offload_policy=offload)
    except (RuntimeError, NotImplementedError, ValueError, AssertionError) as e:
        raise Skipped(f"torch refused fully_shard with CPUOffloadPolicy: {first_line(e)}") from None
    # fused AdamW runs on the host-side sharded parameters (DTensors on the CPU).
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    rec["ac"] = "every block" if every == 1 else "every other block (0, 2, 4, ...)"
    rec["offload"] = f"CPUOffloadPolicy(pin_memory={pin})"
    rec["mixed_precision"] = f"param_dtype={args.dtype}, reduce_dtype=float32"
    rec["optimizer"] = "torch.optim.AdamW(fused=True) on the host shards"

    def step(micro):
        return accumulate_step(model, opt, dev, micro)

    def finish(_m):
        import torch.distributed as dist

        dist.destroy_process_group()

    return step, finish


def setup_deepspeed(args, cfg, label, dev, rec):
    try:
        import deepspeed
    except ImportError as e:
        raise Skipped(f"deepspeed is not importable: {first_line(e)}") from None
    from torch.utils.checkpoint import checkpoint

    from protrain.planner.models.zoo import block_paths

    init_process_group(dev)
    enforce_budget(args, dev, rec)
    model = build_model(cfg, args.seed)
    for p in block_paths(model):  # checkpoint every block, as fsdp2-offload does
        block = model.get_submodule(p)
        block.forward = _checkpointed(block.forward, checkpoint)
    h = hidden_size(cfg)
    zero = {
        "stage": 3,
        "offload_param": {"device": "cpu", "pin_memory": dev.type == "cuda"},
        "offload_optimizer": {"device": "cpu", "pin_memory": dev.type == "cuda"},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": h * h,
        "stage3_prefetch_bucket_size": args.ds_prefetch_bucket or int(0.9 * h * h),
        "stage3_param_persistence_threshold": args.ds_persistence_threshold or 10 * h,
        "stage3_max_live_parameters": args.ds_max_live or int(1e9),
        "sub_group_size": int(1e9),
    }
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "bf16": {"enabled": args.dtype == "bfloat16"},
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    rec["ds_zero"] = zero
    rec["ds_version"] = deepspeed.__version__
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )

    def step(micro):
        total = 0.0
        for x, y in micro:
            loss = engine(x.to(dev), y.to(dev))
            engine.backward(loss)
            engine.step()  # an optimizer step only at the accumulation boundary
            total += loss.item() / len(micro)
        return total

    def finish(_m):
        import torch.distributed as dist

        dist.destroy_process_group()

    return step, finish


def _checkpointed(forward, checkpoint):
    def run(x):
        return checkpoint(forward, x, use_reentrant=False)

    return run


def setup_plain(args, cfg, label, dev, rec):
    import contextlib

    import torch

    enforce_budget(args, dev, rec)
    model = build_model(cfg, args.seed).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    autocast = args.dtype != "float32"
    rec["mixed_precision"] = (
        f"torch.autocast({dev.type}, {args.dtype}) over fp32 parameters"
        if autocast
        else "none (fp32)"
    )

    def step(micro):
        ctx = (
            (lambda: torch.autocast(dev.type, dtype=getattr(torch, args.dtype)))
            if autocast
            else contextlib.nullcontext
        )
        return accumulate_step(model, opt, dev, micro, ctx)

    return step, lambda _m: None


# ---------------------------------------------------------------------------
# Worker: one back-end, one record


class Skipped(Exception):
    """The back-end cannot run here (not installed, refused by torch); the message says why."""


class DoesNotFit(Exception):
    """The back-end does not fit the budget (planner refusal or out of memory)."""


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def human(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(dev) -> None:
    """A one-rank process group in this process: gloo on CPU, NCCL on CUDA."""
    import datetime as dt

    import torch.distributed as dist

    if dist.is_initialized():  # a probe before this one (bench_fit, in-process) ended early
        dist.destroy_process_group()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
    )
    kw = {"device_id": dev} if dev.type == "cuda" else {}
    dist.init_process_group(
        "nccl" if dev.type == "cuda" else "gloo",
        rank=0,
        world_size=1,
        timeout=dt.timedelta(seconds=300),
        **kw,
    )


def enforce_budget(args, dev, rec) -> None:
    """On CUDA, cap this process's allocator at the budget; on CPU there is nothing to cap."""
    import torch

    if dev.type != "cuda":
        rec["budget_enforced"] = False
        return
    total = torch.cuda.get_device_properties(dev).total_memory
    fraction = min(1.0, rec["budget_bytes"] / total)
    torch.cuda.set_per_process_memory_fraction(fraction, dev)
    rec["budget_enforced"] = True
    rec["memory_fraction"] = round(fraction, 6)
