"""The NVMe tier: offloaded chunks' fp32 masters and Adam moments in a file on disk.

[Note: NVMe tier]
A chunk in ``placement.nvme`` keeps this rank's shard of its fp32 master and the two
Adam moments (12 B per element; in fp32 compute the master is also its home) in one
file under the directory named at run time, not in host memory. The file is mapped
(``MAP_SHARED``) and the tensors are views of the mapping, so every code path that
reads or writes a master — the CPU step, a homeless fetch's rounding, ``write_back``,
checkpoints — does the same arithmetic on the same values as with host states: the
tier changes where bytes live, never the math.

What keeps them off the host is that each use is followed by ``drop``: the touched
pages leave this process (``madvise(MADV_DONTNEED)``: for a shared file mapping the
data stays in the file, and a later read faults it back) and the kernel is told to
write them back and forget them (``posix_fadvise(POSIX_FADV_DONTNEED)``). The hot
loops (the CPU step, the fetch's rounding, the home's refresh) go one ``STEP_PIECE``
at a time and drop each piece after it, so the resident part of the file is bounded
by ``NVME_WINDOW`` (homes.py; accounting.py counts it), not by the model. ``prefetch`` asks
the kernel to read a chunk's states ahead (``MADV_WILLNEED``) before its step.

The file is created unlinked (``O_TMPFILE``): nothing is left on the disk when the
process ends, however it ends. Its contents are no checkpoint: ``Engine.save``
writes the states as for host ones.

Honest limits: the kernel's page cache, not this process, holds pages between the
write and their writeback (reclaimable, but counted by a cgroup's memory limit until
written); page faults read 4 KiB at a time plus readahead, slower than large
``O_DIRECT`` reads. A directory on tmpfs is RAM, not a disk.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import weakref
from pathlib import Path

import torch

from protrain.plans.accounting import STEP_PIECE, nvme_span
from protrain.plans.errors import ConfigError

PAGE = mmap.PAGESIZE


class DiskStates:
    """One mapped file holding fp32 tensors whose sizes the plan fixes (``take``)."""

    def __init__(self, directory: str | os.PathLike, nbytes: int):
        where = Path(directory)
        if not where.is_dir():
            raise ConfigError(
                f"NVMe directory {str(where)!r} does not exist or is not a directory",
                "pass an existing directory on the disk for the tier (--nvme DIR)",
            )
        try:
            self.file = tempfile.TemporaryFile(dir=where)  # unlinked: gone with the process
            # Blocks reserved now: a sparse file would run out of space at a page's first write,
            # inside a step, as SIGBUS (no traceback, no checkpoint), not here as an error.
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self.file.fileno(), 0, max(nbytes, PAGE))
            else:
                os.ftruncate(self.file.fileno(), max(nbytes, PAGE))
            self.map = mmap.mmap(
                self.file.fileno(),
                max(nbytes, PAGE),
                flags=mmap.MAP_SHARED,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        except OSError as e:
            if getattr(self, "file", None) is not None:
                self.file.close()
            raise ConfigError(
                f"NVMe directory {str(where)!r}: cannot reserve and map a {nbytes:,}-byte file "
                f"there ({e.strerror or e})",
                "pass a writable directory with that much free space (--nvme DIR)",
            ) from None
        self.nbytes = nbytes
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)  # 1D (nbytes,), file-backed
        self.base = self.bytes.data_ptr()
        self.offset = 0
        self._close = weakref.finalize(self, self.file.close)  # the mapping goes with its last view

    def take(self, numel: int) -> torch.Tensor:
        """A zeroed fp32 tensor of ``numel`` elements in the file, starting on a page."""
        size = nvme_span(numel)
        assert self.offset + size <= self.nbytes, "NVMe file sized smaller than the plan needs"
        t = self.bytes[self.offset : self.offset + numel * 4].view(torch.float32)
        self.offset += size
        return t

    def _pages(self, ts: tuple[torch.Tensor, ...]):
        """``(lo, n)``: each of ``ts``'s bytes in the mapping (views of ``take``'s), widened to
        whole pages; those of no page left out."""
        for t in ts:
            start = t.data_ptr() - self.base
            assert 0 <= start <= self.nbytes, "not a tensor of this file"
            lo = start // PAGE * PAGE
            n = -(-(start + t.numel() * t.element_size()) // PAGE) * PAGE - lo
            if n:
                yield lo, n

    def drop(self, *ts: torch.Tensor) -> None:
        """Take the pages of ``ts`` out of this process and start writing them back. Pages of
        the same chunk only: another chunk's states start on pages of their own."""
        for lo, n in self._pages(ts):
            self.map.madvise(mmap.MADV_DONTNEED, lo, n)
            if hasattr(os, "posix_fadvise"):  # (Linux; macOS has none)
                os.posix_fadvise(self.file.fileno(), lo, n, os.POSIX_FADV_DONTNEED)

    def prefetch(self, *ts: torch.Tensor) -> None:
        """Ask the kernel to read ``ts`` into its page cache ahead of their use."""
        for lo, n in self._pages(ts):
            self.map.madvise(mmap.MADV_WILLNEED, lo, n)

    def close(self) -> None:
        """Out of this process's memory, and the descriptor closed. The disk space is freed
        when the last view of the mapping goes (the engine's optimizer holds them)."""
        self.drop(self.bytes)
        self._close()


def copy_pieces(
    dst: torch.Tensor, src: torch.Tensor, disk: DiskStates | None, *, drop_dst: bool = False
) -> None:
    """``dst.copy_(src)`` one ``STEP_PIECE`` at a time, dropping each piece of the file-backed
    side (``src``, or ``dst`` with ``drop_dst``) after it: the resident part stays one piece.
    ``disk`` None: neither side is in the file (the same values, nothing to drop)."""
    for a in range(0, src.numel(), STEP_PIECE):
        b = min(a + STEP_PIECE, src.numel())
        dst[a:b].copy_(src[a:b])
        if disk is not None:
            disk.drop(dst[a:b] if drop_dst else src[a:b])
