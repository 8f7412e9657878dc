"""The copy engine: host↔device copies on dedicated streams (CUDA) or synchronously (CPU).

[Note: copy streams]
On CUDA, uploads (H2D) and downloads (D2H) run on two dedicated streams so they
overlap compute. Ordering is by events only, never by host waits: a copy first
waits (on its stream) for an event recorded on the compute stream, so it never
reads a tensor compute has not finished writing; compute later waits (on the
compute stream) for the copy's own event before touching the result. Memory a copy
writes into is allocated while the copy stream is current and then marked as used
by the compute stream (``record_stream``), so the caching allocator never hands it
to another tensor while either stream may still use it.

On CPU the same calls copy synchronously and return an already-complete handle, so
CI runs every code path of the executor without a GPU.

[Note: delay injection]
``DELAYS`` holds seconds to sleep before named operations. Tests set them to make
races visible on a CPU box (shared/STYLE.md rule 13): a missing wait then shows up
as a loss mismatch rather than passing by luck. They are zero in normal runs.
"""

from __future__ import annotations

import time

import torch
from torch.autograd.profiler import record_function

DELAYS: dict[str, float] = {
    "before_copy": 0.0,  # before every H2D/D2H copy is issued
    "before_cpu_adam": 0.0,  # in the CPU optimizer worker, before each chunk's step
    "before_weights_return": 0.0,  # in the worker, before updated weights reach the chunk's home
}


def delay(name: str) -> None:
    """Sleep for ``DELAYS[name]`` seconds (test hook; zero by default)."""
    seconds = DELAYS[name]
    if seconds:
        time.sleep(seconds)


class Copy:
    """Handle of one issued copy; ``wait()`` makes the current stream wait for it."""

    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event | None):
        self.event = event  # None on CPU: the copy already happened

    def wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def synchronize(self) -> None:
        """Block the host until the copy is done (only for host-side readers, e.g. CPU Adam)."""
        if self.event is not None:
            self.event.synchronize()


class HostArena:
    """One host allocation holding every pinned buffer whose size the plan fixes.

    [Note: pinned arena] Offloaded chunks' homes (and, for 16-bit compute, their
    gradient staging buffers) are carved from one buffer allocated at ``wrap``, sized
    exactly from the plan (chunk count × shard size, each slice aligned to
    ``ALIGN`` bytes). On CUDA the buffer is ordinary pageable memory pinned with
    ``cudaHostRegister``: torch's caching host allocator rounds every pinned block up
    to a power of two, which can double the host memory a plan was sized for.
    Swapped activations (sizes known only as tensors are saved) still come from
    torch's caching pinned allocator, reused from the first step on.
    """

    ALIGN = 512

    def __init__(self, nbytes: int, pin: bool):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.offset = 0
        self.registered = False
        if pin and nbytes:
            err = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed (error {int(err)})")
            self.registered = True

    @classmethod
    def span(cls, numel: int, dtype: torch.dtype) -> int:
        """Bytes one ``take(numel, dtype)`` uses, alignment included."""
        size = numel * torch.empty((), dtype=dtype).element_size()
        return -(-size // cls.ALIGN) * cls.ALIGN

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        size = numel * torch.empty((), dtype=dtype).element_size()
        assert self.offset + size <= self.buffer.numel(), "arena sized smaller than the plan needs"
        t = self.buffer[self.offset: self.offset + size].view(dtype)
        self.offset += self.span(numel, dtype)
        return t

    def close(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.registered = False


class CopyEngine:
    """Issues copies between a device and host memory. See [Note: copy streams]."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        # Dedicated copy streams on CUDA; None on CPU, where copies are synchronous.
        self.h2d: torch.cuda.Stream | None = torch.cuda.Stream(device) if self.cuda else None
        self.d2h: torch.cuda.Stream | None = torch.cuda.Stream(device) if self.cuda else None

    def upload(self, dst: torch.Tensor, src: torch.Tensor, name: str = "fetch",
               after: Copy | None = None, gather=None) -> Copy:
        """Copy host ``src`` into device ``dst`` (already allocated). See [Note: copy streams].

        ``after``: a download that wrote ``src``; the upload waits for it on the copy stream.
        ``gather``: a collective to run right after the copy, on the same stream (the
        ZeRO-3 all-gather of the other ranks' shards); the returned handle covers both.
        """
        delay("before_copy")
        with record_function(f"protrain::{name}"):
            if not self.cuda:
                dst.copy_(src)
                if gather is not None:
                    gather()
                return Copy(None)
            compute = torch.cuda.current_stream(self.device)
            self.h2d.wait_stream(compute)  # dst may have been in use by compute until now
            if after is not None and after.event is not None:
                self.h2d.wait_event(after.event)
            with torch.cuda.stream(self.h2d):
                dst.copy_(src, non_blocking=True)
                if gather is not None:
                    gather()
                event = torch.cuda.Event()
                event.record(self.h2d)
            dst.record_stream(compute)
            return Copy(event)

    def download(self, dst: torch.Tensor, src: torch.Tensor, name: str = "offload") -> Copy:
        """Copy device ``src`` into host ``dst``; the host must ``synchronize()`` before reading dst."""
        delay("before_copy")
        with record_function(f"protrain::{name}"):
            if not self.cuda:
                dst.copy_(src)
                return Copy(None)
            self.d2h.wait_stream(torch.cuda.current_stream(self.device))  # src is complete
            with torch.cuda.stream(self.d2h):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.d2h)
            src.record_stream(self.d2h)  # src's memory must outlive the copy
            return Copy(event)
