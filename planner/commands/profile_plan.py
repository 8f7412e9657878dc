"""The ``profile`` and ``plan`` commands' work: choose how to profile, plan, write files.

Kept out of ``cli.py`` so that the CLI module stays a thin, torch-free table of
commands and options.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from protrain.plans import plan as P
from protrain.plans.errors import ConfigError

from ..hardware.units import human_bytes
from ..profiling.profile import Profile, dump_profile, load_profile
from ..views.show import render_show


def _device(device: str | None) -> str:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "--device cuda: no CUDA device is available here (torch.cuda.is_available() is False)",
            "profile on the CPU with --device cpu, or estimate with --analytic --hardware NAME",
        )
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def cached_probe(device: str, *, reprobe: bool = False, echo: Callable[[str], None] = print):
    """This machine's spec for ``device``: probed once, then read from a per-machine cache.

    The cache file (``$XDG_CACHE_HOME/protrain/probe-<host>-<device>.json``, default
    ``~/.cache``) saves the 10–20 s quick probe on every measured ``plan --model`` and
    ``profile``; ``reprobe`` measures again and replaces it (after a hardware change,
    or when another job was loading the machine during the first probe). A cache file
    that does not read as a spec is probed over.
    """
    import os
    import socket

    from ..hardware.probe import probe
    from ..hardware.spec import dump_spec, load_spec

    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "protrain"
    cache = root / f"probe-{socket.gethostname()}-{device}.json"
    if not reprobe and cache.is_file():
        try:
            spec = load_spec(cache)
        except (ConfigError, OSError):
            spec = None
        if spec is not None:
            echo(f"profile  this machine's probe from {cache} (--reprobe measures again)")
            return spec
    echo("profile  probing this machine (copy bandwidth, Adam rates) …")
    spec = probe(device, quick=True)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(dump_spec(spec))
        os.replace(tmp, cache)
    except OSError:  # a read-only home costs a probe per run, not the run
        pass
    return spec


def build_profile(
    *,
    model_name: str,
    batch: int,
    seq: int,
    dtype: str | None,
    device: str | None,
    analytic: bool,
    hardware: str | None,
    iterations: int = 5,
    echo: Callable[[str], None] = print,
    reprobe: bool = False,
    lora=None,
) -> Profile:
    """``lora``: a ``lora.LoraSpec`` whose adapters are injected (its base frozen)."""
    from ..hardware.spec import find_spec
    from ..models.lora import build_model
    from ..models.zoo import block_paths, check_name

    check_name(model_name)  # a mistyped name fails now, not after a probe

    if analytic:
        if hardware is None:
            raise ConfigError(
                "--analytic needs --hardware: the spec to estimate for",
                "add --hardware rtx3090 (or any name in plans/hardware/, or a spec file)",
            )
        from ..profiling.analytic import analytic_profile
        from ..profiling.lazy_dynamo import defer_dynamo

        spec = find_spec(hardware)
        defer_dynamo()  # meta's Python kernels without importing torch._dynamo (lazy_dynamo.py)
        model = build_model(model_name, lora, device="meta")
        echo(
            f"profile  {model_name}: analytic estimate for {spec.name} "
            f"(micro-batch {batch} × seq {seq}, {dtype or 'bfloat16'})"
        )
        return analytic_profile(
            model,
            name=model_name,
            blocks=block_paths(model),
            micro_batch=batch,
            seq_len=seq,
            compute_dtype=dtype or "bfloat16",
            spec=spec,
        )
    dev = _device(device)
    dtype = dtype or ("bfloat16" if dev == "cuda" else "float32")
    if hardware is not None:
        spec = find_spec(hardware)
    else:
        spec = cached_probe(dev, reprobe=reprobe, echo=echo)
    from .measure import measure
    from .preflight import host_memory_for_build

    host_memory_for_build(model_name, what="profile")
    model = build_model(model_name, lora, device="cpu")
    echo(
        f"profile  {model_name} on {dev}: micro-batch {batch} × seq {seq}, {dtype}, "
        f"{iterations} measured iterations"
    )

    warm = 2

    def progress(i: int, n: int) -> None:
        more = " (more: the times vary)" if i > warm + iterations else ""
        echo(f"         step {i}/{n}" + (" (warm-up)" if i <= warm else more))

    def on_timing(timing) -> None:
        echo(f"profile  {timing.describe()}")
        if (warning := timing.warning()) is not None:
            echo(f"warning  {warning}")

    return measure(
        model,
        name=model_name,
        blocks=block_paths(model),
        micro_batch=batch,
        seq_len=seq,
        compute_dtype=dtype,
        device=dev,
        spec=spec,
        warmup=warm,
        iterations=iterations,
        progress=progress,
        on_timing=on_timing,
    )


def run_profile(
    *,
    model_name,
    batch,
    seq,
    dtype,
    device,
    analytic,
    hardware,
    iterations,
    output,
    echo=print,
    reprobe: bool = False,
) -> Profile:
    from .preflight import output_file

    output_file(output, "--output")
    t0 = time.perf_counter()
    profile = build_profile(
        model_name=model_name,
        batch=batch,
        seq=seq,
        dtype=dtype,
        device=device,
        analytic=analytic,
        hardware=hardware,
        iterations=iterations,
        echo=echo,
        reprobe=reprobe,
    )
    write_output(output, dump_profile(profile))
    echo(
        f"wrote {output} ({profile.source}, {len(profile.segments)} segments) in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    return profile


def run_plan(
    *,
    profile_path,
    model_name,
    hardware,
    batch,
    seq,
    dtype,
    device,
    budget,
    world_size,
    grad_accum,
    output,
    echo=print,
    solver: str | None = None,
    host_memory: str | None = None,
    max_grad_norm: float | None = None,
    reprobe: bool = False,
    nvme: bool = False,
    save_profile: str | None = None,
    status: Callable[[str], None] | None = None,
    lora=None,
) -> P.Plan:
    """``save_profile``: also write the profile made on the way (``--model``); ``status``: where
    the lines announcing each slow phase go (the CLI's stderr; None: ``echo``)."""
    status = status or echo
    if profile_path is None and model_name is not None:
        status(f"profile  {model_name}: loading torch and the model …")
    from ..search.exhaustive import DEFAULT_SOLVER
    from ..search.planning import make_plan, parse_budget
    from .preflight import budget_within_card, output_file

    output_file(output, "--output")  # before the search, not after it
    output_file(save_profile, "--save-profile")
    budget_bytes = parse_budget(budget) if budget else None

    if profile_path is None and model_name is None:
        raise ConfigError(
            "plan needs --profile FILE, or --model NAME with --batch and --seq",
            "e.g. protrain plan --model gpt2-xl --hardware rtx3090 --batch 8 --seq 1024 -o "
            "plan.json",
        )
    if profile_path is not None and save_profile is not None:
        raise ConfigError(
            f"--save-profile with --profile: the profile is {profile_path} already",
            "drop --save-profile (explain takes --profile " + profile_path + ")",
        )
    t_profile = time.perf_counter()
    if profile_path is not None:
        profile = load_profile(profile_path)
        if hardware is not None:
            # The profile's times and rates were measured (or estimated) for its own
            # hardware; planning them against another card's memory would mix two machines.
            raise ConfigError(
                f"--hardware {hardware} with --profile: {profile_path} is a profile for "
                f"{profile.hardware.name} ({profile.hardware.device_name}), and its times "
                "are that machine's",
                f"drop --hardware, or profile for {hardware}: `protrain profile --analytic "
                f"--hardware {hardware} …` (or plan with --model NAME --hardware {hardware})",
            )
        t = profile.training
        for flag, asked, have in (
            ("--batch", batch, t.micro_batch),
            ("--seq", seq, t.seq_len),
            ("--dtype", dtype, t.compute_dtype),
        ):
            if asked is not None and asked != have:
                raise ConfigError(
                    f"{profile_path} was profiled with {flag} {have}, not {asked}",
                    f"profile again with {flag} {asked}, or drop {flag}",
                )
        if model_name is not None:
            from protrain.executor.check import model_fingerprint

            from ..models.lora import build_model
            from ..models.zoo import block_paths

            meta = build_model(model_name, lora, device="meta")
            if model_fingerprint(meta, block_paths(meta)) != profile.model.fingerprint:
                raise ConfigError(
                    f"{profile_path} is a profile of {profile.model.name}, not of {model_name}",
                    f"profile {model_name} with `protrain profile --model {model_name} …`",
                )
    else:
        if batch is None or seq is None:
            raise ConfigError("--model needs --batch and --seq", "add e.g. --batch 8 --seq 1024")
        profile = build_profile(
            model_name=model_name,
            batch=batch,
            seq=seq,
            dtype=dtype,
            device=device,
            analytic=device is None and hardware is not None,
            hardware=hardware,
            echo=echo,
            reprobe=reprobe,
            lora=lora,
        )
        if save_profile is not None:
            write_output(save_profile, dump_profile(profile))
            echo(
                f"wrote {save_profile} (`protrain explain {output} --profile {save_profile}` "
                "with --trace/--plot reads it)"
            )
    if budget_bytes is None:
        budget_bytes = profile.hardware.usable_memory_bytes
    budget_within_card(
        budget_bytes,
        profile.hardware,
        where=f"{profile_path} was made" if profile_path else "the profile was made",
    )
    if profile_path is None:
        status(
            f"plan     profile ready ({time.perf_counter() - t_profile:.1f} s); searching for the "
            f"fastest plan under a {human_bytes(budget_bytes)} budget …"
        )
    t0 = time.perf_counter()
    plan, result = make_plan(
        profile,
        budget_bytes,
        grad_accum=grad_accum,
        world_size=world_size,
        solver=solver or DEFAULT_SOLVER,
        host_budget_bytes=parse_budget(host_memory) if host_memory else None,
        max_grad_norm=max_grad_norm,
        nvme=nvme,
    )
    seconds = time.perf_counter() - t0
    if profile.hardware.kind == "cpu":
        fits_this_cpu(plan, model_name or profile.model.name, output, world_size)
    write_output(output, P.dump(plan))
    echo(
        f"plan     {result.solver}: searched {result.evaluated} of {result.space_size} "
        f"configurations in {seconds:.3f} s for a {human_bytes(budget_bytes)} budget"
    )
    for w in result.warnings:
        echo(f"warning  {w}")
    echo(render_show(plan, output))
    if lora is not None:
        from .lora_options import closing_note

        echo(closing_note(plan, lora, parse_budget(host_memory) if host_memory else None))
    return plan


def fits_this_cpu(plan: P.Plan, model_name: str, output: str, world_size: int) -> None:
    """Refuse to write a plan for a CPU that this machine could not train: on a CPU the device
    and the host are one RAM, so the plan's device peak, its host states and swapped
    activations, the model's build and a micro-batch's logits must fit it together, what
    ``train`` checks before it allocates (``preflight.plan_fits_host``; issue 39 item 8). A
    profile of a model protrain cannot build by name (another model's file) is not checked."""
    from protrain.plans.errors import HostMemoryError

    from ..models.zoo import ZOO, is_hf_name
    from .preflight import plan_fits_host

    if not (model_name in ZOO or is_hf_name(model_name)):
        return
    try:
        plan_fits_host(plan, model_name, device="cpu", where="the plan", ranks=world_size)
    except HostMemoryError as e:
        t = plan.training
        smaller = max(t.micro_batch * e.available // max(e.need, 1), 1)
        raise HostMemoryError(
            f"{output} not written: {e.message}",
            f"plan a smaller micro-batch for this machine: `protrain plan … --batch {smaller}` "
            "(or train on a machine with more RAM)",
            need=e.need,
            available=e.available,
        ) from None


def write_output(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path``; an OS error (disk full, permissions) is a ``ConfigError``."""
    try:
        Path(path).write_bytes(data)
    except OSError as e:
        raise ConfigError(
            f"cannot write {path}: {e.strerror}",
            "check the directory exists, is writable and has space",
        ) from None
