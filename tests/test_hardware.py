"""Hardware specs: the committed datasheet files, their consistency, and the probe.

The datasheet files under plans/hardware/ must be exactly what planner/hardware/probe.py
generates (so a figure changes in one place, with its note). The probe runs once,
quick, on this machine's CPU with NVML forced to fail and CUDA hidden, which is
also the "no driver" path every CPU-only machine takes.
"""

from __future__ import annotations

import math
import subprocess
import sys

import msgspec
import pytest

from protrain.planner.hardware import datasheets as ds
from protrain.planner.hardware import probe as hw
from protrain.planner.hardware.spec import (
    HARDWARE_DIR,
    HardwareSpec,
    LinkPoint,
    dump_spec,
    link_bandwidth,
    load_spec,
)
from protrain.plans.errors import ConfigError

NAMES = [*ds.DATASHEETS, "cpu"]
REGEN = (
    'python -c "from protrain.planner.hardware.datasheets import write_datasheets; '
    'write_datasheets()"'
)
NOTE_KINDS = (
    "datasheet:",
    "assumption:",
    "derived:",
    "measured:",
    "unknown (0):",
    "not measured (0):",
)


def numeric_fields(spec: HardwareSpec) -> list[str]:
    """Every figure a spec states (ints and the link curve); spec_version is format, not a
    figure."""
    return [
        f
        for f in spec.__struct_fields__
        if f != "spec_version" and (isinstance(getattr(spec, f), int) or f == "link")
    ]


def check_consistent(spec: HardwareSpec) -> None:
    assert spec.usable_memory_bytes <= spec.device_memory_bytes, spec.name
    sizes = [p.size_bytes for p in spec.link]
    assert sizes == sorted(set(sizes)) and len(sizes) >= 2, sizes
    missing = [f for f in numeric_fields(spec) if f not in spec.notes]
    assert not missing, f"{spec.name}: no note for {missing}"
    for field, note in spec.notes.items():
        if field != "probe":
            assert note.startswith(NOTE_KINDS), f"{spec.name}.notes[{field!r}] = {note!r}"
        assert "\n" not in note
    for f in (
        "matmul_flops_per_s",
        "matmul_fp32_flops_per_s",
        "mem_bytes_per_s",
        "cpu_adam_params_per_s",
        "dev_adam_params_per_s",
    ):
        assert getattr(spec, f) > 0, f


# ---------------------------------------------------------------- datasheets


@pytest.mark.parametrize("name", NAMES)
def test_committed_datasheet_is_what_the_code_generates(name):
    path = HARDWARE_DIR / f"{name}.json"
    assert path.exists(), f"{path} missing; HINT: {REGEN}"
    assert path.read_bytes() == dump_spec(ds.datasheet_spec(name)), (
        f"{path} is stale; HINT: {REGEN}"
    )
    spec = load_spec(path)
    assert spec.name == name and spec.source == "datasheet"
    assert dump_spec(spec) == path.read_bytes()  # canonical: load/dump round-trips byte for byte


def test_every_committed_datasheet_has_a_generator():
    for path in HARDWARE_DIR.glob("*.json"):
        if load_spec(path).source == "datasheet":
            assert path.stem in NAMES, f"{path} has no entry in DATASHEETS"


def test_write_datasheets_regenerates_the_same_bytes(tmp_path):
    for path in ds.write_datasheets(tmp_path):
        assert path.read_bytes() == (HARDWARE_DIR / path.name).read_bytes(), path.name


@pytest.mark.parametrize("name", NAMES)
def test_datasheet_spec_is_consistent(name):
    spec = ds.datasheet_spec(name)
    check_consistent(spec)
    # The generated curves follow t = latency + size / bandwidth, so they only rise.
    for a, b in zip(spec.link, spec.link[1:]):
        assert a.h2d_bytes_per_s < b.h2d_bytes_per_s and a.d2h_bytes_per_s < b.d2h_bytes_per_s
    if spec.kind == "gpu":
        # Tensor cores against FP32 units: 2x on GeForce (FP32 accumulate at half rate), 4-16x on
        # the rest.
        assert spec.matmul_flops_per_s >= 1.99 * spec.matmul_fp32_flops_per_s
        assert spec.dev_adam_params_per_s == round(spec.mem_bytes_per_s / ds.ADAM_BYTES_PER_PARAM)
        assert spec.allgather_bytes_per_s > 0 and spec.reduce_scatter_bytes_per_s > 0
        assert spec.device_memory_bytes - spec.usable_memory_bytes == ds.CUDA_RESERVE_BYTES
    else:
        assert spec.dev_adam_params_per_s == spec.cpu_adam_params_per_s


def test_datasheet_headline_figures():
    """The numbers people check first, pinned so an edit to the table is a visible diff."""
    gib = 1 << 30
    tflops = {n: ds.datasheet_spec(n).matmul_flops_per_s / 1e12 for n in ds.DATASHEETS}
    assert tflops["a100-80g"] == pytest.approx(0.70 * 312)
    assert tflops["h100"] == tflops["h200"] == pytest.approx(0.70 * 989.4)
    assert tflops["rtx3090"] == pytest.approx(0.70 * 71)  # FP32-accumulate rate, not 142
    assert 139 * gib < ds.datasheet_spec("h200").device_memory_bytes < 140 * gib
    h100 = ds.datasheet_spec("h100")
    assert 45e9 < link_bandwidth(h100, 64 << 20, "h2d") < 55e9  # PCIe Gen5
    assert 20e9 < link_bandwidth(ds.datasheet_spec("a100-40g"), 64 << 20, "h2d") < 26e9  # Gen4


def test_unknown_datasheet_suggests_a_name():
    with pytest.raises(ConfigError, match="did you mean 'h100'"):
        ds.datasheet_spec("h10")


# ------------------------------------------------------------ link_bandwidth


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_link_bandwidth_is_monotone_and_clamped(name, direction):
    spec = ds.datasheet_spec(name)
    key = f"{direction}_bytes_per_s"
    first, last = spec.link[0], spec.link[-1]
    assert link_bandwidth(spec, 1, direction) == getattr(first, key)
    assert link_bandwidth(spec, 1 << 40, direction) == getattr(last, key)
    for p in spec.link:
        assert link_bandwidth(spec, p.size_bytes, direction) == pytest.approx(getattr(p, key))
    sizes = [round(2 ** (k / 4)) for k in range(4 * 12, 4 * 30)]  # 4 KiB .. 1 GiB, 4 per octave
    values = [link_bandwidth(spec, s, direction) for s in sizes]
    assert all(a <= b for a, b in zip(values, values[1:]))


def test_link_bandwidth_interpolates_in_log_size():
    pts = [
        LinkPoint(size_bytes=1 << 20, h2d_bytes_per_s=10, d2h_bytes_per_s=30),
        LinkPoint(size_bytes=1 << 22, h2d_bytes_per_s=20, d2h_bytes_per_s=10),
    ]
    spec = msgspec.structs.replace(ds.datasheet_spec("cpu"), link=pts)
    assert link_bandwidth(spec, 1 << 21, "h2d") == pytest.approx(15)  # halfway in log2(size)
    assert link_bandwidth(spec, 1 << 21, "d2h") == pytest.approx(
        20
    )  # falling curves interpolate too
    mid = round(2**20.5)
    assert link_bandwidth(spec, mid, "h2d") == pytest.approx(
        10 + 10 * (math.log(mid) - math.log(1 << 20)) / math.log(4)
    )


# --------------------------------------------------------------------- probe


@pytest.fixture(scope="module")
def cpu_probe():
    """One quick probe as on a machine without an NVIDIA driver: NVML fails, CUDA is hidden."""
    import pynvml
    import torch

    def no_driver():
        raise pynvml.NVMLError_LibraryNotFound(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    warnings: list[str] = []
    steps: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pynvml, "nvmlInit", no_driver)
        mp.setattr(torch.cuda, "is_available", lambda: False)
        spec = hw.probe("auto", quick=True, progress=steps.append, warn=warnings.append)
    return spec, warnings, steps


def test_quick_cpu_probe_measures_the_host(cpu_probe):
    spec, _, steps = cpu_probe
    assert (spec.kind, spec.name, spec.source) == ("cpu", "cpu", "measured")
    check_consistent(spec)
    assert spec.device_memory_bytes == spec.host_memory_bytes > 0
    assert 0 < spec.usable_memory_bytes <= spec.device_memory_bytes
    assert spec.cpu_cores >= 1
    assert [p.size_bytes for p in spec.link] == list(hw.LINK_SIZES_BYTES)
    assert all(
        p.h2d_bytes_per_s == p.d2h_bytes_per_s > 0 for p in spec.link
    )  # one memcpy, both ways
    assert spec.dev_adam_params_per_s == spec.cpu_adam_params_per_s
    assert spec.allgather_bytes_per_s == spec.reduce_scatter_bytes_per_s == 0
    assert steps, "progress callback never called"


def test_probe_spec_round_trips(cpu_probe):
    spec, _, _ = cpu_probe
    data = dump_spec(spec)
    assert load_spec(data) == spec
    assert dump_spec(load_spec(data)) == data


def test_probe_without_nvidia_driver_says_so_in_one_line(cpu_probe):
    _, warnings, _ = cpu_probe
    assert len(warnings) == 1, warnings
    (msg,) = warnings
    assert "\n" not in msg
    assert (
        msg.startswith("NVML unavailable:")
        and "no NVIDIA driver" in msg
        and "probing the CPU" in msg
    )


def test_probe_to_file_writes_the_spec_and_a_summary(cpu_probe, tmp_path, monkeypatch):
    spec, _, _ = cpu_probe
    monkeypatch.setattr(hw, "probe", lambda *a, **k: spec)  # the measuring is tested above
    lines: list[str] = []
    out = tmp_path / "spec.json"
    assert hw.probe_to_file(out, quick=True, echo=lines.append) is spec
    assert out.read_bytes() == dump_spec(spec)
    assert lines[0].startswith(f"wrote {out}") and any("adam" in line for line in lines)
    with pytest.raises(ConfigError, match="does not exist"):
        hw.probe_to_file(tmp_path / "no" / "spec.json", echo=lines.append)


def test_nvml_generic_error_is_one_line(monkeypatch):
    import pynvml

    def fail():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    msgs: list[str] = []
    assert hw._nvml_info(0, None, msgs.append, fallback="probing the CPU as the device") is None
    assert (
        len(msgs) == 1 and "\n" not in msgs[0] and msgs[0].startswith("NVML unavailable: NVMLError")
    )


def test_nvml_missing_package_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    msgs: list[str] = []
    assert hw._nvml_info(0, None, msgs.append, fallback="probing the CPU as the device") is None
    assert msgs == [
        "NVML unavailable: the nvidia-ml-py package (module pynvml) is not installed; "
        "probing the CPU as the device"
    ]


def test_nvml_describes_a_gpu(monkeypatch):
    """The parsing side, against a fake driver (no GPU here)."""
    import pynvml

    class Mem:
        total = 150 << 30

    fake = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetHandleByUUID": lambda uuid: "h",
        "nvmlDeviceGetHandleByIndex": lambda i: "h",
        "nvmlDeviceGetName": lambda h: b"NVIDIA H200",
        "nvmlDeviceGetMemoryInfo": lambda h: Mem(),
        "nvmlDeviceGetCurrPcieLinkGeneration": lambda h: 5,
        "nvmlDeviceGetCurrPcieLinkWidth": lambda h: 16,
        "nvmlDeviceGetMaxPcieLinkGeneration": lambda h: 5,
        "nvmlDeviceGetMaxPcieLinkWidth": lambda h: 16,
    }
    for k, v in fake.items():
        monkeypatch.setattr(pynvml, k, v)
    msgs: list[str] = []
    info = hw._nvml_info(0, "GPU-1234", msgs.append, fallback="")
    assert msgs == []
    assert info == {
        "name": "NVIDIA H200",
        "memory_bytes": 150 << 30,
        "pcie": "PCIe Gen5 x16 now, max Gen5 x16",
    }
    assert hw._slug(info["name"]) == "nvidia-h200"


def test_probe_refuses_bad_devices():
    import torch

    with pytest.raises(ConfigError, match="expected auto, cpu, cuda or cuda:N"):
        hw.probe("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="torch sees no CUDA device"):
            hw.probe("cuda:0")


def test_importing_spec_and_hardware_stays_light():
    code = (
        "import sys, protrain.planner.hardware.probe, protrain.planner.hardware.spec\n"
        "print(sorted(m for m in ('torch', 'pynvml', 'numpy', 'scipy') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]", out
