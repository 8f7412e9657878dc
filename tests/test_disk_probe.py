"""The disk probe of the NVMe tier (planner/hardware/disk.py) and the spec's two disk fields.

The probe writes a few MiB into pytest's tmp_path, so these run in well under a
second; the rest of ``hardware.probe`` is stubbed where it is called (the real
probe runs once in test_hardware.py).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

from protrain.planner.hardware import datasheets as ds
from protrain.planner.hardware import disk
from protrain.planner.hardware import probe as hw
from protrain.planner.hardware.spec import HARDWARE_DIR, dump_spec, load_spec
from protrain.plans.errors import ConfigError

MiB = 1 << 20
SMALL = dict(nbytes=8 * MiB, piece=1 * MiB)  # 3 rounds of 8 MiB: milliseconds on any disk
DISK_FIELDS = ("disk_read_bytes_per_s", "disk_write_bytes_per_s")


# ----------------------------------------------------------------- probe_disk


def test_probe_disk_measures_and_leaves_nothing(tmp_path):
    (tmp_path / "keep.txt").write_text("the user's file")
    steps: list[str] = []
    read, write, how = disk.probe_disk(tmp_path, **SMALL, progress=steps.append)
    assert read > 0 and write > 0
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]  # the unlinked file is gone
    assert str(tmp_path) in how and "median of 3" in how and "fsync" in how
    assert "\n" not in how
    assert len(steps) == 1 and steps[0].startswith(f"disk {tmp_path}")


def test_probe_disk_says_when_the_directory_is_ram():
    shm = Path("/dev/shm")
    mount = disk.mount_of(shm)
    if not (shm.is_dir() and os.access(shm, os.W_OK) and mount and mount.fstype == "tmpfs"):
        pytest.skip("no writable tmpfs at /dev/shm")
    _, _, how = disk.probe_disk(shm, **SMALL)
    assert "tmpfs, held in RAM: these figures say nothing about a disk" in how


def test_probe_disk_refuses_a_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match="does not exist") as e:
        disk.probe_disk(tmp_path / "nope", **SMALL)
    assert f"mkdir -p {tmp_path / 'nope'}" in str(e.value)


def test_probe_disk_refuses_a_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("")
    with pytest.raises(ConfigError, match=f"{f}: not a directory") as e:
        disk.probe_disk(f, **SMALL)
    assert "HINT:" in str(e.value) and "--nvme DIR" in str(e.value)


def test_probe_disk_refuses_a_directory_it_cannot_write(tmp_path, monkeypatch):
    # chmod would not stop root (which CI may be), so the permission check is stubbed.
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    with pytest.raises(ConfigError, match="cannot create files in it"):
        disk.probe_disk(tmp_path, **SMALL)


def test_probe_disk_refuses_too_little_space(tmp_path, monkeypatch):
    real = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: real._replace(free=5 * MiB))
    with pytest.raises(ConfigError, match="5 MiB free, the disk probe writes 8 MiB"):
        disk.probe_disk(tmp_path, **SMALL)


def test_probe_disk_failing_midway_leaves_nothing(tmp_path, monkeypatch):
    calls = []

    def full(fd, buf, offset):
        calls.append(offset)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.write(fd, buf)

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(ConfigError, match="disk probe failed: No space left on device"):
        disk.probe_disk(tmp_path, **SMALL)
    assert list(tmp_path.iterdir()) == []


# -------------------------------------------------------------------- mount_of

MOUNTINFO = """\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24683792k
30 25 0:27 / /dev/shm rw,relatime - tmpfs shm2 rw
40 27 259:1 / /mnt/fast\\040disk rw,relatime shared:5 - xfs /dev/nvme0n1 rw
41 27 0:50 / /mnt/fast rw,relatime - nfs server:/x rw
"""


@pytest.mark.parametrize(
    "path, want",
    [
        ("/work/x", ("/", "ext4", "/dev/vda")),
        ("/dev/shm", ("/dev/shm", "tmpfs", "shm2")),  # stacked on one point: the last is on top
        ("/dev/shmx", ("/", "ext4", "/dev/vda")),  # a prefix of the name is not a parent
        ("/mnt/fast disk/states", ("/mnt/fast disk", "xfs", "/dev/nvme0n1")),  # \040 is a space
        ("/mnt/fast/states", ("/mnt/fast", "nfs", "server:/x")),
    ],
)
def test_mount_of_takes_the_longest_mount_point(path, want):
    assert disk.mount_of(path, MOUNTINFO) == disk.Mount(*want)


# ------------------------------------------------------------- the spec fields


def test_spec_with_disk_figures_round_trips():
    spec = ds.datasheet_spec("h200")
    data = dump_spec(spec).replace(
        b'"disk_read_bytes_per_s": 0', b'"disk_read_bytes_per_s": 3000000000'
    )
    loaded = load_spec(data)
    assert (loaded.disk_read_bytes_per_s, loaded.disk_write_bytes_per_s) == (3 * 10**9, 0)
    assert dump_spec(loaded) == data


def test_a_spec_written_before_the_disk_fields_loads_with_zeros():
    doc = json.loads(dump_spec(ds.datasheet_spec("cpu")))
    for key in DISK_FIELDS:
        del doc[key], doc["notes"][key]
    spec = load_spec(json.dumps(doc).encode())
    assert spec.disk_read_bytes_per_s == spec.disk_write_bytes_per_s == 0


def test_every_committed_spec_states_its_disk_figures():
    for path in HARDWARE_DIR.glob("*.json"):
        spec = load_spec(path)
        assert all(key in spec.notes for key in DISK_FIELDS), path.name


# ----------------------------------------------------------- hardware.probe


@pytest.fixture
def stubbed_probe(monkeypatch):
    """``hardware.probe`` with the CPU measurements replaced by fixed figures (disk stays real)."""
    monkeypatch.setattr(hw, "_cpu_adam_rate", lambda *a: (10**9, "stub"))

    def cpu(torch, quick, say, notes, host_total, host_avail):
        notes.update({k: "measured: stub" for k in ("link", "matmul_flops_per_s")})
        link = [hw.LinkPoint(size_bytes=MiB, h2d_bytes_per_s=10**9, d2h_bytes_per_s=10**9)]
        return dict(
            kind="cpu",
            device_name="stub",
            device_memory_bytes=host_total,
            usable_memory_bytes=host_avail,
            matmul_flops_per_s=10**9,
            matmul_fp32_flops_per_s=10**9,
            mem_bytes_per_s=10**9,
            link=link,
        )

    monkeypatch.setattr(hw, "_probe_cpu", cpu)
    monkeypatch.setattr(
        hw,
        "probe_disk",
        lambda d, n, progress: disk.probe_disk(
            d, min(n, SMALL["nbytes"]), SMALL["piece"], progress
        ),
    )


def test_probe_with_nvme_fills_the_disk_fields(stubbed_probe, tmp_path):
    steps: list[str] = []
    spec = hw.probe("cpu", quick=True, nvme=tmp_path, progress=steps.append)
    assert spec.disk_read_bytes_per_s > 0 and spec.disk_write_bytes_per_s > 0
    for key in DISK_FIELDS:
        assert spec.notes[key].startswith("measured: 8 MiB unlinked file in"), spec.notes[key]
    assert steps[0].startswith(f"disk {tmp_path}")  # first, so a bad directory fails fast
    assert list(tmp_path.iterdir()) == []


def test_probe_without_nvme_says_how_to_measure(stubbed_probe):
    spec = hw.probe("cpu", quick=True)
    assert spec.disk_read_bytes_per_s == spec.disk_write_bytes_per_s == 0
    for key in DISK_FIELDS:
        assert spec.notes[key] == (
            "not measured (0): pass --nvme DIR to measure the disk the NVMe tier will use"
        )


def test_probe_with_a_bad_nvme_directory_fails_before_measuring(monkeypatch, tmp_path):
    monkeypatch.setattr(hw, "_cpu_adam_rate", lambda *a: pytest.fail("measured before the check"))
    with pytest.raises(ConfigError, match="does not exist"):
        hw.probe("cpu", quick=True, nvme=tmp_path / "nope")


def test_probe_to_file_forwards_nvme(stubbed_probe, tmp_path):
    lines: list[str] = []
    out = tmp_path / "spec.json"
    states = tmp_path / "states"
    states.mkdir()
    spec = hw.probe_to_file(out, "cpu", quick=True, echo=lines.append, nvme=states)
    assert load_spec(out) == spec and spec.disk_write_bytes_per_s > 0
    assert any(line.startswith("  disk    ") and "GB/s read" in line for line in lines), lines
