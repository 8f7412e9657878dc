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
CI runs every code path of the executor without a GPU; and under the asynchronous
CPU emulation (tools/emulation.py, injected through ``EMULATION``) they complete later on worker
threads, so CI also catches a missing wait, record or release guard.

[Note: who waits for what]
- compute reads a fetched chunk or a swapped-in activation only after ``wait()``
  on its upload (``ChunkStore.wait``, the swap unpack hook);
- a release frees a chunk's storage only after its upload was waited on
  (``ChunkStore.release`` waits for a pending one: a prefetch never used);
- a download's source is recorded on the D2H stream, so it may be freed at once
  (gradient buffers after ``offload``, swapped activations after ``swap_out``);
- host code reads a download's destination only after ``synchronize()`` (the CPU
  Adam worker, before it accumulates or steps);
- the CPU Adam worker writes a chunk's home only after the last upload that read
  it has completed (``ChunkOptimizer._cpu_step``).
- a host slot is written again only after its last use is over: the upload that
  read it, or the CPU step that read the gradients in it (``ChunkStore.take_slot``).

Every copy is announced to the engine's listeners (``events.py``, [Note: events]):
``begin`` once the copy stream waits for what it must, ``end`` once the copy is
queued. A test that sleeps in a listener slows the copy engine down, which makes a
missing wait show up on a CPU box as a loss mismatch.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

import torch
from torch.autograd.profiler import record_function

from .events import Events


class CopyHandle:
    """Handle of one issued copy (and the collective queued behind it).

    ``event``: a ``torch.cuda.Event`` recorded after the copy on its stream, an
    ``EmulatedEvent`` (see tools/emulation.py), or None on synchronous CPU,
    where the copy has already happened.
    """

    __slots__ = ("event", "device")

    def __init__(self, event, device: torch.device):
        self.event = event
        self.device = device  # the engine's device: whose compute stream waits

    def wait(self) -> None:
        """Make the engine device's compute stream wait for the copy (the host does not block)."""
        if isinstance(self.event, torch.cuda.Event):
            torch.cuda.current_stream(self.device).wait_event(self.event)
        elif self.event is not None:
            self.event.wait()  # emulated: the host *is* the CPU's compute stream

    def synchronize(self) -> None:
        """Block the host until the copy is done (for host-side readers: the CPU Adam worker)."""
        if isinstance(self.event, torch.cuda.Event):
            self.event.synchronize()
        elif self.event is not None:
            self.event.wait()


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
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)  # 1D (nbytes,), host
        self.offset = 0  # bytes handed out so far
        # Unpins when closed, or when the arena is collected without a close (a failed
        # wrap): a registration that outlived its buffer would make the next
        # cudaHostRegister of that address range fail.
        self._unpin: weakref.finalize | None = None
        if pin and nbytes:
            err = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed (error {int(err)})")
            self._unpin = weakref.finalize(self, _unregister, self.buffer)

    @property
    def registered(self) -> bool:
        return self._unpin is not None and self._unpin.alive

    @classmethod
    def span(cls, numel: int, dtype: torch.dtype) -> int:
        """Bytes one ``take(numel, dtype)`` uses, alignment included."""
        return -(-numel * dtype.itemsize // cls.ALIGN) * cls.ALIGN

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        size = numel * dtype.itemsize
        assert self.offset + size <= self.buffer.numel(), "arena sized smaller than the plan needs"
        t = self.buffer[self.offset : self.offset + size].view(dtype)
        self.offset += self.span(numel, dtype)
        return t

    def close(self) -> None:
        if self._unpin is not None:
            self._unpin()  # runs _unregister once; later calls and the finaliser do nothing


def _unregister(buffer: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


class CopyEngine:
    """Issues copies between a device and host memory, and frees what copies touched.

    See [Note: copy streams]. Three back-ends behind one interface: CUDA streams and
    events; synchronous CPU copies; and the asynchronous CPU emulation of
    tools/emulation.py (``emulation``, or ``EMULATION``: ``PROTRAIN_ASYNC_CPU`` in the
    environment), in which this class's own code, waits and records included, runs
    exactly as on CUDA.
    """

    def __init__(self, device: torch.device, emulation=None):
        self.device = device
        self.events = Events()  # the engine's listeners (events.py), shared by its parts
        self.cuda = device.type == "cuda"
        if emulation is None and not self.cuda and EMULATION is not None:
            emulation = EMULATION()  # the tests' asynchronous CPU device, if installed
        self.emu = None if self.cuda else emulation
        self.asynchronous = self.cuda or self.emu is not None
        # Dedicated copy streams: CUDA streams, emulated worker streams, or None (sync CPU).
        if self.cuda:
            self.h2d, self.d2h = torch.cuda.Stream(device), torch.cuda.Stream(device)
        else:
            self.h2d, self.d2h = (
                (self.emu.stream("h2d"), self.emu.stream("d2h")) if self.emu else (None, None)
            )
        # [Note: chunk memory pool] Chunk and chunk-gradient storage is allocated from a
        # private pool, so activation churn in the general pool cannot fragment it, and
        # the pool holds no other tensors; ``reserve`` sizes it from the plan up front.
        has_pools = hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")
        self.pool = torch.cuda.MemPool() if self.cuda and has_pools else None

    # -- streams (the only back-end-specific lines)

    def _wait_compute(self, stream) -> None:
        """``stream`` starts its next work after everything compute issued so far."""
        if self.cuda:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        # CPU (emulated): compute is the host, and it has already finished.

    def _launch(self, stream, dst: torch.Tensor, src: torch.Tensor, then=None, weak_src=False):
        """Queue ``dst.copy_(src)`` and ``then()`` on ``stream``; return the event after them."""
        if self.cuda:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                if then is not None:
                    then()
                event = torch.cuda.Event()
                event.record(stream)
            return event
        return self.emu.launch(stream, dst, src, then, weak_src=weak_src)

    def _record(self, t: torch.Tensor, stream) -> None:
        """``t``'s memory must not be reused before ``stream``'s work so far is done."""
        if self.cuda:
            t.record_stream(stream)
        else:
            self.emu.record(t, stream)

    def collective(self, fn) -> None:
        """Run a compute-stream collective. Emulated: on the upload worker, in issue order,
        so that gloo sees every rank's collectives (all-gathers included) in plan order."""
        if self.emu is None or self.h2d.on_worker():
            fn()
        else:
            self.h2d.submit(fn, delay=False).wait()

    # -- copies

    def _note(self, name: str, edge: str, src: torch.Tensor, stream) -> None:
        """Tell the listeners about a copy ([Note: events]); the subject, if any, names it."""
        ev = self.events
        if ev.listeners:
            kind, chunk, block = ev.subject or (name, None, ev.segment)
            ev.emit(
                kind,
                edge,
                chunk=chunk,
                block=block,
                nbytes=src.numel() * src.element_size(),
                stream=stream if self.cuda else None,
            )

    def upload(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        name: str = "fetch",
        after: CopyHandle | None = None,
        gather=None,
    ) -> CopyHandle:
        """Copy ``src`` into device ``dst`` (already allocated): a host home or slot, or a
        device-homed chunk's device master (chunks.py [Note: device homes]). See
        [Note: copy streams].

        ``after``: a download that wrote ``src``; the upload waits for it on the copy stream.
        ``gather``: a collective to run right after the copy, on the same stream (the
        ZeRO-3 all-gather of the other ranks' shards); the returned handle covers both.
        The caller must ``wait()`` on the handle before compute reads ``dst``, and before
        ``dst``'s storage is freed (``free``).
        """
        return self._copy(self.h2d, dst, src, name, after, gather)

    def download(self, dst: torch.Tensor, src: torch.Tensor, name: str = "offload") -> CopyHandle:
        """Copy device ``src`` into host ``dst``; the host must ``synchronize()`` before reading
        dst.

        ``src`` may be freed right after this returns: it is recorded on the copy stream.
        """
        return self._copy(self.d2h, dst, src, name)

    def _copy(
        self,
        stream,
        dst: torch.Tensor,
        src: torch.Tensor,
        name: str,
        after: CopyHandle | None = None,
        then=None,
    ) -> CopyHandle:
        """``upload`` (on ``h2d``) or ``download`` (on ``d2h``): ``dst.copy_(src)``, then
        ``then()``."""
        with record_function(f"protrain::{name}"):
            if not self.asynchronous:
                self._note(name, "begin", src, None)
                dst.copy_(src)
                if then is not None:
                    then()
                self._note(name, "end", src, None)
                return CopyHandle(None, self.device)
            # An upload's dst may have been in use by compute until now; a download's src is
            # complete.
            self._wait_compute(stream)
            if after is not None and after.event is not None:
                stream.wait_event(after.event)
            self._note(name, "begin", src, stream)
            event = self._launch(stream, dst, src, then, weak_src=stream is self.d2h)
            if stream is self.d2h:
                self._record(src, stream)  # src's memory must outlive the copy
            self._note(name, "end", src, stream)
            return CopyHandle(event, self.device)

    # -- chunk storage

    def resize(self, t: torch.Tensor, nbytes: int, what: str) -> None:
        """Give ``t``'s storage ``nbytes`` (0 frees it). See [Note: chunk storage resize].

        A free must come after every copy that touches the storage has been waited on
        by compute, or was recorded on its stream; the emulation checks it.
        """
        s = t.untyped_storage()
        if self.emu is not None:
            if nbytes == 0 and self.emu.free(t, what):
                return  # deferred to the copy stream that recorded it
            self.emu.before_alloc(t)
        with self.pooled() if nbytes else contextlib.nullcontext():
            s.resize_(nbytes)

    def pooled(self):
        """Context in which new device tensors come from the chunk pool (CUDA; else nothing)."""
        return (
            torch.cuda.use_mem_pool(self.pool, self.device)
            if self.pool is not None
            else contextlib.nullcontext()
        )

    def reserve(self, nbytes: int) -> None:
        """Grow the chunk pool to ``nbytes`` once (CUDA), so chunks and fetches reuse its blocks."""
        if self.pool is not None and nbytes > 0:
            with torch.cuda.use_mem_pool(self.pool, self.device):
                block = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            del block  # the segment stays cached in the pool for the chunks to split

    def close(self) -> None:
        if self.emu is not None:
            self.emu.sweep()


EMULATION: Callable[[], object] | None = None
"""Where a new CPU copy engine gets an asynchronous emulation of the GPU's streams: a
callable returning one (or None), installed by the test suite (tools/emulation.py, which
the tests and their worker processes import); None in every other process. The runtime
imports nothing of the tests: they inject their device here."""
