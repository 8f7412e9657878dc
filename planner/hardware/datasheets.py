"""Hardware specs from datasheets: the cards we plan for without having them.

Each ``DATASHEETS`` entry holds the public datasheet figures and our stated
assumptions; ``datasheet_spec`` derives the achievable rates from them and writes
the origin of every figure into ``notes``. ``plans/hardware/<name>.json`` are
exactly ``dump_spec(datasheet_spec(name))``; regenerate them with
``write_datasheets()`` (a test compares the bytes). The measuring probe is
``probe.py``.
"""

from __future__ import annotations

from pathlib import Path

from protrain.plans.errors import ConfigError

from .spec import HARDWARE_DIR, HardwareSpec, LinkPoint, dump_spec

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
GB = 10**9

LINK_SIZES_BYTES = (64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)
"""Copy sizes of every link curve, datasheet or measured (chunks are 4-256 MiB)."""

ADAM_BYTES_PER_PARAM = 28
"""fp32 AdamW moves 28 B per parameter: reads param, grad, exp_avg, exp_avg_sq
(16 B), writes param, exp_avg, exp_avg_sq (12 B). Both Adams are memory-bound."""

# ------------------------------------------------------------------ datasheets

# Planning assumptions shared by all GPU entries; each is repeated in the notes of
# every spec it shapes, so a spec file reads on its own.
MATMUL_FRACTION = 0.70  # of datasheet dense peak: large cuBLAS GEMMs reach 75-90% on
#                         A100 and GeForce cards, 60-75% on H100/H200 under the power cap
MEM_FRACTION = 0.85  # of peak DRAM bandwidth: a device-to-device copy reaches 85-92%
CUDA_RESERVE_BYTES = 1 * GiB  # CUDA context (~0.3-0.5 GiB with lazy module loading)
#                               + cuBLAS workspaces + NCCL buffers, headless card
LINK_LATENCY_S = 8e-6  # per cudaMemcpyAsync: launch + DMA set-up, event-timed
HOST_ADAM_EFFICIENCY = 0.6  # CPU AdamW reaches ~60% of STREAM bandwidth (DeepSpeed
#                             CPU-Adam on a DGX-2 host: 1e9 params in ~0.25 s ≈ 112 of ~180 GB/s)

_PCIE = {
    # gen: (h2d, d2h) achievable pinned bytes/s at large sizes, CUDA bandwidthTest-like.
    # Gen4 checked against public nvbandwidth runs (issue 17 item 4d), one way at a
    # time: RTX 4090s (the 3090's link, PCIe 4.0 x16) 23.9-26.4 H2D, 26.3-27.1 D2H
    # (NVIDIA/nvbandwidth#15); A100 PCIe 25-26 both ways (#11). 24 / 25 sits at the
    # low end of that, as a consumer board's root complex tends to; kept. Both ways at
    # once the link is slower than that, see cost.LINK_DUPLEX.
    4: (24 * GB, 25 * GB),  # Gen4 x16: 32 GB/s raw per direction, 24-26 GB/s measured
    5: (50 * GB, 52 * GB),  # Gen5 x16: 64 GB/s raw per direction, 45-55 GB/s measured
}

DATASHEETS: dict[str, dict] = {
    # cuda_total_mib: what cudaMemGetInfo / torch reports as total (below nvidia-smi's
    # figure by 0.3-0.6 GiB); peak_*: datasheet dense rates WITHOUT sparsity, in
    # TFLOP/s; mem_peak_gbps: datasheet DRAM bandwidth; host_*: one rank's share of a
    # typical machine for the card; host_bw_gbps: that share of STREAM-like host DRAM
    # bandwidth; allgather/reduce_scatter_gbps: NCCL bus bandwidth in a 4-8 GPU node.
    "rtx3090": dict(
        device_name="NVIDIA GeForce RTX 3090",
        cuda_total_mib=24259,
        total_src=(
            "assumption: typical CUDA-visible total, torch total_memory seen on a 3090 "
            "(nvidia-smi: 24576 MiB; 24 GB GDDR6X)"
        ),
        peak_16bit=71.0,
        peak_16bit_src="GA102 whitepaper: FP16/BF16 tensor with FP32 accumulate 71 TFLOPS dense "
        "(142 with FP16 accumulate, which PyTorch matmul does not use; 284 sparse)",
        peak_fp32=35.6,
        peak_fp32_src="GA102 whitepaper: FP32 (non-tensor) 35.6 TFLOPS at 1695 MHz boost",
        mem_peak_gbps=936,
        mem_src="384-bit GDDR6X at 19.5 Gbps = 936 GB/s",
        pcie=4,
        host_cpus=32,
        host_gib=128,
        host_bw_gbps=40,
        host_src=(
            "workstation, Ryzen 9 5950X (16 cores / 32 threads), 128 GiB dual-channel DDR4-3200 "
            "(~40 GB/s STREAM)"
        ),
        allgather_gbps=10,
        reduce_scatter_gbps=10,
        coll_src=(
            "4 cards on PCIe Gen4 without P2P (GeForce): NCCL goes through host memory, ~8-12 GB/s "
            "bus bandwidth"
        ),
    ),
    "rtx4090": dict(
        device_name="NVIDIA GeForce RTX 4090",
        cuda_total_mib=24563,
        total_src=(
            "assumption: typical CUDA-visible total, torch total_memory seen on a 4090 "
            "(nvidia-smi: 24564 MiB; 24 GB GDDR6X); one report, may be ~0.3 GiB high"
        ),
        peak_16bit=165.2,
        peak_16bit_src="Ada (AD102) whitepaper: FP16/BF16 tensor with FP32 accumulate 165.2 TFLOPS "
        "dense (330.3 with FP16 accumulate; 660.6 sparse)",
        peak_fp32=82.6,
        peak_fp32_src="Ada whitepaper: FP32 (non-tensor) 82.6 TFLOPS at 2520 MHz boost",
        mem_peak_gbps=1008,
        mem_src="384-bit GDDR6X at 21 Gbps = 1008 GB/s",
        pcie=4,
        host_cpus=32,
        host_gib=128,
        host_bw_gbps=60,
        host_src=(
            "workstation, Ryzen 9 7950X (16 cores / 32 threads), 128 GiB dual-channel DDR5 (~60 "
            "GB/s STREAM)"
        ),
        allgather_gbps=10,
        reduce_scatter_gbps=10,
        coll_src=(
            "4 cards on PCIe Gen4; the driver disables P2P on GeForce Ada, NCCL goes through host "
            "memory, ~8-12 GB/s"
        ),
    ),
    "a100-40g": dict(
        device_name="NVIDIA A100-PCIE-40GB",
        cuda_total_mib=40326,
        total_src=(
            "assumption: typical CUDA-visible total, torch total_memory seen on an A100-PCIE-40GB "
            "(40 GB HBM2)"
        ),
        peak_16bit=312.0,
        peak_16bit_src="A100: BF16/FP16 tensor 312 TFLOPS dense (624 sparse)",
        peak_fp32=19.5,
        peak_fp32_src="A100: FP32 19.5 TFLOPS (TF32 tensor 156 is not used: TF32 off)",
        mem_peak_gbps=1555,
        mem_src="A100 40GB PCIe: 1,555 GB/s HBM2",
        pcie=4,
        host_cpus=32,
        host_gib=128,
        host_bw_gbps=75,
        host_src="1/4 of a 4-GPU PCIe server, 2x EPYC 7543 (64 cores / 128 threads), 512 GiB, "
        "16-channel DDR4-3200 (~300 GB/s STREAM)",
        allgather_gbps=20,
        reduce_scatter_gbps=20,
        coll_src=(
            "4 cards on PCIe Gen4 with P2P through the root complex / switch, no NVLink bridge: "
            "~18-22 GB/s"
        ),
    ),
    "a100-80g": dict(
        device_name="NVIDIA A100-SXM4-80GB",
        cuda_total_mib=81320,
        total_src="derived: nvidia-smi 81920 MiB (80 GB HBM2e) less 600 MiB, the gap seen on "
        "H100/H200/3090 between nvidia-smi and torch total_memory",
        peak_16bit=312.0,
        peak_16bit_src="A100: BF16/FP16 tensor 312 TFLOPS dense (624 sparse)",
        peak_fp32=19.5,
        peak_fp32_src="A100: FP32 19.5 TFLOPS (TF32 off)",
        mem_peak_gbps=2039,
        mem_src="A100 80GB SXM: 2,039 GB/s HBM2e",
        pcie=4,
        host_cpus=32,
        host_gib=256,
        host_bw_gbps=37,
        host_src="1/8 of a DGX A100 640GB, 2x EPYC 7742 (128 cores / 256 threads), 2 TiB, "
        "16-channel DDR4-3200 (~300 GB/s STREAM)",
        allgather_gbps=230,
        reduce_scatter_gbps=230,
        coll_src=(
            "8 GPUs on NVLink3/NVSwitch (600 GB/s bidirectional per GPU): nccl-tests bus bandwidth "
            "~220-240 GB/s"
        ),
    ),
    "a100-80g-pcie": dict(
        device_name="NVIDIA A100 80GB PCIe",
        cuda_total_mib=81320,
        total_src="derived: nvidia-smi 81920 MiB (80 GB HBM2e) less 600 MiB (as a100-80g)",
        peak_16bit=312.0,
        peak_16bit_src="A100: BF16/FP16 tensor 312 TFLOPS dense (624 sparse); "
        "the 300 W PCIe card sustains lower clocks than SXM",
        peak_fp32=19.5,
        peak_fp32_src="A100: FP32 19.5 TFLOPS (TF32 off)",
        mem_peak_gbps=1935,
        mem_src="A100 80GB PCIe: 1,935 GB/s HBM2e",
        pcie=4,
        host_cpus=32,
        host_gib=256,
        host_bw_gbps=75,
        host_src="1/4 of a 4-GPU PCIe server, 2x EPYC 7543 (64 cores / 128 threads), 1 TiB, "
        "16-channel DDR4-3200 (~300 GB/s STREAM)",
        allgather_gbps=20,
        reduce_scatter_gbps=20,
        coll_src="4 cards on PCIe Gen4 with P2P, no NVLink bridge: ~18-22 GB/s",
    ),
    "h100": dict(
        device_name="NVIDIA H100 80GB HBM3",
        cuda_total_mib=81089,
        total_src=(
            "assumption: typical CUDA-visible total, torch total_memory seen on H100 SXM "
            "(81082-81090 MiB; nvidia-smi 81559 MiB; 80 GB HBM3)"
        ),
        peak_16bit=989.4,
        peak_16bit_src="H100 SXM: BF16/FP16 tensor 1,979 TFLOPS with sparsity = 989.4 dense",
        peak_fp32=66.9,
        peak_fp32_src="H100 SXM: FP32 67 TFLOPS (TF32 off)",
        mem_peak_gbps=3350,
        mem_src="H100 SXM: 3.35 TB/s HBM3",
        pcie=5,
        host_cpus=28,
        host_gib=256,
        host_bw_gbps=56,
        host_src="1/8 of a DGX H100, 2x Xeon Platinum 8480C (112 cores / 224 threads), 2 TiB, "
        "16-channel DDR5-4800 (~450 GB/s STREAM)",
        allgather_gbps=370,
        reduce_scatter_gbps=360,
        coll_src=(
            "8 GPUs on NVLink4/NVSwitch (900 GB/s bidirectional per GPU): nccl-tests bus bandwidth "
            "~350-450 GB/s"
        ),
    ),
    "h200": dict(
        device_name="NVIDIA H200",
        cuda_total_mib=143156,
        total_src=(
            "assumption: typical CUDA-visible total, torch total_memory seen on H200 SXM (139.8 "
            "GiB; nvidia-smi 143771 MiB; datasheet 141 GB HBM3e)"
        ),
        peak_16bit=989.4,
        peak_16bit_src="H200 SXM: BF16/FP16 tensor 1,979 TFLOPS with sparsity = 989.4 dense "
        "(same GH100 compute as H100 SXM)",
        peak_fp32=66.9,
        peak_fp32_src="H200 SXM: FP32 67 TFLOPS (TF32 off)",
        mem_peak_gbps=4800,
        mem_src="H200 SXM: 4.8 TB/s HBM3e",
        pcie=5,
        host_cpus=28,
        host_gib=256,
        host_bw_gbps=56,
        host_src="1/8 of a DGX H200, 2x Xeon Platinum 8480C (112 cores / 224 threads), 2 TiB, "
        "16-channel DDR5-4800 (~450 GB/s STREAM)",
        allgather_gbps=370,
        reduce_scatter_gbps=360,
        coll_src=(
            "8 GPUs on NVLink4/NVSwitch (900 GB/s bidirectional per GPU): nccl-tests bus bandwidth "
            "~350-450 GB/s"
        ),
    ),
    "l4": dict(
        device_name="NVIDIA L4",
        cuda_total_mib=22434,
        total_src="derived: nvidia-smi 23034 MiB (24 GB GDDR6, ECC on) less 600 MiB",
        peak_16bit=121.0,
        peak_16bit_src="L4: BF16/FP16 tensor 242 TFLOPS with sparsity = 121 dense "
        "(data-center Ada: FP32 accumulate at full rate)",
        peak_fp32=30.3,
        peak_fp32_src="L4: FP32 30.3 TFLOPS (TF32 off)",
        mem_peak_gbps=300,
        mem_src="L4: 300 GB/s GDDR6",
        pcie=4,
        matmul_fraction=0.55,
        matmul_fraction_src="the 72 W cap pulls clocks well below boost under sustained GEMM",
        host_cpus=32,
        host_gib=128,
        host_bw_gbps=35,
        host_src=(
            "cloud VM with one L4 (GCP g2-standard-32: 32 vCPUs, 128 GB), ~1/3 of a socket's DRAM "
            "bandwidth"
        ),
        allgather_gbps=15,
        reduce_scatter_gbps=15,
        coll_src="4 cards on PCIe Gen4 with P2P (cloud VM, e.g. g2-standard-48): ~12-18 GB/s",
    ),
}
"""Datasheet inputs per card; ``datasheet_spec`` turns one into a spec with notes."""

# The generic CPU "device": CI and quickstart without a GPU. The host plays the
# device, so device memory is a share of RAM and the "link" is a memcpy.
CPU_DATASHEET = dict(
    device_name="generic x86-64 CPU (4 cores / 8 threads, AVX2)",
    host_gib=32,
    device_gib=16,
    reserve_gib=1,
    host_cpus=8,
    cores=4,
    ghz=3.0,
    fp32_flops_per_cycle=32,  # 2 FMA units x 8 fp32 lanes x 2 flop
    mem_gbps=20,
    memcpy_gbps=10,
    memcpy_latency_s=2e-6,
)


def _latency_curve(
    h2d_bytes_per_s: float, d2h_bytes_per_s: float, latency_s: float
) -> list[LinkPoint]:
    """Copy bandwidth over LINK_SIZES_BYTES from t = latency + size / bandwidth."""
    return [
        LinkPoint(
            size_bytes=s,
            h2d_bytes_per_s=round(s / (latency_s + s / h2d_bytes_per_s)),
            d2h_bytes_per_s=round(s / (latency_s + s / d2h_bytes_per_s)),
        )
        for s in LINK_SIZES_BYTES
    ]


DISK_NOTES = {
    f"disk_{rw}_bytes_per_s": "unknown (0): the NVMe tier's disk is not part of a datasheet; "
    "measure it with `protrain hardware probe --nvme DIR` (nothing goes on disk until then)"
    for rw in ("read", "write")
}
"""The disk figures' notes in every datasheet spec: a disk is the user's, never the card's."""


def datasheet_spec(name: str) -> HardwareSpec:
    """The spec of a named card from ``DATASHEETS`` (or ``cpu``), every figure's origin in notes."""
    if name == "cpu":
        return _cpu_datasheet_spec()
    if name not in DATASHEETS:
        from protrain.plans.errors import did_you_mean

        raise ConfigError(
            f"no datasheet for {name!r}{did_you_mean(name, [*DATASHEETS, 'cpu'])}; "
            f"known: {', '.join([*DATASHEETS, 'cpu'])}",
            "add an entry to DATASHEETS in planner/hardware/datasheets.py, or measure with "
            "`protrain hardware probe`",
        )
    d = DATASHEETS[name]
    frac = d.get("matmul_fraction", MATMUL_FRACTION)
    frac_why = d.get(
        "matmul_fraction_src",
        "large cuBLAS GEMMs reach 75-90% of peak on A100 and GeForce cards, "
        "60-75% on H100/H200 under the power cap",
    )
    total = d["cuda_total_mib"] * MiB
    mem_bw = MEM_FRACTION * d["mem_peak_gbps"] * GB
    h2d, d2h = _PCIE[d["pcie"]]
    host_bw = d["host_bw_gbps"] * GB
    notes = {
        "device_name": "datasheet: marketing name as the driver reports it",
        "device_memory_bytes": d["total_src"],
        "usable_memory_bytes": (
            f"assumption: total less {CUDA_RESERVE_BYTES // MiB} MiB for the CUDA context "
            "(~0.3-0.5 GiB with lazy module loading), cuBLAS workspaces and NCCL buffers; "
            "headless card (a display takes more)"
        ),
        "host_memory_bytes": f"assumption: {d['host_src']}",
        "cpu_cores": (
            "assumption: logical CPUs of one rank (as os.sched_getaffinity counts them): "
            f"{d['host_src']}"
        ),
        "matmul_flops_per_s": f"derived: {frac:.0%} of {d['peak_16bit']} TFLOPS ({frac_why}); "
        f"datasheet: {d['peak_16bit_src']}",
        "matmul_fp32_flops_per_s": f"derived: {frac:.0%} of {d['peak_fp32']} TFLOPS; datasheet: "
        f"{d['peak_fp32_src']}",
        "mem_bytes_per_s": (
            f"derived: {MEM_FRACTION:.0%} of peak (a device copy reaches 85-92%); datasheet: "
            f"{d['mem_src']}"
        ),
        "link": (
            f"derived: t = {LINK_LATENCY_S * 1e6:.0f} us + size / bandwidth, pinned host memory; "
            f"assumption: PCIe Gen{d['pcie']} x16 reaches {h2d / GB:.0f} GB/s H2D and "
            f"{d2h / GB:.0f} GB/s D2H at large sizes (bandwidthTest-like; hosts vary by +-15%)"
        ),
        "cpu_adam_params_per_s": (
            f"derived: {HOST_ADAM_EFFICIENCY:.0%} x {d['host_bw_gbps']} GB/s host DRAM share / "
            f"{ADAM_BYTES_PER_PARAM} B per param (fused AdamW is memory-bound); assumption: "
            f"{d['host_src']}"
        ),
        "dev_adam_params_per_s": (
            f"derived: mem_bytes_per_s / {ADAM_BYTES_PER_PARAM} B per param (fused AdamW, fp32 "
            "param/grad/exp_avg/exp_avg_sq: 16 B read, 12 B written)"
        ),
        "allgather_bytes_per_s": f"assumption: {d['coll_src']}",
        "reduce_scatter_bytes_per_s": f"assumption: {d['coll_src']}",
        "internode_bytes_per_s": "unknown (0): depends on the cluster fabric; set it for "
        "multi-node plans",
        **DISK_NOTES,
    }
    return HardwareSpec(
        name=name,
        kind="gpu",
        device_name=d["device_name"],
        device_memory_bytes=total,
        usable_memory_bytes=total - CUDA_RESERVE_BYTES,
        host_memory_bytes=d["host_gib"] * GiB,
        cpu_cores=d["host_cpus"],
        matmul_flops_per_s=round(frac * d["peak_16bit"] * 1e12),
        matmul_fp32_flops_per_s=round(frac * d["peak_fp32"] * 1e12),
        mem_bytes_per_s=round(mem_bw),
        link=_latency_curve(h2d, d2h, LINK_LATENCY_S),
        cpu_adam_params_per_s=round(HOST_ADAM_EFFICIENCY * host_bw / ADAM_BYTES_PER_PARAM),
        dev_adam_params_per_s=round(mem_bw / ADAM_BYTES_PER_PARAM),
        allgather_bytes_per_s=d["allgather_gbps"] * GB,
        reduce_scatter_bytes_per_s=d["reduce_scatter_gbps"] * GB,
        internode_bytes_per_s=0,
        source="datasheet",
        notes=notes,
    )


def _cpu_datasheet_spec() -> HardwareSpec:
    d = CPU_DATASHEET
    fp32_peak = d["cores"] * d["ghz"] * 1e9 * d["fp32_flops_per_cycle"]
    cpu_adam = round(HOST_ADAM_EFFICIENCY * d["mem_gbps"] * GB / ADAM_BYTES_PER_PARAM)
    host = (
        f"{d['cores']} cores / {d['host_cpus']} threads, {d['host_gib']} GiB dual-channel DDR4 (a "
        "dev box or CI runner)"
    )
    notes = {
        "device_name": "assumption: a generic CPU box; the host plays the device",
        "device_memory_bytes": (
            f"assumption: half of the {d['host_gib']} GiB host RAM is the device's share, the "
            "other half holds the offloaded states (same DRAM)"
        ),
        "usable_memory_bytes": f"assumption: the device share less {d['reserve_gib']} GiB for the "
        "Python/torch runtime",
        "host_memory_bytes": f"assumption: {host}",
        "cpu_cores": f"assumption: {host}",
        "matmul_flops_per_s": (
            "assumption: half the fp32 rate (AVX2 has no bf16 FMA; oneDNN converts to fp32); CPUs "
            "with AVX512-BF16/AMX are several times faster, measure them"
        ),
        "matmul_fp32_flops_per_s": (
            f"derived: {MATMUL_FRACTION:.0%} of {fp32_peak / 1e9:.0f} GFLOPS peak = {d['cores']} "
            f"cores x {d['ghz']} GHz x {d['fp32_flops_per_cycle']} flop/cycle (2 AVX2 FMA units)"
        ),
        "mem_bytes_per_s": (
            f"assumption: {d['mem_gbps']} GB/s for a large copy (read + write counted), "
            "dual-channel DDR4"
        ),
        "link": (
            f"derived: t = {d['memcpy_latency_s'] * 1e6:.0f} us + size / {d['memcpy_gbps']} GB/s; "
            "assumption: the link is a memcpy between two host tensors (copy bytes counted once)"
        ),
        "cpu_adam_params_per_s": f"derived: {HOST_ADAM_EFFICIENCY:.0%} x {d['mem_gbps']} GB/s / "
        f"{ADAM_BYTES_PER_PARAM} B per param (fused AdamW is memory-bound)",
        "dev_adam_params_per_s": "derived: equal to cpu_adam_params_per_s (the device is the host)",
        "allgather_bytes_per_s": "unknown (0): single process",
        "reduce_scatter_bytes_per_s": "unknown (0): single process",
        "internode_bytes_per_s": "unknown (0): single process",
        **DISK_NOTES,
    }
    device = d["device_gib"] * GiB
    return HardwareSpec(
        name="cpu",
        kind="cpu",
        device_name=d["device_name"],
        device_memory_bytes=device,
        usable_memory_bytes=device - d["reserve_gib"] * GiB,
        host_memory_bytes=d["host_gib"] * GiB,
        cpu_cores=d["host_cpus"],
        matmul_flops_per_s=round(MATMUL_FRACTION * fp32_peak / 2),
        matmul_fp32_flops_per_s=round(MATMUL_FRACTION * fp32_peak),
        mem_bytes_per_s=d["mem_gbps"] * GB,
        link=_latency_curve(d["memcpy_gbps"] * GB, d["memcpy_gbps"] * GB, d["memcpy_latency_s"]),
        cpu_adam_params_per_s=cpu_adam,
        dev_adam_params_per_s=cpu_adam,
        source="datasheet",
        notes=notes,
    )


def write_datasheets(directory: str | Path = HARDWARE_DIR) -> list[Path]:
    """(Re)write ``<directory>/<name>.json`` for every datasheet; returns the paths written.

    ``python -c "from protrain.planner.hardware.datasheets import write_datasheets;
    write_datasheets()"`` (one line)
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in [*DATASHEETS, "cpu"]:
        path = directory / f"{name}.json"
        path.write_bytes(dump_spec(datasheet_spec(name)))
        paths.append(path)
    return paths
