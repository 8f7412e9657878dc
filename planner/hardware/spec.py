"""Hardware specs: the machine a plan is made for, as data (``plans/hardware/<name>.json``).

A spec is either written from datasheets (``source: datasheet``, each figure's
origin in ``notes``) or measured on the machine by ``protrain hardware probe``
(``source: measured``). The planner reads only these numbers, so a plan for a card
you do not have needs only its spec file.

Standard library and msgspec only (no torch, no pynvml): ``show`` and ``diff``
read specs embedded in profiles. The measuring probe lives in ``probe.py``.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from protrain.plans.errors import ConfigError
from protrain.plans.plan import canonical

from ..shipped import plans_dir

SPEC_VERSION = 1

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]


class LinkPoint(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Host↔device copy bandwidth for one transfer size (pinned host memory)."""

    size_bytes: PosInt
    """Bytes per copy."""
    h2d_bytes_per_s: PosInt
    """Achieved host-to-device bandwidth at this size."""
    d2h_bytes_per_s: PosInt
    """Achieved device-to-host bandwidth at this size."""


class HardwareSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One machine (per rank): device, host, link, optimizer and collective rates."""

    spec_version: int = SPEC_VERSION
    """Format version of this file."""
    name: str
    """Short name, as in ``plans/hardware/<name>.json``."""
    kind: Literal["gpu", "cpu"]
    """``cpu`` when the "device" is the host itself (CI, quickstart without a GPU)."""
    device_name: str
    """Marketing name as the driver reports it (``NVIDIA H200``) or the CPU model."""
    device_memory_bytes: NonNegInt
    """Total device memory."""
    usable_memory_bytes: NonNegInt
    """Memory one process can allocate (total minus CUDA context and driver reserve)."""
    host_memory_bytes: NonNegInt
    """Host RAM (for offloaded states and swap buffers)."""
    cpu_cores: PosInt
    """Host cores available to the CPU optimizer."""
    matmul_flops_per_s: PosInt
    """Achievable dense matmul rate in the 16-bit compute dtypes (roofline compute roof)."""
    matmul_fp32_flops_per_s: PosInt
    """Achievable dense matmul rate in fp32 (TF32 off)."""
    mem_bytes_per_s: PosInt
    """Achievable device memory bandwidth (roofline memory roof)."""
    link: list[LinkPoint]
    """Copy bandwidth curve over transfer size, ascending sizes."""
    cpu_adam_params_per_s: PosInt
    """CPU AdamW(fused) throughput in fp32 parameters per second, all cores."""
    dev_adam_params_per_s: PosInt
    """Device fused AdamW throughput in fp32 parameters per second."""
    allgather_bytes_per_s: NonNegInt = 0
    """All-gather bus bandwidth between ranks of one node (0: unknown / single device)."""
    reduce_scatter_bytes_per_s: NonNegInt = 0
    """Reduce-scatter bus bandwidth between ranks of one node."""
    internode_bytes_per_s: NonNegInt = 0
    """Collective bandwidth across nodes."""
    disk_read_bytes_per_s: NonNegInt = 0
    """Sequential read bandwidth of the NVMe tier's directory, as ``protrain hardware probe
    --nvme DIR`` measures it (4 MiB pieces, page cache dropped). 0: not measured, and the
    planner then places nothing on disk."""
    disk_write_bytes_per_s: NonNegInt = 0
    """Sequential write bandwidth of that directory, to the device (``fsync`` included).
    0: not measured (nothing on disk)."""
    source: Literal["datasheet", "measured"]
    """Where the figures come from."""
    notes: dict[str, str] = {}
    """Field → origin of its figure (datasheet section, measurement method, assumption)."""


def load_spec(source: str | Path | bytes) -> HardwareSpec:
    """Read a spec file; errors name the file, the JSON path and the fix."""
    where = "<spec bytes>" if isinstance(source, bytes) else str(source)
    try:
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
    except OSError as e:
        raise ConfigError(
            f"{where}: cannot read the hardware spec ({e.strerror or e})",
            "pass a file from plans/hardware/, or make one with `protrain hardware probe`",
        ) from None
    try:
        spec = msgspec.json.decode(data, type=HardwareSpec)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ConfigError(
            f"{where}: not a valid hardware spec: {e}", "compare with the files in plans/hardware/"
        ) from None
    if spec.spec_version != SPEC_VERSION:
        raise ConfigError(
            f"{where}: hardware spec version {spec.spec_version}; this protrain reads "
            f"{SPEC_VERSION}",
            "regenerate it with `protrain hardware probe`",
        )
    sizes = [p.size_bytes for p in spec.link]
    if not sizes or sizes != sorted(set(sizes)):
        raise ConfigError(
            f"{where}: `link` needs at least one point, sizes ascending and unique - at `$.link`"
        )
    if spec.usable_memory_bytes > spec.device_memory_bytes:
        raise ConfigError(
            f"{where}: usable memory exceeds device memory - at `$.usable_memory_bytes`"
        )
    return spec


def dump_spec(spec: HardwareSpec) -> bytes:
    return canonical(spec)


def link_bandwidth(spec: HardwareSpec, size_bytes: int, direction: Literal["h2d", "d2h"]) -> float:
    """Bandwidth for one copy of ``size_bytes``: linear interpolation in log-size, clamped at the
    ends."""
    import math

    pts = spec.link
    key = "h2d_bytes_per_s" if direction == "h2d" else "d2h_bytes_per_s"
    sizes = [p.size_bytes for p in pts]
    if size_bytes <= sizes[0]:
        return float(getattr(pts[0], key))
    if size_bytes >= sizes[-1]:
        return float(getattr(pts[-1], key))
    i = bisect.bisect_right(sizes, size_bytes)
    a, b = pts[i - 1], pts[i]
    t = (math.log(size_bytes) - math.log(a.size_bytes)) / (
        math.log(b.size_bytes) - math.log(a.size_bytes)
    )
    return getattr(a, key) + t * (getattr(b, key) - getattr(a, key))


HARDWARE_DIR = plans_dir() / "hardware"
"""The shipped hardware specs: ``plans/hardware`` of a checkout, package data of a wheel."""


def find_spec(name_or_path: str) -> HardwareSpec:
    """A spec by path, or by name from ``plans/hardware/`` (did-you-mean on unknown names)."""
    from protrain.plans.errors import did_you_mean

    p = Path(name_or_path)
    if p.suffix == ".json" or p.exists():
        return load_spec(p)
    candidate = HARDWARE_DIR / f"{name_or_path}.json"
    if candidate.exists():
        return load_spec(candidate)
    names = sorted(x.stem for x in HARDWARE_DIR.glob("*.json"))
    raise ConfigError(
        f"unknown hardware {name_or_path!r}{did_you_mean(name_or_path, names)}; "
        f"known: {', '.join(names)}",
        "pass a spec file path, or one of the names in plans/hardware/",
    )


HOST_RESERVE_BYTES = 2 * 2**30
"""Host RAM per rank the plan must leave to everything the cost model does not count:
the process itself (Python, torch and, on a GPU, the CUDA runtime and libraries: a
CPU-only torch process here is ~0.2 GiB resident; a CUDA one 1-3 GiB, with the
context's host side and cuBLAS/cuDNN), data-loader workers and their queues."""

HOST_RESERVE_FRACTION = 0.10
"""And this share of the host's RAM: the OS and its page cache floor, other tenants of a
shared node, and allocator slack (the host allocator's fragmentation; pageable and
pinned buffers rounded up). NB torch's pinned-memory cache rounds every allocation up
to a power of two (``CachingHostAllocator``, unless ``pinned_max_round_threshold`` is
set), which on the executor's per-chunk pinned homes and per-tensor swap buffers can
cost more than this share; see the issue 9 report."""


def host_budget_per_rank(host_memory_bytes: int, world_size: int = 1) -> int:
    """Host bytes one rank's plan may use when ``world_size`` ranks share a machine with
    ``host_memory_bytes`` of RAM (``protrain fit --host-memory SIZE --world-size N``):
    its share ``SIZE / N``, less ``HOST_RESERVE_FRACTION`` of it (the OS and page cache
    of the whole machine, shared out) and ``HOST_RESERVE_BYTES`` (each rank is a process
    of its own). ``default_host_budget`` is this at one rank."""
    usable = int(host_memory_bytes / world_size * (1 - HOST_RESERVE_FRACTION)) - HOST_RESERVE_BYTES
    return max(0, usable)


def default_host_budget(spec: HardwareSpec) -> int:
    """Host bytes per rank a plan may use on ``spec``: its ``host_memory_bytes`` less
    ``HOST_RESERVE_FRACTION`` of it and ``HOST_RESERVE_BYTES``.

    ``host_memory_bytes`` is already one rank's share (``HardwareSpec``: "one machine
    (per rank)"; the datasheet specs write "1/8 of a DGX …"), and a spec does not say
    how many ranks share a node, so it is used as is. On a ``cpu`` spec the "device"
    is the same RAM; its share is not subtracted here (a measured CPU spec sets both
    to MemTotal), so there the check is necessary, not sufficient.
    """
    return host_budget_per_rank(spec.host_memory_bytes, 1)
