"""The ``profile`` and ``plan`` commands' work: choose how to profile, plan, write files.

Kept out of ``cli.py`` so that the CLI module stays a thin, torch-free table of
commands and options.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from protrain.executor import plan as P
from protrain.executor.errors import ConfigError

from .profile import Profile, dump_profile, load_profile
from .report import human_bytes, render_show


def _device(device: str | None) -> str:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here (torch.cuda.is_available() is False)",
                          "profile on the CPU with --device cpu, or estimate with --analytic --hardware NAME")
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def build_profile(*, model_name: str, batch: int, seq: int, dtype: str | None, device: str | None,
                  analytic: bool, hardware: str | None, iterations: int = 5,
                  echo: Callable[[str], None] = print) -> Profile:
    from .models import block_paths, build
    from .spec import find_spec

    if analytic:
        if hardware is None:
            raise ConfigError("--analytic needs --hardware: the spec to estimate for",
                              "add --hardware rtx3090 (or any name in plans/hardware/, or a spec file)")
        from .analytic import analytic_profile

        spec = find_spec(hardware)
        model = build(model_name, device="meta")
        echo(f"profile  {model_name}: analytic estimate for {spec.name} "
             f"(micro-batch {batch} × seq {seq}, {dtype or 'bfloat16'})")
        return analytic_profile(model, name=model_name, blocks=block_paths(model), micro_batch=batch,
                                seq_len=seq, compute_dtype=dtype or "bfloat16", spec=spec)
    dev = _device(device)
    dtype = dtype or ("bfloat16" if dev == "cuda" else "float32")
    if hardware is not None:
        spec = find_spec(hardware)
    else:
        from .hardware import probe

        echo("profile  probing this machine (copy bandwidth, Adam rates) …")
        spec = probe(dev, quick=True)
    from .profile import measure

    model = build(model_name, device="cpu")
    echo(f"profile  {model_name} on {dev}: micro-batch {batch} × seq {seq}, {dtype}, "
         f"{iterations} measured iterations")

    def progress(i: int, n: int) -> None:
        warm = n - iterations
        echo(f"         step {i}/{n}" + (" (warm-up)" if i <= warm else ""))

    return measure(model, name=model_name, blocks=block_paths(model), micro_batch=batch, seq_len=seq,
                   compute_dtype=dtype, device=dev, spec=spec, iterations=iterations, progress=progress)


def run_profile(*, model_name, batch, seq, dtype, device, analytic, hardware, iterations, output,
                echo=print) -> Profile:
    t0 = time.perf_counter()
    profile = build_profile(model_name=model_name, batch=batch, seq=seq, dtype=dtype, device=device,
                            analytic=analytic, hardware=hardware, iterations=iterations, echo=echo)
    Path(output).write_bytes(dump_profile(profile))
    echo(f"wrote {output} ({profile.source}, {len(profile.segments)} segments) in "
         f"{time.perf_counter() - t0:.1f} s")
    return profile


def run_plan(*, profile_path, model_name, hardware, batch, seq, dtype, device, budget, world_size,
             grad_accum, output, echo=print, solver: str | None = None,
             host_memory: str | None = None, max_grad_norm: float | None = None) -> P.Plan:
    from .planning import make_plan, parse_budget
    from .search import DEFAULT_SOLVER

    if profile_path is None and model_name is None:
        raise ConfigError("plan needs --profile FILE, or --model NAME with --batch and --seq",
                          "e.g. protrain plan --model gpt2-xl --hardware rtx3090 --batch 8 --seq 1024 -o plan.json")
    if profile_path is not None:
        profile = load_profile(profile_path)
        t = profile.training
        for flag, asked, have in (("--batch", batch, t.micro_batch), ("--seq", seq, t.seq_len),
                                  ("--dtype", dtype, t.compute_dtype)):
            if asked is not None and asked != have:
                raise ConfigError(f"{profile_path} was profiled with {flag} {have}, not {asked}",
                                  f"profile again with {flag} {asked}, or drop {flag}")
        if model_name is not None:
            from protrain.executor.check import model_fingerprint

            from .models import block_paths, build

            meta = build(model_name, device="meta")
            if model_fingerprint(meta, block_paths(meta)) != profile.model.fingerprint:
                raise ConfigError(f"{profile_path} is a profile of {profile.model.name}, not of {model_name}",
                                  f"profile {model_name} with `protrain profile --model {model_name} …`")
    else:
        if batch is None or seq is None:
            raise ConfigError("--model needs --batch and --seq", "add e.g. --batch 8 --seq 1024")
        profile = build_profile(model_name=model_name, batch=batch, seq=seq, dtype=dtype,
                                device=device, analytic=device is None and hardware is not None,
                                hardware=hardware, echo=echo)
    budget_bytes = parse_budget(budget) if budget else profile.hardware.usable_memory_bytes
    t0 = time.perf_counter()
    plan, result = make_plan(profile, budget_bytes, grad_accum=grad_accum, world_size=world_size,
                             solver=solver or DEFAULT_SOLVER,
                             host_budget_bytes=parse_budget(host_memory) if host_memory else None,
                             max_grad_norm=max_grad_norm)
    seconds = time.perf_counter() - t0
    Path(output).write_bytes(P.dump(plan))
    echo(f"plan     {result.solver}: searched {result.evaluated} of {result.space_size} configurations "
         f"in {seconds:.3f} s for a {human_bytes(budget_bytes)} budget")
    for w in result.warnings:
        echo(f"warning  {w}")
    echo(render_show(plan, output))
    return plan
