"""The disk probe: sequential bandwidth of the directory the NVMe tier will use.

The NVMe tier keeps some offloaded chunks' fp32 master and Adam moments in an
unlinked file under a user-given directory, mapped ``MAP_SHARED`` and read and
written a piece (4 MiB) at a time, pages dropped after use. What bounds it is the
device behind that directory, not the page cache, so the probe does the same
through plain file calls: write pieces, ``fsync`` (the time counts until the
device has the data), drop the now-clean pages with ``posix_fadvise(DONTNEED)``,
read the pieces back. ``protrain hardware probe --nvme DIR`` writes the two
figures into the spec (``disk_read_bytes_per_s``, ``disk_write_bytes_per_s``).

Standard library only: the CLI imports ``probe.py``, which imports this.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from protrain.plans.errors import ConfigError

from .datasheets import GB, MiB

RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs"})
"""Filesystems whose files live in memory: a "disk" probe there measures RAM."""

ROUNDS = 3
"""Write + read rounds; the figures are the medians."""


class Mount(NamedTuple):
    """The mount a path lives on, from ``/proc/self/mountinfo``."""

    point: str
    fstype: str
    source: str


def mount_of(path: str | Path, mountinfo: str | None = None) -> Mount | None:
    """The mount holding ``path`` (longest mount-point prefix; None where mountinfo is unreadable).

    ``os.statvfs`` has no filesystem type, so we read the kernel's mount table.
    Mounts stacked on one point are listed in order, so the last one is on top.
    ``mountinfo``: that table's text, for tests.
    """
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:  # not Linux
            return None
    target = os.path.realpath(path)
    best: Mount | None = None
    for line in mountinfo.splitlines():
        # id parent major:minor root MOUNT-POINT options [optional...] - FSTYPE SOURCE superoptions
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        point = _unescape(fields[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.point)):
            best = Mount(point, _unescape(tail[0]), _unescape(tail[1]))
    return best


def _unescape(field: str) -> str:
    r"""mountinfo writes space, tab, newline and backslash as octal escapes (``\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def probe_disk(
    directory: str | Path,
    nbytes: int = 256 * MiB,
    piece: int = 4 * MiB,
    progress: Callable[[str], None] | None = None,
) -> tuple[int, int, str]:
    """Sequential (read, write) bytes per second of ``directory``'s disk, and how they were
    measured.

    One unlinked file (``tempfile.TemporaryFile``), so nothing stays on disk even
    when the probe fails or is killed. Each of ``ROUNDS`` rounds writes ``nbytes``
    from offset 0 in ``piece``-sized ``pwrite`` calls and ``fsync``s (write time),
    drops the file's pages from the page cache, and reads it back in ``piece``-sized
    ``preadv`` calls (read time); the figures are the medians. The first round
    allocates the file's blocks and later ones overwrite them, as the tier does
    step after step. The data is random, so a compressing filesystem cannot shrink it.
    """
    if piece < 4096 or nbytes < piece:
        raise ValueError(f"need piece >= 4096 and nbytes >= piece, got {piece=} {nbytes=}")
    where = Path(directory)
    fix = "pass an existing, writable directory on the disk the NVMe tier will use (--nvme DIR)"
    if not where.exists():
        raise ConfigError(
            f"{where}: the disk-probe directory does not exist",
            f"create it (`mkdir -p {where}`), or {fix}",
        )
    if not where.is_dir():
        raise ConfigError(f"{where}: not a directory (the disk probe writes a file inside it)", fix)
    if not os.access(where, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{where}: this user cannot create files in it (no write permission)", fix
        )
    free = shutil.disk_usage(where).free
    n_pieces = nbytes // piece
    total = n_pieces * piece
    if free < total:
        raise ConfigError(
            f"{where}: {free / MiB:.0f} MiB free, the disk probe writes {total / MiB:.0f} MiB",
            f"free some space there, or {fix}",
        )
    mount = mount_of(where)
    on = f"{mount.fstype} on {mount.source}" if mount else "filesystem unknown"
    if progress:
        progress(
            f"disk {where} ({on}): {total // MiB} MiB in {piece // MiB} MiB pieces, {ROUNDS} rounds"
        )

    # One piece of random bytes; its first 8 are renumbered per piece, so no two pieces are
    # alike for a deduplicating filesystem.
    data = bytearray(os.urandom(piece))
    view = memoryview(data)
    back = memoryview(bytearray(piece))  # the read-back buffer
    reads, writes, cached = [], [], False
    try:
        with tempfile.TemporaryFile(dir=where) as f:
            fd = f.fileno()
            for _ in range(ROUNDS):
                t0 = time.perf_counter()
                for i in range(n_pieces):
                    data[:8] = i.to_bytes(8, "little")
                    _pwrite_all(fd, view, i * piece)
                os.fsync(fd)
                writes.append(time.perf_counter() - t0)
                cached |= _drop_pages(fd, back[:4096])
                t0 = time.perf_counter()
                for i in range(n_pieces):
                    got = os.preadv(fd, [back], i * piece)
                    if got != piece:
                        raise OSError(f"short read: {got} of {piece} bytes at offset {i * piece}")
                reads.append(time.perf_counter() - t0)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # leave no page cache behind
    except OSError as e:
        raise ConfigError(f"{where}: the disk probe failed: {e.strerror or e}", fix) from None

    read_bps = round(total / statistics.median(reads))
    write_bps = round(total / statistics.median(writes))
    how = (
        f"{total // MiB} MiB unlinked file in {where} ({on}), {piece // MiB} MiB pwrite pieces + "
        f"fsync, pages dropped (posix_fadvise DONTNEED), read back in {piece // MiB} MiB preadv "
        f"pieces; median of {ROUNDS} rounds (the first allocates the blocks, later ones overwrite "
        f"them); rounds read {_rates(total, reads)}, write {_rates(total, writes)} GB/s"
    )
    if mount and mount.fstype in RAM_FILESYSTEMS:
        how += (
            f"; {mount.point} is {mount.fstype}, held in RAM: these figures say nothing about a "
            "disk"
        )
    elif cached:
        how += (
            "; the page cache kept the file after posix_fadvise(DONTNEED), so the read "
            "figure may be memory speed"
        )
    return read_bps, write_bps, how


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    """``os.pwrite`` until every byte is written (a regular file rarely writes short, but may)."""
    while buf:
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n


def _drop_pages(fd: int, probe_buf: memoryview) -> bool:
    """Drop the file's clean pages; True when the first page is still cached afterwards.

    ``RWF_NOWAIT`` reads only from the page cache and fails with EAGAIN otherwise,
    which tells us whether the drop took (some network filesystems ignore it; tmpfs
    refuses RWF_NOWAIT, and its RAM is named in the note anyway). That failed read may
    start readahead, so we drop once more after it.
    """
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    try:
        cached = os.preadv(fd, [probe_buf], 0, os.RWF_NOWAIT) == len(probe_buf)
    except (
        OSError,
        AttributeError,
    ):  # EAGAIN: not cached; EOPNOTSUPP or no RWF_NOWAIT: cannot tell
        cached = False
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return cached


def _rates(total: int, secs: list[float]) -> str:
    return "/".join(f"{total / s / GB:.3g}" for s in secs)
