"""Training throughput and memory: protrain against FSDP2 offload, DeepSpeed ZeRO-3 offload, plain.

What it answers: on one device, under one memory budget, how many tokens per
second does each back-end train a model at, how much device and host memory does
it take, and, for protrain, how close are the plan's predicted iteration time and
peak memory to the measured ones?

Back-ends (``--backend``, repeatable; every one trains the same zoo model code on
the same batches from ``planner/models/data.py``, the same dtype, sequence length and
global batch, with AdamW of the same hyper-parameters):

- ``protrain``: profile the model on this device (``planner.profile.measure``),
  plan it for ``--budget`` (``planner.planning.make_plan``), replay the plan
  (``executor.wrap``). The hardware spec is probed here unless ``--hardware``
  names one (a file or a name in ``plans/hardware/``).
- ``fsdp2-offload``: ``torch.distributed.fsdp.fully_shard`` on every block and the
  root with ``CPUOffloadPolicy`` (parameters, gradients and AdamW on the host),
  ``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=float32)``, activation
  checkpointing on every block (``checkpoint_wrapper``, non-reentrant) and
  ``AdamW(fused=True)`` on the host shards. Pinned host memory on CUDA only: a
  CPU-only torch refuses ``pin_memory`` ("Cannot access accelerator device"), so on
  CPU the policy is ``CPUOffloadPolicy(pin_memory=False)``, which runs under gloo.
- ``fsdp2-offload-sac``: the same with checkpointing on every other block
  (blocks 0, 2, 4, ...): selective activation checkpointing by block.
- ``deepspeed-zero3-offload``: ``deepspeed.initialize`` with ZeRO stage 3,
  parameters and optimizer offloaded to CPU memory (pinned on CUDA), DeepSpeed's
  CPU AdamW, bf16 on CUDA, checkpointing on every block (``torch.utils.checkpoint``,
  as the FSDP2 run). Only when
  ``deepspeed`` imports; otherwise a record with ``"skipped"``. The three stage-3
  knobs default to Hugging Face's ``"auto"`` rule from the hidden size h
  (prefetch bucket 0.9 h², persistence threshold 10 h, max live parameters 1e9)
  and are written into the record; they are that rule's values, not tuned on a GPU.
- ``torch-plain``: the model on the device, ``torch.optim.AdamW(fused=True)``,
  bf16 by ``torch.autocast`` over fp32 parameters (fp32 on CPU). An out-of-memory
  error gives a clean ``"fits": false`` record.

Measurement: each back-end runs in its own subprocess (a fresh CUDA context,
memory fraction, process group and allocator each; a crash or OOM stays in it),
``--rounds`` times with the back-end order rotated per repeat. On CUDA the budget
is enforced for every back-end by ``torch.cuda.set_per_process_memory_fraction(
budget / total)`` (protrain's profile is taken before the cap: it measures
compute, and its all-on-device profiling plan is not what is being tested). A step
is timed with ``perf_counter`` around all of its micro-batches and the optimizer
step, ending in a device synchronise and ``loss.item()``; tokens/s is the global
batch's tokens over that time, median over the steps after ``--warmup``, with
min/max and quartiles as the spread. Peak device memory is
``torch.cuda.max_memory_allocated`` from just before the first step to the end
(CUDA only); since the budget caps what the allocator *reserves*, every record also
carries ``max_memory_reserved_bytes`` and ``num_alloc_retries`` over the same steps
(null on CPU); protrain's records add the engine's own view, ``StepResult``'s
``reserved_peak_bytes`` and ``alloc_retries`` (as ``engine_reserved_peak_bytes`` and
``engine_alloc_retries``; null with an executor that does not report them).
Peak host memory is the worker's resident-set high-water mark, over
the steps (``peak_host_rss_train_bytes``: VmHWM reset just before the first step)
and over the whole process (``peak_host_rss_bytes``, model building and protrain's
probe and profile included). On CPU there is no device memory apart from host
memory: the budget is only the planner's (protrain's ledger is still checked
against its prediction) and ``budget_enforced`` is false.

One JSON object per run on stdout (also appended to ``--jsonl``); progress on
stderr. ``--report FILE...`` turns saved records into a markdown table, and with
``--write`` into this tool's section of BENCHMARKS.md.

    python -m tools.bench train --device cpu --model gpt2-tiny \\
        --backend protrain --backend torch-plain
    python -m tools.bench train --model gpt2-xl --budget 24GiB --micro-batch 8 --seq 1024 \\
        --backend protrain --backend fsdp2-offload --jsonl runs.jsonl
    python -m tools.bench train --report runs.jsonl [--write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from tools.bench import harness
from tools.bench.train_backends import (
    DoesNotFit,
    Skipped,
    first_line,
    setup_deepspeed,
    setup_fsdp2,
    setup_plain,
    setup_protrain,
)
from tools.bench.train_models import (  # noqa: F401 (TINY_LADDERS: fit.py reads it from here)
    TINY_LADDERS,
    log,
    resolve_config,
    run_steps,
    spread,
)

ROOT = harness.ROOT
if os.environ.get("PROTRAIN_ASYNC_CPU"):  # gpu_check.sh's CPU rehearsal: asynchronous CPU copies
    import tools.emulation  # noqa: F401  (installs itself as executor/transfer.py EMULATION)
BACKENDS = (
    "protrain",
    "fsdp2-offload",
    "fsdp2-offload-sac",
    "deepspeed-zero3-offload",
    "torch-plain",
)
DTYPE_NAMES = ("float32", "bfloat16")


def resolve_budget(args, dev) -> int:
    from protrain.planner.search.planning import parse_budget

    if args.budget:
        return parse_budget(args.budget)
    if dev.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(dev).total_memory
    from protrain.planner.hardware.spec import find_spec

    return find_spec("cpu").usable_memory_bytes


def worker(args) -> dict:
    import torch

    torch.manual_seed(args.seed)  # the executor's and torch's RNG users (none with dropout off)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev.index or 0)
        dev = torch.device("cuda", dev.index or 0)
    label, cfg = resolve_config(args.model, args.layers, args.seq)
    from protrain.planner.commands.fit import n_params

    rec = {
        "backend": args.worker,
        "model": label,
        "n_params": n_params(cfg),
        "device": dev.type,
        "device_name": (torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()),
        "dtype": args.dtype,
        "micro_batch": args.micro_batch,
        "seq": args.seq,
        "grad_accum": args.grad_accum,
        "world_size": 1,
        "global_batch": args.micro_batch * args.grad_accum,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": torch.get_num_threads(),
        "budget_bytes": resolve_budget(args, dev),
        "torch": torch.__version__,
    }
    t_setup = time.perf_counter()
    setups = {
        "protrain": setup_protrain,
        "torch-plain": setup_plain,
        "fsdp2-offload": lambda *a: setup_fsdp2(*a, every=1),
        "fsdp2-offload-sac": lambda *a: setup_fsdp2(*a, every=2),
        "deepspeed-zero3-offload": setup_deepspeed,
    }
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        step, finish = setups[args.worker](args, cfg, label, dev, rec)
        from protrain.planner.models.data import batches, load_tokens

        data = batches(load_tokens(), args.micro_batch, args.seq, args.seed)
        rec["setup_s"] = round(time.perf_counter() - t_setup, 2)
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
            torch.cuda.reset_accumulated_memory_stats(
                dev
            )  # num_alloc_retries counts the steps only
        reset_ok = reset_host_peak()
        log(f"{args.worker}: {args.steps} steps of {rec['global_batch']} x {args.seq} tokens")
        measured = run_steps(step, data, args, sync)
        if cuda:
            rec["peak_dev_bytes"] = torch.cuda.max_memory_allocated(dev)
            rec.update(allocator_stats(dev))
        else:
            rec["peak_dev_bytes"] = (
                None  # no device apart from host memory: see peak_host_rss_bytes
            )
        rec["peak_host_rss_train_bytes"] = host_peak() if reset_ok else None
        finish(measured)
    except Skipped as e:
        rec.update(fits=None, skipped=str(e))
        return finalize(rec)
    except DoesNotFit as e:
        rec.update(fits=False, reason=str(e))
        return finalize(rec)
    except torch.OutOfMemoryError as e:
        rec.update(fits=False, reason=f"out of memory: {first_line(e)}")
        return finalize(rec)
    tokens = rec["global_batch"] * args.seq
    tps = [tokens / s for s in measured.step_s]
    rec.update(
        fits=True,
        loss_first=measured.losses[0],
        loss_last=measured.losses[-1],
        step_s_median=statistics.median(measured.step_s),
        tokens_per_s=statistics.median(tps),
        tokens_per_s_spread=spread(tps),
    )
    return finalize(rec)


def reset_host_peak() -> bool:
    """Reset this process's resident-set high-water mark (Linux: VmHWM), if the kernel lets us.

    Then ``host_peak()`` after the steps is the training loop's own peak (model, optimizer
    states, host homes, swapped activations), without what setup touched and gave back
    (protrain's hardware probe and profiling model, for example).
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def host_peak() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def allocator_stats(dev=None) -> dict:
    """What the budget caps on CUDA: the caching allocator's reserved peak and its retries.

    ``max_memory_reserved_bytes``: ``torch.cuda.max_memory_reserved`` (allocated bytes plus
    the cache's unused blocks and fragmentation: what ``set_per_process_memory_fraction``
    limits). ``num_alloc_retries``: ``memory_stats()["num_alloc_retries"]``, the times a
    cudaMalloc failed and the allocator freed its cache to retry, a sign of running at the
    cap. Both over the measured steps when the run reached them (the worker resets them
    just before), else since the worker started; None on CPU or before CUDA was used.
    """
    import torch

    if dev is None:
        if not torch.cuda.is_initialized():
            return {"max_memory_reserved_bytes": None, "num_alloc_retries": None}
        dev = torch.device("cuda", torch.cuda.current_device())
    return {
        "max_memory_reserved_bytes": torch.cuda.max_memory_reserved(dev),
        "num_alloc_retries": int(torch.cuda.memory_stats(dev).get("num_alloc_retries", 0)),
    }


def finalize(rec: dict) -> dict:
    # ru_maxrss is KiB on Linux: the whole worker's high-water mark, model building included.
    # The kernel updates it lazily (it can read a few pages below the VmHWM of the steps), so
    # the run's peak is the larger of the two.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rec["peak_host_rss_bytes"] = max(rss, rec.get("peak_host_rss_train_bytes") or 0)
    if "max_memory_reserved_bytes" not in rec:  # a run that stopped before its steps ended
        try:
            stats = allocator_stats() if str(rec.get("device")).startswith("cuda") else {}
        except Exception:  # a broken CUDA context must not cost the record
            stats = {}
        rec.setdefault("max_memory_reserved_bytes", stats.get("max_memory_reserved_bytes"))
        rec.setdefault("num_alloc_retries", stats.get("num_alloc_retries"))
    return rec


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


# ---------------------------------------------------------------------------
# Parent: one subprocess per (repeat, back-end)


def git_commit() -> str:
    """HEAD's short hash, or ``$BENCH_COMMIT`` (a copy of the tree without .git, as on a lent
    GPU)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_all(args, argv: list[str]) -> list[dict]:
    command = harness.command("train", argv)
    meta = {
        "command": command,
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    backends = list(dict.fromkeys(args.backend or ["protrain", "torch-plain"]))
    records = []
    for rep in range(args.repeats):
        # Rotate the order each repeat, so no back-end always runs first (cold) or last.
        order = backends[rep % len(backends) :] + backends[: rep % len(backends)]
        for b in order:
            log(f"repeat {rep + 1}/{args.repeats}: {b} on {args.model} ({args.device})")
            rec = spawn(args, argv, b)
            rec.update(repeat=rep, **meta)
            line = json.dumps(rec)
            print(line, flush=True)
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(line + "\n")
            records.append(rec)
            if rec.get("fits"):
                log(f"{b}: {rec['tokens_per_s']:,.0f} tokens/s")
            else:
                log(f"{b}: {rec.get('skipped') or rec.get('reason') or rec.get('error')}")
    return records


def spawn(args, argv: list[str], backend: str) -> dict:
    cmd = [sys.executable, "-m", "tools.bench", "train", *argv, "--worker", backend]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    base = {
        "backend": backend,
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "micro_batch": args.micro_batch,
        "seq": args.seq,
        "grad_accum": args.grad_accum,
        "global_batch": args.micro_batch * args.grad_accum,
        "fits": None,
        "max_memory_reserved_bytes": None,
        "num_alloc_retries": None,
    }  # the worker died: unknown
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, text=True, env=env, timeout=args.timeout, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        return {**base, "error": f"timed out after {args.timeout} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    for ln in proc.stdout.splitlines():  # what a library printed (DeepSpeed logs to stdout)
        if not ln.startswith("{"):
            print(ln, file=sys.stderr)
    if proc.returncode == 0 and lines:
        rec = json.loads(lines[-1])
        rec["wall_s"] = round(time.perf_counter() - t0, 1)
        return rec
    return {
        **base,
        "error": f"worker exited with status {proc.returncode} "
        f"({'no record' if not lines else 'see stderr'}); its stderr is above",
    }


# ---------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    ap = harness.parser("train", __doc__, rounds=1, what="runs of every back-end, order rotated")
    ap.add_argument(
        "--backend",
        action="append",
        choices=BACKENDS,
        help="back-end to run (repeatable; default protrain and torch-plain)",
    )
    ap.add_argument(
        "--model",
        default="gpt2-tiny",
        help="zoo name, or ladder:FAMILY:I / tiny:FAMILY:I (default gpt2-tiny)",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="replace the model's depth (a reduced-depth model of the same width)",
    )
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default=None,
        help="compute dtype (default bfloat16 on CUDA, float32 on CPU)",
    )
    ap.add_argument(
        "--micro-batch", type=int, default=4, help="sequences per micro-batch (default 4)"
    )
    ap.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (default 1)")
    ap.add_argument(
        "--steps", type=int, default=8, help="steps per run, warm-up included (default 8)"
    )
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps (default 2)")
    ap.add_argument(
        "--budget",
        default=None,
        help="device memory budget, e.g. 24GiB (default: the whole device; on CPU "
        "the cpu spec's usable memory)",
    )
    ap.add_argument(
        "--hardware",
        default=None,
        help="protrain: hardware spec name or file instead of probing this machine",
    )
    ap.add_argument(
        "--profile",
        default=None,
        help="protrain: a saved profile to plan from instead of profiling",
    )
    ap.add_argument(
        "--profile-iters", type=int, default=3, help="protrain: measured profile iterations"
    )
    ap.add_argument(
        "--artifacts",
        default=None,
        help="protrain: directory to write the spec, profile and plan into",
    )
    ap.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    ap.add_argument("--seed", type=int, default=0, help="model init and data seed")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads in each worker (default: torch's; 1 is steadier "
        "on a shared CPU box)",
    )
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per run before it is killed")
    ap.add_argument("--jsonl", default=None, help="also append every record to this file")
    ap.add_argument(
        "--ds-prefetch-bucket",
        type=int,
        default=None,
        help="deepspeed stage3_prefetch_bucket_size (default 0.9 h^2)",
    )
    ap.add_argument(
        "--ds-max-live",
        type=int,
        default=None,
        help="deepspeed stage3_max_live_parameters (default 1e9)",
    )
    ap.add_argument(
        "--ds-persistence-threshold",
        type=int,
        default=None,
        help="deepspeed stage3_param_persistence_threshold (default 10 h)",
    )
    ap.add_argument(
        "--report",
        nargs="+",
        default=None,
        metavar="JSONL",
        help="print the markdown table of saved records instead of running",
    )
    ap.add_argument("--worker", choices=BACKENDS, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    harness.no_baseline(ap, args)
    args.repeats = args.rounds
    if args.write and args.report is None:
        ap.error("--write goes with --report: the section is made from saved records")
    if args.report is None:
        if args.device is None or args.device.startswith("cuda"):
            import torch  # only to ask about CUDA: a parent with --device cpu starts faster without

            args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
            if args.device.startswith("cuda") and not torch.cuda.is_available():
                ap.error("--device cuda: torch sees no CUDA device here")
        args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
        if args.steps <= args.warmup:
            ap.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    return args


def main(argv: list[str] | None = None, name: str = "train") -> int:
    argv = list(sys.argv[2:] if argv is None else argv)
    args = parse(argv)
    if args.report is not None:
        from tools.bench.train_report import load_records, report_section, report_table

        records = load_records(args.report)
        if args.write:
            harness.write_section(name, report_section(records))  # our section only
        print(report_table(records))
        return 0
    if args.worker:
        try:
            rec = worker(args)
        except Exception as e:  # a record that says what broke beats a lost run
            traceback.print_exc()
            rec = {
                "backend": args.worker,
                "model": args.model,
                "device": args.device,
                "dtype": args.dtype,
                "micro_batch": args.micro_batch,
                "seq": args.seq,
                "grad_accum": args.grad_accum,
                "global_batch": args.micro_batch * args.grad_accum,
                "fits": None,
                "error": first_line(e),
            }
            rec = finalize(rec)
        print(json.dumps(rec), flush=True)
        return 0
    run_all(args, argv)
    return 0
