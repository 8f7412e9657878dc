"""Host bytes per offloaded parameter, measured: peak RSS of a real training step against
``plans/accounting.py``'s prediction (issue 17).

Each case runs in a fresh process: it reads ``VmRSS`` (the baseline: torch imported,
nothing built), builds the model (fp32, on CPU), wraps it under a plan whose chunks
are all offloaded, trains ``--steps`` steps, and reads ``VmHWM`` (the process's peak
RSS). ``(VmHWM - baseline) / offloaded parameters`` is what training cost the host per
parameter at its peak, the model's own fp32 weights included while they lived (wrap
moves them into chunks and frees them). The prediction is ``memory_walk.walk(plan)``'s
host bytes (+ the swapped activations, none here) over the same parameters.

    python -m tools.bench host                # print the table
    python -m tools.bench host --write        # and replace its section in BENCHMARKS.md
    python -m tools.bench host --device cuda --row gpt2-medium,bfloat16,1,1,0 --jsonl host.jsonl
    python -m tools.bench host --report host.jsonl   # the rows of such runs, as a table
    python -m tools.bench host-lora --write   # LoRA (peft, r=16 on the attention projections):
                                              # host bytes per frozen parameter, its own section

On a GPU (``--device cuda``, tools/gpu_check.sh) the chunk buffers, gradients, activations
and op temporaries live in device memory, so nothing is subtracted from the host's peak:
what it reads is the plan's host states plus whatever the host side of training left in
the heap, free of the CPU emulation's device-side blocks (``MMAP_ENV``). The CUDA context
and the model's kernels come up in a warm-up on the device, before the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from tools.bench import harness

ROOT = harness.ROOT
if os.environ.get("PROTRAIN_ASYNC_CPU"):  # gpu_check.sh's CPU rehearsal: asynchronous CPU copies
    import tools.emulation  # noqa: F401  (installs itself as executor/transfer.py EMULATION)
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
"""glibc raises its mmap threshold (up to 32 MiB) each time a mapped block is freed, so
later blocks below it come from the heap and stay resident after they are freed. On a
CPU run the "device" side (activations, gradients, op temporaries) shares that heap with
the host states, and its freed blocks inflate the host's high-water mark; on a GPU they
never touch host memory. Fixing the threshold at 1 MiB returns them to the OS: the second
measurement of every row."""
CASES = [  # (zoo model, compute dtype, grad_accum, homeless: every offloaded chunk without a home,
    #         nvme: every offloaded chunk's master and moments on disk, executor/nvme.py)
    ("gpt2-medium", "bfloat16", 1, True, False),
    ("gpt2-large", "bfloat16", 1, True, False),
    ("gpt2-medium", "bfloat16", 1, False, False),
    ("gpt2-medium", "float32", 1, False, False),
    ("gpt2-medium", "bfloat16", 2, False, False),
    ("gpt2-medium", "bfloat16", 1, True, True),
    ("gpt2-medium", "float32", 1, False, True),
]


LORA_CASES = [
    ("gpt2-medium", "bfloat16", 1, False, False),
    ("gpt2-large", "bfloat16", 1, False, False),
]
"""``--lora``'s rows: the model with peft's LoRA (r=16, alpha 32, the attention projections)
and its base frozen; every chunk offloaded, so the frozen base's chunks keep their home
(compute dtype) and nothing else (plans/homes.py), the adapters' chunk its states."""


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _warm_up(torch, dtype: str) -> None:
    """One small forward and backward in the compute dtype on the CPU before the baseline is
    read: the first ops start the autograd engine, the intra-op thread pool and the kernels'
    own buffers (tens of MB, once per process), which are no host state of the plan. (On a
    GPU the CPU steps and roundings still run here; ``_warm_up_model`` does the device.)"""
    dt = getattr(torch, dtype)
    emb = torch.nn.Embedding(1024, 256, dtype=dt)
    x = emb(torch.randint(0, 1024, (1, 64)))
    torch.nn.functional.cross_entropy(
        (x @ emb.weight.t()).flatten(0, 1).float(), torch.randint(0, 1024, (64,))
    ).backward()


def _warm_up_model(torch, model_name: str, dtype: str, device: str, seq_len: int) -> None:
    """On a GPU, one forward and backward of a one-block model of ``model_name``'s family
    and widths, built on the device, before the baseline: CUDA loads kernels lazily, and
    the host memory of the modules GPT-2's layernorm, GELU, attention and GEMM shapes load
    in the first step would read as the plan's. Built on the device, it leaves nothing in
    the host's heap for the measured run to reuse."""
    import dataclasses

    from protrain.planner.models.zoo import GPT2, ZOO, GPT2Config, Llama, lm_loss, materialize

    cfg = dataclasses.replace(ZOO[model_name], n_layer=1)
    with torch.device("meta"):
        meta = GPT2(cfg) if isinstance(cfg, GPT2Config) else Llama(cfg)
    model = materialize(meta, device=device).to(getattr(torch, dtype))
    idx = torch.randint(0, cfg.vocab_size, (1, seq_len), device=device)
    lm_loss(model(idx), idx).backward()
    torch.cuda.synchronize()
    del model, meta
    torch.cuda.empty_cache()


def host_share(device_peak: int, device: str) -> int:
    """The device's bytes in the host's RSS, subtracted from its peak: on a CPU run (the
    "device" is host memory) its whole peak, on a GPU none."""
    return device_peak if device == "cpu" else 0


def run_case(
    model_name: str,
    dtype: str,
    accum: int,
    homeless: bool,
    steps: int,
    nvme: str | None = None,
    device: str = "cpu",
    lora: bool = False,
) -> dict:
    import torch

    from protrain.executor import wrap
    from protrain.planner.models.data import batches, load_tokens
    from protrain.planner.models.lora import LoraSpec
    from protrain.planner.models.lora import build_model as _build
    from protrain.planner.models.zoo import block_paths
    from protrain.planner.search import memory_walk
    from protrain.planner.search.cost import choose_chunk_numel
    from protrain.planner.search.emit import emit, model_facts
    from protrain.plans import plan as P

    spec = LoraSpec() if lora else None

    def build(name, **kw):
        return _build(name, spec, **kw)

    if device == "cpu":
        torch.set_num_threads(2)  # the CI box's cores; a GPU host's CPU step takes them all
    meta = build(model_name, device="meta")
    blocks = block_paths(meta)
    size, _ = choose_chunk_numel(model_facts(meta, model_name, blocks))
    training = P.Training(
        micro_batch=1,
        seq_len=64,
        compute_dtype=dtype,
        master_dtype="float32",
        world_size=1,
        grad_accum=accum,
    )
    plan = emit(
        meta,
        name=model_name,
        blocks=blocks,
        training=training,
        chunk_numel=size,
        persistent=[],
        n_buffer=3,
        policies=["checkpoint"] * len(blocks),
    )
    if homeless:  # placement.homeless: every offloaded chunk, with the planner's HOST_SLOTS slots
        plan = emit(
            meta,
            name=model_name,
            blocks=blocks,
            training=training,
            chunk_numel=size,
            persistent=[],
            n_buffer=3,
            policies=["checkpoint"] * len(blocks),
            homeless=plan.placement.offloaded,
        )
    if nvme:  # placement.nvme: every offloaded chunk's master and moments in a file under ``nvme``
        plan = emit(
            meta,
            name=model_name,
            blocks=blocks,
            training=training,
            chunk_numel=size,
            persistent=[],
            n_buffer=3,
            policies=["checkpoint"] * len(blocks),
            homeless=plan.placement.homeless,
            nvme=plan.placement.offloaded,
        )
    del meta
    _warm_up(torch, dtype)
    if device != "cpu":  # the CUDA context and the model's kernels
        _warm_up_model(torch, model_name, dtype, device, training.seq_len)
    tokens = (
        load_tokens()
    )  # the corpus (a few MB) is no host state of the plan: read before the baseline
    baseline = _kib("VmRSS")
    file_base = _kib("RssFile")
    model = build(model_name, device="cpu")
    n = sum(p.numel() for p in model.parameters())
    engine = wrap(model, plan, device=device, nvme_dir=nvme)
    del model
    wrapped = _kib("VmRSS")
    # Training's own high-water from here (Linux: writing 5 to clear_refs resets VmHWM to the
    # current RSS): the whole-process peak can come from building the user's fp32 model (4 B
    # per parameter) before wrap, when the plan's host states are smaller than that.
    wrap_peak = _kib("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")
    data = batches(tokens, plan.training.micro_batch, plan.training.seq_len, 0)
    t0 = time.perf_counter()
    device_peak = 0
    first = (
        0  # the high-water after the first step (glibc's heap grows over the next ones: MMAP_ENV)
    )
    for i in range(steps):
        device_peak = max(device_peak, engine.step([next(data) for _ in range(accum)]).peak_bytes)
        if i == 0:
            first = _kib("VmHWM") - host_share(device_peak, device)
    if device != "cpu":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    engine.close()
    train_peak = _kib("VmHWM")
    # Pages of files (the libraries' code and kernels, first touched by the steps: on CUDA
    # the modules its lazy loading maps) are in RSS too, and no memory the plan holds.
    file_growth = max(0, _kib("RssFile") - file_base)
    peak = max(wrap_peak, train_peak)
    on_host = host_share(device_peak, device)
    walk = memory_walk.walk(plan)
    offloaded = sum(
        p.numel for c in plan.chunks.items for p in c.params if c.id in plan.placement.offloaded
    )
    if (
        lora
    ):  # per frozen parameter (every chunk is offloaded); full training's prediction beside it
        full = memory_walk.walk(plan, trainable=[True] * len(plan.chunks.items))
        frozen = sum(p.numel for c in plan.chunks.items for p in c.params if p.frozen)
        extra = {
            "lora": True,
            "frozen": frozen,
            "full_predicted_per_param": (full.host_bytes + full.host_swap_bytes) / n,
        }
        offloaded = frozen
    else:
        extra = {}
    return {
        **extra,
        "model": model_name,
        "dtype": dtype,
        "grad_accum": accum,
        "homeless": homeless,
        "nvme": bool(nvme),
        "device": device,
        "disk_per_param": walk.disk_bytes / offloaded,
        "slots": plan.placement.n_host_slots,
        "params": n,
        "offloaded": offloaded,
        "wrapped_per_param": (wrapped - baseline) / offloaded,
        "measured_per_param": (peak - baseline - on_host) / offloaded,
        "train_peak_per_param": (train_peak - baseline - on_host) / offloaded,
        "first_step_per_param": (max(wrap_peak - on_host, first) - baseline) / offloaded,
        "steps": steps,
        "device_peak_per_param": device_peak / offloaded,
        "predicted_per_param": (walk.host_bytes + walk.host_swap_bytes) / offloaded,
        "file_growth_per_param": file_growth / offloaded,
        "chunk_numel": plan.chunks.chunk_numel,
        "step_s": seconds / steps,
    }


def render(rows: list[dict], cmd: str) -> str:
    lines = [
        harness.heading("host"),
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}; date {time.strftime('%Y-%m-%d')}.",
        "",
        "A fresh process per row builds the model in fp32 on the CPU, wraps it under a plan with "
        "every chunk offloaded (checkpointed blocks, micro-batch 1 × 64) and trains "
        f"{rows[0]['steps']} step(s) (the heap of a CPU run under glibc's default allocator grows "
        "over "
        "the first three: see the reading). *Homes*: "
        "kept (a compute-dtype copy per offloaded chunk, 14 B per element in bf16), or none: every "
        "offloaded chunk in `placement.homeless` (12 B: fp32 master and Adam moments; uploads and "
        "gradients pass through the plan's `n_host_slots` pinned slots of one shard each). "
        "*After wrap*: RSS once wrap has moved the weights into chunks, minus the RSS before the "
        "model was built (torch imported, the corpus read, one small forward and backward run), "
        "per "
        "offloaded parameter. *Peak*: the process's peak RSS (`VmHWM`) minus that baseline and "
        "minus "
        'the step\'s device peak as the CPU ledger counts it (on a CPU run the "device" is host '
        "memory too; the ledger counts the chunk buffers, gradients, saved activations and the "
        "gradient autograd holds for the tied embedding between the head's backward and the "
        "embedding's, `accounting.shared_grads`), per offloaded parameter: what the host "
        "states cost at their worst, allocator slack included. *Peak, mmap threshold 1 MiB*: the "
        "same "
        "in a process started with `MALLOC_MMAP_THRESHOLD_=1048576`; glibc's default raises its "
        "mmap "
        "threshold as mapped blocks are freed, so freed device-side blocks of the CPU run (op "
        "temporaries the ledger does not count, which on a GPU never touch host memory) stay in "
        "the "
        "heap and in RSS. *Predicted*: "
        "`memory_walk.walk(plan).host_bytes` per offloaded parameter: at one rank each chunk's "
        "host "
        "states stop at its last parameter (`accounting.host_numel`, not the chunk's padding), "
        "plus "
        "the slots and the CPU step's fp32 scratch of one 1M-element piece. *After wrap* is below "
        "it "
        "where pages are not yet touched (slots and fp32 accumulators are first written by the "
        "step). "
        "*Peak in training*: the same as *peak* with the high-water mark reset once wrap is done "
        "(`/proc/self/clear_refs`), so without the user's fp32 model built on the host before wrap "
        "(4 B per parameter), which sets the whole-process peak where the plan's states are "
        "smaller.",
        "",
        "| model | params | compute | grad accum | homes | chunk | predicted B/param | after wrap "
        "| peak | peak / predicted | peak, mmap threshold 1 MiB | its ratio | peak in training |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        homes = f"none (homeless, {r['slots']} slot)" if r["homeless"] else "kept"
        homes += "; master and moments on disk" if r.get("nvme") else ""
        lines.append(
            f"| {r['model']} | {r['params'] / 1e6:.0f}M | {r['dtype']} | {r['grad_accum']} | "
            f"{homes} | {r['chunk_numel'] / 1e6:.1f}M | {r['predicted_per_param']:.2f} | "
            f"{r['wrapped_per_param']:.2f} | {r['measured_per_param']:.2f} | "
            f"{r['measured_per_param'] / r['predicted_per_param']:.3f} | "
            f"{r['measured_mmap_per_param']:.2f} | "
            f"{r['measured_mmap_per_param'] / r['predicted_per_param']:.3f} | "
            f"{r.get('train_peak_per_param', float('nan')):.2f} |"
        )
    lines += ["", reading(rows)]
    return "\n".join(lines) + "\n"


def reading(rows: list[dict]) -> str:
    """The figures the issue asks for, read off the rows."""
    h = [r for r in rows if r["homeless"] and not r.get("nvme")]
    if not h:
        return ""
    worst = max(h, key=lambda r: r["measured_per_param"])
    # (the NVMe rows: an absolute excess, _disk; their prediction is a fraction of a byte)
    ratios = [
        r[k] / r["predicted_per_param"]
        for r in rows
        if not r.get("nvme")
        for k in ("measured_per_param", "measured_mmap_per_param")
    ]
    fp32 = [
        r
        for r in rows
        if r["dtype"] == "float32"
        and not r.get("nvme")
        and r["measured_per_param"] < r["predicted_per_param"]
    ]
    creep = ", ".join(
        f"{r['model']} {r['first_step_per_param']:.2f}" for r in h if "first_step_per_param" in r
    )
    slot = ", ".join(
        f"{r['slots'] * r['chunk_numel'] * 2 / r['offloaded']:.2f} B at {r['model']}" for r in h
    )
    return (
        "Reading. Homeless (12 B layout), peak host bytes per offloaded parameter: "
        + ", ".join(
            f"{r['model']} {r['measured_per_param']:.2f} (mmap threshold fixed "
            f"{r['measured_mmap_per_param']:.2f}; predicted {r['predicted_per_param']:.2f})"
            for r in h
        )
        + f". Peak over predicted, rows in host memory: {min(ratios):.3f} to {max(ratios):.3f}. "
        + (
            (
                f"After the first step alone, under glibc's default: {creep}; the heap's free "
                "blocks grow over the next two steps (the LM head's backward temporaries, device "
                "memory on a GPU, fragment it) and then hold (gpt2-medium over 8 steps: the "
                "section 'Host bytes over eight steps'), while with the threshold fixed RSS is "
                "flat from the first step. "
            )
            if creep and rows[0]["steps"] > 1
            else ""
        )
        + _marginal(h)
        + (
            f"The worst homeless row ({worst['model']}) is {worst['measured_per_param'] - 12:.2f} "
            "B over the 12 B of states: the slots of one chunk shard each (a chunk holds at least "
            f"the largest parameter, GPT-2's tied embedding: {slot} per parameter), the step's "
            "scratch, and allocator slack. The device count subtracted includes the gradient "
            "autograd holds for the tied embedding between the head's backward and the "
            "embedding's (`accounting.shared_grads`, 51.5M x 2 B = 0.29 B per parameter at 355M), "
            "which is device memory on a GPU. "
        )
        + (
            "The fp32 row reads below its prediction because its host "
            "high-water comes at the end of backward (the fp32 accumulators are first written as "
            "each chunk's gradients land, and on a CPU an allocated page costs nothing until "
            "written) while the subtracted device peak comes earlier; pinned memory on a GPU is "
            "resident from allocation. "
            if fp32
            else ""
        )
        + _disk(rows)
    ).rstrip()


def _disk(rows: list[dict]) -> str:
    """What the NVMe rows moved off the host: each against the same layout in RAM."""
    out = []
    for d in (r for r in rows if r.get("nvme")):
        same = next(
            (
                r
                for r in rows
                if not r.get("nvme")
                and all(r[k] == d[k] for k in ("model", "dtype", "grad_accum", "homeless"))
            ),
            None,
        )
        if same is None:
            continue
        tp = "train_peak_per_param" if "train_peak_per_param" in d else "measured_per_param"
        fixed = (
            f", {d['train_peak_mmap_per_param']:.2f} with the threshold fixed"
            if "train_peak_mmap_per_param" in d
            else ""
        )
        out.append(
            f"{d['model']} {d['dtype']} ({'homeless' if d['homeless'] else 'homes kept'}): peak "
            f"{'in training ' if tp != 'measured_per_param' else ''}{d[tp]:.2f} B per parameter "
            f"(predicted {d['predicted_per_param']:.2f}{fixed}) with "
            f"master and moments on disk against {same[tp]:.2f} in host memory, a drop of "
            f"{same[tp] - d[tp]:.2f} B (whole-process peaks {d['measured_per_param']:.2f} and "
            f"{same['measured_per_param']:.2f}; "
            f"{same['measured_mmap_per_param'] - d['measured_mmap_per_param']:.2f} "
            f"with the threshold fixed) where the plan moved 12 B per element to the disk "
            f"({d['disk_per_param']:.2f} B per parameter in the file, alignment included); a step "
            f"took {d['step_s']:.1f} s against {same['step_s']:.1f} s "
            f"({d['step_s'] / same['step_s']:.2f}x; mean of {d['steps']} step(s) each, CPU "
            '"device", so the disk\'s share '
            "is diluted by the CPU forward and backward)"
        )
    return (
        ("NVMe tier (executor/nvme.py; the state file under `--nvme-dir`): " + "; ".join(out) + ".")
        if out
        else ""
    )


def _marginal(h: list[dict]) -> str:
    """Host bytes per parameter *added* from the smallest homeless model to the largest
    (peak and predicted): what a larger model costs, free of what does not grow with it."""
    if len(h) < 2:
        return ""
    a, b = min(h, key=lambda r: r["offloaded"]), max(h, key=lambda r: r["offloaded"])
    slope = {
        k: (b[k] * b["offloaded"] - a[k] * a["offloaded"]) / (b["offloaded"] - a["offloaded"])
        for k in ("measured_per_param", "measured_mmap_per_param", "predicted_per_param")
    }
    return (
        f"From {a['model']} to {b['model']} each added parameter cost "
        f"{slope['measured_per_param']:.2f} B ({slope['measured_mmap_per_param']:.2f} with the "
        f"threshold fixed; predicted {slope['predicted_per_param']:.2f}). "
    )


def render_rows(rows: list[dict], cmd: str) -> str:
    """Rows of a ``--row`` or ``--device cuda`` run (tools/gpu_check.sh): one table, the
    device named, nothing subtracted on a GPU (the module's docstring)."""
    lines = [
        f"## Host bytes per offloaded parameter, {', '.join(sorted({r['device'] for r in rows}))} "
        "(python -m tools.bench host --row/--device)",
        "",
        f"Command: `{cmd}`",
        "",
        "Peak host RSS (`VmHWM`) minus the baseline (torch, the device context and the corpus "
        "loaded), per offloaded parameter; on a CPU run minus the ledger's device peak too. "
        "*Training*: the high-water reset once wrap is done (without the user's fp32 model "
        "built on the host).",
        "",
        "*File pages*: growth of `RssFile` over the run (libraries' code and kernels first "
        "touched by the steps; on CUDA, lazily loaded modules), part of every peak here.",
        "",
        "| device | model | params | compute | homes | predicted B/param | peak | training | "
        "training / predicted | training, mmap threshold 1 MiB | after step 1 | file pages | step "
        "s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mmap = r.get("train_peak_mmap_per_param")
        lines.append(
            f"| {r['device']} | {r['model']} | {r['params'] / 1e6:.3g}M | {r['dtype']} | "
            f"{'none' if r['homeless'] else 'kept'}{'; disk' if r.get('nvme') else ''} | "
            f"{r['predicted_per_param']:.2f} | {r['measured_per_param']:.2f} | "
            f"{r['train_peak_per_param']:.2f} | "
            f"{r['train_peak_per_param'] / r['predicted_per_param']:.3f} | "
            f"{'-' if mmap is None else f'{mmap:.2f}'} | {r['first_step_per_param']:.2f} | "
            f"{r.get('file_growth_per_param', float('nan')):.2f} | {r['step_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def measure(
    cases: list[tuple],
    steps: int,
    nvme_dir: str,
    device: str,
    jsonl: str | None = None,
    lora: bool = False,
) -> list[dict]:
    """Each case in two fresh processes, glibc's default allocator and ``MMAP_ENV``; each row
    appended to ``jsonl`` as soon as it is measured (a time-boxed GPU run keeps what it did).
    A case whose process fails is reported with its error and skipped (its stderr reaches
    ours), so one row that cannot run leaves the others measured."""
    rows = []
    for name, dtype, accum, homeless, nvme in cases:
        case = f"{name},{dtype},{accum},{int(homeless)},{int(nvme)}"
        runs = []
        for env in ({}, MMAP_ENV):
            p = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tools.bench",
                    "host",
                    "--case",
                    case,
                    "--steps",
                    str(steps),
                    "--nvme-dir",
                    nvme_dir,
                    "--device",
                    device,
                    *(["--lora"] if lora else []),
                ],
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, **env},
                cwd=ROOT,
            )
            if p.returncode != 0:
                print(
                    f"host: {case} on {device}{' with ' + str(env) if env else ''} failed "
                    f"(exit {p.returncode}; its error is above); skipped",
                    file=sys.stderr,
                )
                break
            runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
        if len(runs) < 2:
            continue
        rows.append(
            {
                **runs[0],
                "measured_mmap_per_param": runs[1]["measured_per_param"],
                "train_peak_mmap_per_param": runs[1]["train_peak_per_param"],
            }
        )
        print(rows[-1], file=sys.stderr)
        if jsonl:
            with open(jsonl, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    return rows


def render_lora(rows: list[dict], cmd: str) -> str:
    """``--lora``'s section: host bytes per frozen parameter, predicted and measured."""
    lines = [
        harness.heading("host-lora"),
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}; date {time.strftime('%Y-%m-%d')}.",
        "",
        "As the section *Host bytes per offloaded parameter*, with peft's LoRA injected (r=16, "
        "alpha 32, on the attention projections; planner/models/lora.py) and the base frozen: the "
        "plan marks the frozen parameters (`Param.frozen`, schema 8), the adapters get chunks of "
        "their own, and every chunk is offloaded, so a frozen chunk keeps only its compute-dtype "
        "home on the host (no master, moments or gradients: plans/homes.py). Bytes are per "
        "*frozen* parameter. *Full training, predicted*: `memory_walk.walk` of the same plan with "
        "every chunk trainable, per parameter.",
        "",
        "| model | params | trainable | compute | predicted B/frozen param | after wrap | peak | "
        "peak in training | its ratio | peak in training, mmap threshold 1 MiB | full training, "
        "predicted |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['params'] / 1e6:.0f}M | {(r['params'] - r['frozen']) / 1e6:.2f}M "
            f"| {r['dtype']} | {r['predicted_per_param']:.3f} | {r['wrapped_per_param']:.2f} | "
            f"{r['measured_per_param']:.2f} | {r['train_peak_per_param']:.3f} | "
            f"{r['train_peak_per_param'] / r['predicted_per_param']:.3f} | "
            f"{r['train_peak_mmap_per_param']:.3f} | {r['full_predicted_per_param']:.2f} |"
        )
    lines += [
        "",
        "Reading. *Peak* includes the user's fp32 model built on the host before wrap (4 B per "
        "parameter), which is the whole-process peak here; *peak in training* is the plan's: "
        + ", ".join(
            f"{r['model']} {r['train_peak_per_param']:.2f} B per frozen parameter "
            f"(predicted {r['predicted_per_param']:.2f}; full training predicted "
            f"{r['full_predicted_per_param']:.2f})"
            for r in rows
        )
        + ".",
    ]
    return "\n".join(lines) + "\n"


def _parse_case(text: str) -> tuple:
    try:
        name, dtype, accum, homeless, nvme = text.split(",")
        return name, dtype, int(accum), homeless == "1", nvme == "1"
    except ValueError:
        raise SystemExit(
            f"host: --row {text!r}: expected MODEL,DTYPE,GRAD_ACCUM,HOMELESS(0|1),NVME(0|1), "
            "e.g. gpt2-medium,bfloat16,1,1,0"
        ) from None


def main(argv: list[str] | None = None, name: str = "host") -> int:
    ap = harness.parser(name, __doc__, rounds=1, what="runs of each case (one: two processes each)")
    ap.add_argument(
        "--steps", type=int, default=3, help="training steps per row (the peak is over all)"
    )
    ap.add_argument(
        "--nvme-dir", default="/var/tmp", help="directory for the NVMe rows' state files (a disk)"
    )
    ap.add_argument(
        "--device", default="cpu", help="cpu (the default table) or cuda (nothing subtracted)"
    )
    ap.add_argument(
        "--row",
        action="append",
        default=[],
        help="MODEL,DTYPE,GRAD_ACCUM,HOMELESS,NVME: measure these rows instead of the table's",
    )
    ap.add_argument(
        "--jsonl", help="append the measured rows to this file (one JSON object a line)"
    )
    ap.add_argument("--report", help="print the table of the rows in this --jsonl file and exit")
    ap.add_argument(
        "--lora", action="store_true", help="LoRA rows (peft): host bytes per frozen parameter"
    )
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: one case in this process
    args = ap.parse_args(argv)
    harness.no_baseline(ap, args)
    if args.rounds != 1:
        ap.error("--rounds: one run of each case (the table's rows are single measurements)")
    if args.report:
        rows = [
            json.loads(line) for line in Path(args.report).read_text().splitlines() if line.strip()
        ]
        print(
            render_rows(rows, f"python -m tools.bench host --report {args.report}")
            if rows
            else "(no rows)"
        )
        return 0
    if args.case:
        name, dtype, accum, homeless, nvme = _parse_case(args.case)
        print(
            json.dumps(
                run_case(
                    name,
                    dtype,
                    accum,
                    homeless,
                    args.steps,
                    args.nvme_dir if nvme else None,
                    args.device,
                    lora=args.lora,
                )
            )
        )
        return 0
    if args.lora:
        rows = measure(LORA_CASES, args.steps, args.nvme_dir, args.device, args.jsonl, lora=True)
        if len(rows) < len(LORA_CASES):
            return 1
        text = render_lora(rows, "python -m tools.bench host-lora --write")
        return harness.emit("host-lora", text, args.write)
    if args.write and (args.row or args.device != "cpu"):
        raise SystemExit(
            "host: --write replaces the CPU table of BENCHMARKS.md: drop --row/--device, "
            "or use --jsonl and --report for these rows"
        )
    cases = [_parse_case(r) for r in args.row] or CASES
    rows = measure(cases, args.steps, args.nvme_dir, args.device, args.jsonl)
    failed = len(cases) - len(rows)
    if failed:
        print(f"host: {failed} of {len(cases)} rows failed", file=sys.stderr)
    if args.row or args.device != "cpu":
        if rows:
            print(
                render_rows(
                    rows,
                    harness.command(name, argv),
                )
            )
        return 1 if failed else 0
    if failed:
        return 1  # (the CPU table is written whole or not at all)
    text = render(rows, "python -m tools.bench host --write")
    return harness.emit("host", text, args.write)
