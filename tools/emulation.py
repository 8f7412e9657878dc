"""An asynchronous CPU device for tests: copies and side-stream collectives complete later.

[Note: asynchronous CPU emulation]
On CPU every copy is synchronous and every tensor sits on one device, so a missing
event wait, a missing ``record_stream`` or a buffer freed under an in-flight copy
passes every CPU test and corrupts data on the first GPU. This module makes the CPU
an adversary of the GPU. With it on (``PROTRAIN_ASYNC_CPU=SEED`` in the environment,
or ``emulate(seed)`` in a test), the copy engine's two streams become worker threads
that run each queued copy (and the ZeRO-3 all-gather queued behind it) after a
random delay, in FIFO order, exactly where a CUDA stream would run them:

- the destination of every copy is *poisoned* (NaN in floating point, -1 in
  integers) when the copy is issued, so a consumer that reads it before waiting on
  the copy's event reads NaN, and the loss parity tests fail;
- a copy's event is set only when the copy has run; "compute waits on the event"
  is the host blocking, because on CPU the host is the compute stream;
- freeing (``resize_(0)``) a storage that an unfinished copy reads or writes
  raises ``AsyncHazard`` at the free, unless the storage was *recorded* on the
  copy's stream (``record_stream``), in which case the free is deferred to that
  stream, after the copy, as the caching allocator defers reuse of a recorded
  block (the host does not block: a host reader that skipped its wait still loses);
- a download whose source tensor was dropped (refcount) before the copy ran, and
  was not recorded, fails the copy with ``AsyncHazard`` (the op holds only a weak
  reference to its source, as the allocator holds none).

Collectives issued on the compute stream (reduce-scatter, all-reduce) are
stream-ordered on CUDA (a synchronous NCCL call makes the current stream wait for
it), so they stay synchronous here; but they are *run* on the upload worker, in
issue order, so that every rank issues its gloo collectives in the plan's order
even though fetch all-gathers run on that worker. What the emulation cannot see:
the copy streams waiting for compute (``wait_stream``), because CPU compute has
already finished when the host issues the next call.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable

import torch

from protrain.executor import transfer
from protrain.plans.errors import ProtrainError

ENV = "PROTRAIN_ASYNC_CPU"
"""Debug switch: ``PROTRAIN_ASYNC_CPU=SEED`` (or ``SEED,MIN_MS,MAX_MS`` for the delay range)
turns the CPU copy engine asynchronous."""

_override: list[AsyncCPU | None] = []  # emulate() in tests; the environment otherwise


class AsyncHazard(ProtrainError):
    """A stream-ordering bug: memory freed or read while a copy still used it."""


_host_marked: dict[int, weakref.ref] = {}  # storage data_ptr -> the marked tensor


def host_tensor(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t``'s storage as living on the host although the emulated device is the CPU too.

    Tests use it for what a GPU model keeps on the host, such as the philox seed and
    offset that flash/efficient SDPA save for backward: a D2H copy from such a tensor
    or any view of its storage (or recording it on a copy stream, which has no CPU
    kernel) fails, as on CUDA. The mark lasts as long as ``t``.
    """
    key = t.untyped_storage().data_ptr()
    _host_marked[key] = weakref.ref(t, lambda _r: _host_marked.pop(key, None))
    return t


def _is_host(t: torch.Tensor) -> bool:
    r = _host_marked.get(t.untyped_storage().data_ptr())
    return r is not None and r() is not None


def poison(t: torch.Tensor, whole_storage: bool = False) -> None:
    """Set every byte of ``t`` (or of its whole storage) to 0xFF: NaN in floating point."""
    if whole_storage:
        s = t.untyped_storage()
        if s.nbytes():
            torch.empty(0, dtype=torch.uint8).set_(s).fill_(0xFF)
    elif t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(-1)


class EmulatedEvent:
    """Set when the work before it on its stream has run; carries the first error."""

    __slots__ = ("flag", "error")

    def __init__(self):
        self.flag = threading.Event()
        self.error: BaseException | None = None

    def query(self) -> bool:
        return self.flag.is_set()

    def wait(self) -> None:
        self.flag.wait()
        if self.error is not None:
            raise self.error


class EmulatedStream:
    """A FIFO of work run by one daemon thread, each item after a random delay."""

    def __init__(self, emu: AsyncCPU, name: str, seed: int):
        self.emu = emu
        self.name = name
        self.rng = random.Random(seed)
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"protrain-emu-{name}", daemon=True)
        self.thread.start()
        _LIVE.add(self)

    def submit(self, fn: Callable[[], None], delay: bool = True) -> EmulatedEvent:
        ev = EmulatedEvent()
        self.queue.put((fn, ev, delay))
        return ev

    def wait_event(self, ev: EmulatedEvent) -> None:
        """Later work on this stream starts only after ``ev`` (``cudaStreamWaitEvent``)."""
        self.submit(ev.wait, delay=False)

    def on_worker(self) -> bool:
        return threading.current_thread() is self.thread

    def stop(self) -> None:
        """Let the queued work finish, then end the thread (at exit: a daemon thread still in a
        torch op when the interpreter finalizes is unwound through C++ that cannot unwind, and
        the process aborts with "terminate called without an active exception")."""
        self.queue.put(None)
        self.thread.join(timeout=10)

    def _loop(self) -> None:
        inherited: BaseException | None = None
        while True:
            item = self.queue.get()
            if item is None:
                return
            fn, ev, delay = item
            if delay:
                time.sleep(self.emu.draw_delay(self.rng))
            try:
                if inherited is None:
                    fn()
            except BaseException as e:  # noqa: BLE001 - carried to whoever waits on the event
                inherited = e  # a failed stream stays failed, as a CUDA error is sticky
                self.emu.errors.append(e)
            ev.error = inherited
            ev.flag.set()


_LIVE: weakref.WeakSet[EmulatedStream] = weakref.WeakSet()
"""Every stream whose thread runs, stopped at exit (``EmulatedStream.stop``)."""


@atexit.register
def _stop_all() -> None:
    for stream in list(_LIVE):
        stream.stop()


class AsyncCPU:
    """The emulated device: two streams, the in-flight table and the recorded storages."""

    def __init__(
        self,
        seed: int,
        min_delay_s: float = 2e-4,
        max_delay_s: float = 2e-3,
        tail_p: float = 0.1,
        tail_s: float = 0.01,
    ):
        self.seed = seed
        self.min_delay_s = min_delay_s
        self.max_delay_s = max_delay_s
        # A long tail: a copy now and then lands much later than its neighbours, so a
        # host reader on another thread (the CPU Adam worker) that skipped its wait reads
        # the poison even when thread scheduling would let a short copy win the race.
        self.tail_p = tail_p
        self.tail_s = tail_s
        self.errors: list[BaseException] = []  # every failure on a worker, for tests to assert on
        self.lock = threading.Lock()
        # storage data_ptr -> unfinished ops (their events) that read or write it.
        self.inflight: dict[int, list[EmulatedEvent]] = {}
        # storage data_ptr -> (tensor kept alive, stream, event): record_stream's deferred free.
        self.recorded: dict[int, list[tuple[torch.Tensor, EmulatedStream, EmulatedEvent]]] = {}
        self.n_records = 0
        # StorageImpl address -> the event after its deferred free (see ``free``).
        self.deferred_frees: dict[int, EmulatedEvent] = {}
        self.n_streams = 0

    def draw_delay(self, rng: random.Random) -> float:
        if rng.random() < self.tail_p:
            return self.tail_s
        return self.min_delay_s + rng.random() * (self.max_delay_s - self.min_delay_s)

    def stream(self, name: str) -> EmulatedStream:
        self.n_streams += 1
        return EmulatedStream(self, name, self.seed * 1000 + self.n_streams)

    def launch(
        self,
        stream: EmulatedStream,
        dst: torch.Tensor,
        src: torch.Tensor,
        then: Callable[[], None] | None = None,
        weak_src: bool = False,
    ) -> EmulatedEvent:
        """Queue ``dst.copy_(src)`` (then ``then()``) on ``stream``; poison ``dst`` now."""
        if weak_src and _is_host(src):
            raise AsyncHazard(
                f"{stream.name}: a device-to-host copy from a host tensor "
                f"{tuple(src.shape)} {src.dtype}",
                "leave host tensors where they are",
            )
        poison(dst, whole_storage=then is not None)  # a ZeRO-3 all-gather writes the whole chunk
        ptrs = {dst.untyped_storage().data_ptr(), src.untyped_storage().data_ptr()}
        ref = weakref.ref(src) if weak_src else (lambda s=src: s)
        ev_box: list[EmulatedEvent] = []

        def run() -> None:
            try:
                s = ref()
                if s is None:
                    raise AsyncHazard(
                        f"{stream.name}: the source of a copy was freed before the copy ran "
                        "(a missing record_stream)",
                        "record the tensor on the copy stream",
                    )
                dst.copy_(s)
                if then is not None:
                    then()
            finally:
                self._retire(ptrs, ev_box)

        with self.lock:
            ev = stream.submit(run)
            ev_box.append(ev)
            for p in ptrs:
                self.inflight.setdefault(p, []).append(ev)
        return ev

    def _retire(self, ptrs: set[int], ev_box: list[EmulatedEvent]) -> None:
        with self.lock:  # launch() appends the event under this lock before the work can end
            ev = ev_box[0]
            for p in ptrs:
                evs = self.inflight.get(p, [])
                if ev in evs:
                    evs.remove(ev)
                if not evs:
                    self.inflight.pop(p, None)

    def record(self, t: torch.Tensor, stream: EmulatedStream) -> None:
        """``t.record_stream(stream)``: a free of ``t`` is deferred past the stream's work so
        far."""
        if _is_host(t):
            raise AsyncHazard(
                "record_stream of a host tensor (no CPU kernel)",
                "leave host tensors where they are",
            )
        ev = stream.submit(lambda: None, delay=False)
        with self.lock:
            self.recorded.setdefault(t.untyped_storage().data_ptr(), []).append((t, stream, ev))
            self.n_records += 1
        if self.n_records % 256 == 0:
            self.sweep()

    def free(self, t: torch.Tensor, what: str) -> bool:
        """Before ``t``'s storage is freed: refuse if an unrecorded copy still uses it.

        Returns True when the free was deferred (recorded work still pending): the
        storage is then freed on the recording stream after that work, as the caching
        allocator defers the reuse of a recorded block, without blocking the host.
        """
        ptr = t.untyped_storage().data_ptr()
        with self.lock:
            recorded = [r for r in self.recorded.pop(ptr, []) if not r[2].query()]
            pending = [ev for ev in self.inflight.get(ptr, []) if not ev.query()]
        if pending and not recorded:
            raise AsyncHazard(
                f"{what}: storage freed while {len(pending)} copy(ies) into or from it "
                "are still in flight",
                "wait on the copy's event (or record the "
                "storage on the copy stream) before freeing it",
            )
        if not recorded:
            return False
        stream = recorded[-1][1]
        for _, other, ev in recorded[:-1]:
            if other is not stream:
                stream.wait_event(ev)
        key = t.untyped_storage()._cdata
        # The recorded tensors (views of the storage among them: a copy's source) live until
        # the free runs, after their copies, as the allocator keeps a recorded block.
        done = stream.submit(lambda: (recorded, t.untyped_storage().resize_(0)), delay=False)
        with self.lock:
            self.deferred_frees[key] = done
        return True

    def before_alloc(self, t: torch.Tensor) -> None:
        """Before ``t``'s storage is given memory again: its deferred free must have run."""
        with self.lock:
            done = self.deferred_frees.pop(t.untyped_storage()._cdata, None)
        if done is not None:
            done.wait()

    def sweep(self) -> None:
        """Drop recorded tensors whose work has finished (keeps the table small)."""
        with self.lock:
            for ptr in list(self.recorded):
                live = [r for r in self.recorded[ptr] if not r[2].query()]
                if live:
                    self.recorded[ptr] = live
                else:
                    del self.recorded[ptr]


def current() -> AsyncCPU | None:  # installed as transfer.EMULATION below
    """The emulation a new CPU copy engine should use: ``emulate()``'s, else the environment's."""
    if _override:
        return _override[-1]
    value = os.environ.get(ENV)
    if not value:
        return None
    seed, *ms = value.split(",")
    if ms:
        return AsyncCPU(int(seed), float(ms[0]) / 1e3, float(ms[1]) / 1e3)
    return AsyncCPU(int(seed))


@contextlib.contextmanager
def emulate(
    seed: int,
    min_delay_s: float = 2e-4,
    max_delay_s: float = 2e-3,
    tail_p: float = 0.1,
    tail_s: float = 0.01,
):
    """Copy engines created inside run asynchronously on CPU (see the Note above)."""
    emu = AsyncCPU(seed, min_delay_s, max_delay_s, tail_p, tail_s)
    _override.append(emu)
    try:
        yield emu
    finally:
        _override.pop()


# The executor imports nothing of the tests: importing this module (conftest.py does, and
# every worker script the tests start) installs it as the copy engines' emulation provider.
transfer.EMULATION = current
