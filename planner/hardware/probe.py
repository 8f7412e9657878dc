"""The probe that measures a machine into a hardware spec (datasheet specs: ``datasheets.py``).

Two producers of one ``HardwareSpec`` (the format is ``spec.py``):

- ``DATASHEETS`` + ``datasheet_spec(name)``: the cards we plan for without having
  them. Each entry holds the public datasheet figures and our stated assumptions;
  ``datasheet_spec`` derives the achievable rates from them and writes the origin of
  every figure into ``notes``. ``plans/hardware/<name>.json`` are exactly
  ``dump_spec(datasheet_spec(name))``; regenerate them with ``write_datasheets()``
  (a test compares the bytes).
- ``probe()``: measures this machine (``protrain hardware probe -o spec.json``). With
  CUDA: pinned H2D/D2H curve, bf16/fp32 matmul, device copy bandwidth, device fused
  AdamW, free memory. Without: the host is the "device" (kind ``cpu``). Both measure
  the CPU fused AdamW that offloaded chunks use, and with ``nvme=DIR`` the disk of the
  NVMe tier (``disk.py``).

torch and pynvml are imported inside the functions that measure: importing this
module (the CLI does, for ``--help``) stays light.
"""

from __future__ import annotations

import logging
import os
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from protrain.plans.errors import ConfigError

from .datasheets import GB, LINK_SIZES_BYTES, GiB, KiB, MiB
from .disk import RAM_FILESYSTEMS, mount_of, probe_disk
from .spec import HardwareSpec, LinkPoint, dump_spec

_log = logging.getLogger(__name__)

# ----------------------------------------------------------------------- probe


def probe(
    device: str = "auto",
    *,
    quick: bool = False,
    nvme: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
    warn: Callable[[str], None] | None = None,
) -> HardwareSpec:
    """Measure this machine and return its spec (``source: measured``).

    ``device``: ``auto`` (CUDA when torch sees it, else the CPU), ``cpu``, ``cuda`` or
    ``cuda:N``. ``quick`` trades repeats and sizes for time (~5 s on a 2-core box
    without a GPU, against ~15 s; a GPU adds a few seconds). ``nvme``: the directory
    the NVMe tier will use, whose disk is measured (64 MiB quick, else 256 MiB, 3
    rounds; a fast NVMe drive takes well under a second); None leaves the disk
    figures 0, and the planner then puts nothing on disk. ``progress`` gets one
    line per step; ``warn`` gets one line per problem that does not stop the probe
    (no NVIDIA driver, say) and defaults to ``logging``. Every figure's method is in
    the spec's ``notes``.
    """
    import torch

    say = progress or (lambda _msg: None)
    warn = warn or _log.warning
    started = time.perf_counter()
    if device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", device):
        raise ConfigError(
            f"unknown probe device {device!r}; expected auto, cpu, cuda or cuda:N",
            "run `protrain hardware probe --device auto`",
        )
    use_cuda = device != "cpu" and torch.cuda.is_available()
    if device.startswith("cuda") and not use_cuda:
        raise ConfigError(
            f"--device {device}: torch sees no CUDA device (torch {torch.__version__}, "
            f"CUDA build: {torch.version.cuda or 'none'})",
            "probe the CPU with `--device cpu`, or install a CUDA build of torch",
        )
    index = 0
    if use_cuda:
        index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
    if use_cuda and index >= torch.cuda.device_count():
        raise ConfigError(
            f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)",
            "pick cuda:0 … cuda:N-1, or `--device auto`",
        )
    nvml = None
    if device != "cpu":
        uuid = _cuda_uuid(torch, index) if use_cuda else None
        nvml = _nvml_info(
            index,
            uuid,
            warn,
            fallback=f"probing cuda:{index} through torch only"
            if use_cuda
            else "probing the CPU as the device",
        )
        if nvml is not None and not use_cuda:
            warn(
                f"NVML sees {nvml['name']} but torch has no CUDA (torch {torch.__version__}, CUDA "
                f"build: {torch.version.cuda or 'none'}); probing the CPU as the device"
            )

    host_total, host_avail = _host_memory()
    cores = _cpu_count()
    notes: dict[str, str] = {
        "host_memory_bytes": "measured: /proc/meminfo MemTotal, capped by the cgroup memory limit",
        "cpu_cores": "measured: os.sched_getaffinity (logical CPUs this process may use); "
        f"torch uses {torch.get_num_threads()} threads",
    }
    # The disk first: a bad --nvme directory fails before the slow steps.
    disk = _probe_nvme(nvme, quick, say, warn, notes)
    # 16M params even when quick: its 256 MiB of state outgrows any L3, where 4M (64 MiB)
    # can sit in a big-cache server's L3 and overstate the rate for real chunks.
    adam_numel = (16 if quick else 32) * MiB
    say(f"CPU fused AdamW ({adam_numel // MiB}M params)")
    cpu_adam, how = _cpu_adam_rate(torch, adam_numel, quick)
    notes["cpu_adam_params_per_s"] = f"measured: {how}"
    if use_cuda:
        fields = _probe_cuda(torch, index, quick, say, notes, nvml)
        name = _slug(fields["device_name"])
    else:
        fields = _probe_cpu(torch, quick, say, notes, host_total, host_avail)
        fields["dev_adam_params_per_s"] = cpu_adam
        notes["dev_adam_params_per_s"] = (
            "derived: equal to cpu_adam_params_per_s (the device is the host)"
        )
        name = "cpu"
    for key in ("allgather_bytes_per_s", "reduce_scatter_bytes_per_s", "internode_bytes_per_s"):
        notes[key] = (
            "not measured (0): a single-process probe; measure with nccl-tests "
            "(all_gather_perf / reduce_scatter_perf) and edit"
        )
    notes["probe"] = (
        f"protrain hardware probe, device={device}, quick={quick}, nvme={nvme}, torch "
        f"{torch.__version__}, {time.perf_counter() - started:.1f} s"
    )
    return HardwareSpec(
        name=name,
        host_memory_bytes=host_total,
        cpu_cores=cores,
        cpu_adam_params_per_s=cpu_adam,
        source="measured",
        notes=dict(sorted(notes.items())),
        **fields,
        **disk,
    )


def probe_to_file(
    path: str | Path,
    device: str = "auto",
    quick: bool = False,
    echo: Callable[[str], None] = print,
    *,
    nvme: str | Path | None = None,
) -> HardwareSpec:
    """Probe, write ``dump_spec(spec)`` to ``path`` and echo a short summary."""
    path = Path(path)
    if not path.parent.is_dir():
        raise ConfigError(
            f"{path}: directory {path.parent} does not exist", "create it, or pass another -o path"
        )
    spec = probe(
        device,
        quick=quick,
        nvme=nvme,
        progress=lambda m: echo(f"  measuring {m}"),
        warn=lambda m: echo(f"warning: {m}"),
    )
    try:
        path.write_bytes(dump_spec(spec))
    except OSError as e:
        raise ConfigError(
            f"{path}: cannot write the spec ({e.strerror or e})", "pass another -o path"
        ) from None
    at = next((p for p in spec.link if p.size_bytes >= 64 * MiB), spec.link[-1])
    echo(f"wrote {path}: {spec.name} ({spec.kind}, {spec.device_name})")
    echo(
        f"  memory  {spec.device_memory_bytes / GiB:.1f} GiB, {spec.usable_memory_bytes / GiB:.1f} "
        f"GiB usable; host {spec.host_memory_bytes / GiB:.1f} GiB, {spec.cpu_cores} CPUs"
    )
    echo(
        f"  matmul  {spec.matmul_flops_per_s / 1e12:.3g} TFLOP/s 16-bit, "
        f"{spec.matmul_fp32_flops_per_s / 1e12:.3g} TFLOP/s fp32; memory "
        f"{spec.mem_bytes_per_s / GB:.3g} GB/s"
    )
    echo(
        f"  link    {at.h2d_bytes_per_s / GB:.3g} GB/s H2D, {at.d2h_bytes_per_s / GB:.3g} GB/s D2H "
        f"at {at.size_bytes // MiB} MiB"
    )
    echo(
        f"  adam    CPU {spec.cpu_adam_params_per_s / 1e9:.3g}e9, device "
        f"{spec.dev_adam_params_per_s / 1e9:.3g}e9 params/s"
    )
    if spec.disk_read_bytes_per_s:
        echo(
            f"  disk    {spec.disk_read_bytes_per_s / GB:.3g} GB/s read, "
            f"{spec.disk_write_bytes_per_s / GB:.3g} GB/s write ({nvme})"
        )
    else:
        echo("  disk    not measured: pass --nvme DIR to measure the disk the NVMe tier will use")
    return spec


# ---------------------------------------------------------- probe: the disk


def _probe_nvme(nvme: str | Path | None, quick: bool, say, warn, notes: dict[str, str]) -> dict:
    """The two disk fields and their notes: measured in ``nvme``, or 0 and why."""
    keys = ("disk_read_bytes_per_s", "disk_write_bytes_per_s")
    if nvme is None:
        for key in keys:
            notes[key] = (
                "not measured (0): pass --nvme DIR to measure the disk the NVMe tier will use"
            )
        return dict.fromkeys(keys, 0)
    read, write, how = probe_disk(nvme, (64 if quick else 256) * MiB, progress=say)
    mount = mount_of(nvme)
    if mount and mount.fstype in RAM_FILESYSTEMS:
        warn(
            f"--nvme {nvme} is on {mount.fstype} ({mount.point}), which is RAM: "
            "the disk figures say nothing about a disk"
        )
    notes.update(dict.fromkeys(keys, f"measured: {how}"))
    return dict(zip(keys, (read, write)))


# ------------------------------------------------------------- probe: the CPU


def _probe_cpu(
    torch, quick: bool, say, notes: dict[str, str], host_total: int, host_avail: int
) -> dict:
    """The host as the device: memcpy link, CPU matmul, DRAM copy bandwidth."""
    sizes = LINK_SIZES_BYTES
    say(f"memcpy link ({len(sizes)} sizes, {sizes[0] // KiB} KiB-{sizes[-1] // MiB} MiB)")
    secs = _cpu_copy_times(torch, sizes, repeats=3 if quick else 7)
    link = [
        LinkPoint(size_bytes=n, h2d_bytes_per_s=round(n / t), d2h_bytes_per_s=round(n / t))
        for n, t in zip(sizes, secs)
    ]
    notes["link"] = (
        "measured: Tensor.copy_ between two host uint8 tensors (memcpy; copy bytes counted once), "
        f"median of {3 if quick else 7}; h2d = d2h. Small sizes run in cache, so no latency + "
        "size / bandwidth fit here"
    )
    big = sizes[-1]
    notes["mem_bytes_per_s"] = (
        f"derived: the {big // MiB} MiB memcpy above, read + write counted (2 x size / time)"
    )
    say("CPU matmul (fp32, bf16)")
    fp32, how32 = _cpu_matmul_rate(torch, torch.float32, quick)
    bf16, how16 = _cpu_matmul_rate(torch, torch.bfloat16, quick)
    notes["matmul_fp32_flops_per_s"] = f"measured: {how32}"
    notes["matmul_flops_per_s"] = f"measured: {how16}"
    notes["device_name"] = "measured: /proc/cpuinfo model name"
    notes["device_memory_bytes"] = (
        "measured: host RAM (the host is the device), as host_memory_bytes"
    )
    notes["usable_memory_bytes"] = (
        "measured: /proc/meminfo MemAvailable at probe start, capped by the cgroup"
    )
    return dict(
        kind="cpu",
        device_name=_cpu_model(),
        device_memory_bytes=host_total,
        usable_memory_bytes=min(host_avail, host_total),
        matmul_flops_per_s=bf16,
        matmul_fp32_flops_per_s=fp32,
        mem_bytes_per_s=round(2 * big / secs[-1]),
        link=link,
    )


def _cpu_copy_times(torch, sizes: tuple[int, ...], repeats: int) -> list[float]:
    """Median seconds of one host-to-host copy per size (buffers freed on return)."""
    src = torch.ones(sizes[-1], dtype=torch.uint8)  # 1D, CPU; written so its pages are faulted in
    dst = torch.zeros(sizes[-1], dtype=torch.uint8)  # 1D, CPU
    return [_cpu_time(lambda n=n: dst[:n].copy_(src[:n]), repeats=repeats) for n in sizes]


def _cpu_time(fn: Callable[[], object], *, repeats: int, min_s: float = 2e-3) -> float:
    """Median seconds per call; small calls run in a loop of at least ``min_s`` so the timer
    resolves them."""
    fn()  # warm-up: thread pool, page faults
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, min(10_000, int(min_s / once)))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def _cpu_matmul_rate(torch, dtype, quick: bool) -> tuple[int, str]:
    """Square matmul rate; n doubles from 256 until one product takes long enough (slow dtypes
    stay small)."""
    target_s, n_max = (0.05, 2048) if quick else (0.2, 4096)
    n = 256
    while True:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)  # (n, n) each
        secs = _cpu_time(lambda a=a, b=b: torch.matmul(a, b), repeats=3 if quick else 5)
        if secs >= target_s or n >= n_max:
            break
        n *= 2
    return round(2 * n**3 / secs), (
        f"torch.matmul {n}x{n}x{n} {str(dtype).removeprefix('torch.')} on the CPU, "
        f"median of {3 if quick else 5}"
    )


def _cpu_adam_rate(torch, numel: int, quick: bool) -> tuple[int, str]:
    """Fused AdamW steps on one fp32 CPU tensor of a chunk's size (what offloaded chunks run)."""
    p = torch.zeros(numel, requires_grad=True)  # 1D, CPU fp32: one chunk's master params
    p.grad = torch.randn(numel)
    try:
        opt, kind = torch.optim.AdamW([p], lr=1e-3, fused=True), "fused"
        opt.step()
    except (RuntimeError, TypeError):  # fused CPU AdamW arrived in torch 2.4
        opt, kind = torch.optim.AdamW([p], lr=1e-3, foreach=True), "foreach"
        opt.step()  # creates exp_avg / exp_avg_sq, so timed steps are steady-state
    secs = _cpu_time(opt.step, repeats=3 if quick else 5, min_s=0.05)
    return round(numel / secs), (
        f"torch.optim.AdamW({kind}) steps on a {numel // MiB}M-param fp32 CPU tensor, "
        f"{torch.get_num_threads()} threads, median of {3 if quick else 5}"
    )


# ------------------------------------------------------------ probe: the GPU


def _probe_cuda(
    torch, index: int, quick: bool, say, notes: dict[str, str], nvml: dict | None
) -> dict:
    """Pinned link curve, bf16/fp32 matmul, device copy bandwidth, device fused AdamW, free
    memory."""
    dev = torch.device("cuda", index)
    torch.cuda.set_device(dev)
    torch.empty(1, device=dev)  # creates the context, so free memory excludes it
    free, total = torch.cuda.mem_get_info(dev)
    name = torch.cuda.get_device_name(dev)
    repeats = 5 if quick else 11
    stream = torch.cuda.Stream(dev)  # copies on a side stream, as the executor's copy engine does

    def timed(fn, iters: int = 1) -> float:
        """Median seconds per call over `repeats` samples of `iters` calls, CUDA events on
        `stream`."""
        torch.cuda.synchronize(dev)  # inputs made on the default stream are ready
        with torch.cuda.stream(stream):
            fn()
            samples = []
            for _ in range(repeats):
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record(stream)
                for _ in range(iters):
                    fn()
                end.record(stream)
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3 / iters)
        return statistics.median(samples)

    sizes = LINK_SIZES_BYTES
    say(f"pinned H2D/D2H ({len(sizes)} sizes, {sizes[0] // KiB} KiB-{sizes[-1] // MiB} MiB)")
    h2d, d2h = _cuda_link_times(torch, dev, sizes, timed)
    link = [
        LinkPoint(size_bytes=n, h2d_bytes_per_s=round(n / a), d2h_bytes_per_s=round(n / b))
        for n, a, b in zip(sizes, h2d, d2h)
    ]
    pcie = f"; NVML: {nvml['pcie']}" if nvml and nvml.get("pcie") else ""
    notes["link"] = (
        f"measured: one non_blocking copy_ between pinned host and device memory per sample, CUDA "
        f"events on a side stream, median of {repeats}{pcie}. H2D "
        + _fit_note(sizes, h2d)
        + "; D2H "
        + _fit_note(sizes, d2h)
    )

    say("bf16 and fp32 matmul")
    n = 4096 if quick else 8192
    bf16 = round(2 * n**3 / _cuda_matmul_time(torch, dev, n, torch.bfloat16, timed, iters=5))
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 roof, not TF32's
    try:
        fp32 = round(2 * n**3 / _cuda_matmul_time(torch, dev, n, torch.float32, timed, iters=2))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    notes["matmul_flops_per_s"] = (
        f"measured: bf16 {n}x{n}x{n} matmul, 5 per sample, median of {repeats}"
    )
    notes["matmul_fp32_flops_per_s"] = (
        f"measured: fp32 {n}x{n}x{n} matmul with TF32 off, 2 per sample, median of {repeats}"
    )

    say("device memory bandwidth")
    copy_bytes = (256 if quick else 1024) * MiB
    mem_bw = round(2 * copy_bytes / _cuda_copy_time(torch, dev, copy_bytes, timed))
    notes["mem_bytes_per_s"] = (
        f"measured: {copy_bytes // MiB} MiB device-to-device copy_, 5 per sample, "
        f"read + write counted (2 x size / time), median of {repeats}"
    )

    say("device fused AdamW (32M params)")
    numel = 32 * MiB
    dev_adam = round(numel / _cuda_adam_time(torch, dev, numel, timed))
    torch.cuda.empty_cache()
    notes["dev_adam_params_per_s"] = (
        f"measured: torch.optim.AdamW(fused) steps on a 32M-param fp32 device tensor, "
        f"5 per sample, median of {repeats}"
    )

    notes["device_name"] = "measured: torch.cuda.get_device_name"
    nvml_total = f"; NVML total {nvml['memory_bytes'] / MiB:.0f} MiB" if nvml else ""
    notes["device_memory_bytes"] = f"measured: torch.cuda.mem_get_info total{nvml_total}"
    notes["usable_memory_bytes"] = (
        "measured: torch.cuda.mem_get_info free after this process's CUDA context "
        "was created, at probe start"
    )
    return dict(
        kind="gpu",
        device_name=name,
        device_memory_bytes=total,
        usable_memory_bytes=min(free, total),
        matmul_flops_per_s=bf16,
        matmul_fp32_flops_per_s=fp32,
        mem_bytes_per_s=mem_bw,
        link=link,
        dev_adam_params_per_s=dev_adam,
    )


# Each measurement owns its tensors, so they are freed when it returns and the next
# one has the memory. `timed(fn, iters)` is _probe_cuda's event timer.


def _cuda_link_times(torch, dev, sizes: tuple[int, ...], timed) -> tuple[list[float], list[float]]:
    host = torch.ones(sizes[-1], dtype=torch.uint8).pin_memory()  # 1D, pinned CPU
    buf = torch.empty(sizes[-1], dtype=torch.uint8, device=dev)  # 1D, device
    h2d = [timed(lambda n=n: buf[:n].copy_(host[:n], non_blocking=True)) for n in sizes]
    d2h = [timed(lambda n=n: host[:n].copy_(buf[:n], non_blocking=True)) for n in sizes]
    return h2d, d2h


def _cuda_matmul_time(torch, dev, n: int, dtype, timed, *, iters: int) -> float:
    a = torch.randn(n, n, device=dev, dtype=dtype)  # (n, n)
    b = torch.randn(n, n, device=dev, dtype=dtype)  # (n, n)
    return timed(lambda: a @ b, iters=iters)


def _cuda_copy_time(torch, dev, nbytes: int, timed) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)  # 1D, device
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src), iters=5)


def _cuda_adam_time(torch, dev, numel: int, timed) -> float:
    p = torch.zeros(numel, device=dev, requires_grad=True)  # 1D, device fp32: one chunk's params
    p.grad = torch.randn(numel, device=dev)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    opt.step()  # creates exp_avg / exp_avg_sq, so timed steps are steady-state
    return timed(opt.step, iters=5)


def _cuda_uuid(torch, index: int) -> str | None:
    """The device's UUID as NVML spells it, so NVML and CUDA agree under CUDA_VISIBLE_DEVICES."""
    try:
        return f"GPU-{torch.cuda.get_device_properties(index).uuid}"
    except (AttributeError, RuntimeError):
        return None


_NVML_REASONS = {
    "NVMLError_LibraryNotFound": (
        "the NVIDIA driver library (libnvidia-ml.so) was not found: no NVIDIA driver on this "
        "machine"
    ),
    "NVMLError_DriverNotLoaded": "the NVIDIA kernel driver is not loaded",
    "NVMLError_NoPermission": "no permission to query the NVIDIA driver",
}


def _nvml_info(
    index: int, uuid: str | None, warn: Callable[[str], None], *, fallback: str
) -> dict | None:
    """Name, memory and PCIe link of one GPU from the driver; None (after one warning line) when
    NVML fails."""
    try:
        import pynvml
    except ImportError:
        warn(
            "NVML unavailable: the nvidia-ml-py package (module pynvml) is not installed; "
            f"{fallback}"
        )
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        reason = _NVML_REASONS.get(type(e).__name__, f"{type(e).__name__}: {e}")
        warn(
            " ".join(f"NVML unavailable: {reason}; {fallback}".split())
        )  # one line, whatever str(e) holds
        return None
    try:
        try:
            handle = (
                pynvml.nvmlDeviceGetHandleByUUID(uuid)
                if uuid
                else pynvml.nvmlDeviceGetHandleByIndex(index)
            )
        except pynvml.NVMLError:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        info = {
            "name": name.decode() if isinstance(name, bytes) else str(name),
            "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
            "pcie": "",
        }
        try:
            info["pcie"] = (
                f"PCIe Gen{pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)} "
                f"x{pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)} now, max "
                f"Gen{pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)} "
                f"x{pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle)}"
            )
        except pynvml.NVMLError:
            pass  # some virtualised GPUs hide the link; the measured curve still stands
        return info
    except pynvml.NVMLError as e:
        warn(
            " ".join(
                f"NVML could not describe GPU {index}: {type(e).__name__}: {e}; {fallback}".split()
            )
        )
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


# ------------------------------------------------------------- probe: helpers


def _fit_note(sizes: tuple[int, ...], secs: list[float]) -> str:
    """Fit t = latency + size / bandwidth (least squares on relative error) and say it in words.

    Two parameters and a linear model: the weighted normal equations are solved in
    closed form, no scipy. The spec keeps the measured medians; the fit is the
    summary a reader checks them against.
    """
    w = [1 / t**2 for t in secs]  # relative error: weight each squared residual by 1/t^2
    sw = sum(w)
    sx = sum(wi * s for wi, s in zip(w, sizes))
    sy = sum(wi * t for wi, t in zip(w, secs))
    sxx = sum(wi * s * s for wi, s in zip(w, sizes))
    sxy = sum(wi * s * t for wi, s, t in zip(w, sizes, secs))
    det = sw * sxx - sx * sx
    if det <= 0:
        return "fit: none"
    slope = (sw * sxy - sx * sy) / det
    latency = (sy - slope * sx) / sw
    if slope <= 0:
        return "fit: none (times do not grow with size)"
    return f"fit t = {latency * 1e6:.1f} us + size / {1 / slope / GB:.3g} GB/s"


def _host_memory() -> tuple[int, int]:
    """(total, available) host RAM bytes: /proc/meminfo, capped by a cgroup v2 limit
    (containers)."""
    total = avail = 0
    try:
        with open("/proc/meminfo") as f:
            info = {
                k: int(v.split()[0]) * KiB
                for k, v in (line.split(":", 1) for line in f if ":" in line)
            }
        total, avail = info.get("MemTotal", 0), info.get("MemAvailable", info.get("MemFree", 0))
    except OSError:
        pass
    if not total:
        try:
            total = avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = avail = 0
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            total, avail = min(total, int(limit)), min(avail, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return total, min(avail, total)


def _cpu_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "CPU"


def _slug(name: str) -> str:
    """``NVIDIA H200`` -> ``nvidia-h200``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"
