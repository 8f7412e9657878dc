"""The optimizer: fp32 masters, AdamW on the device for persistent chunks and on the
CPU (a worker thread) for offloaded ones, global-norm clipping and fp16 loss scaling.

[Note: optimizer placement]
A persistent chunk's fp32 master and Adam moments live on the device and are
stepped after backward with ``torch.optim.AdamW(fused=True)`` on the device. An
offloaded chunk's master and moments live in host memory; when its gradients
reach the host (``offload``), a single worker thread steps it with
``AdamW(fused=True)`` on CPU tensors while backward goes on, then writes the
updated weights into the chunk's home in the compute dtype. The next fetch of the
chunk waits for that step (``Chunk.pending``), so the next forward never reads a
half-updated home. For fp32 compute the master *is* the chunk (device) or its home
(host): no second copy.

AdamW's update is elementwise, so stepping a flat chunk gives bit-identical
results to stepping each parameter tensor on its own (checked for the fused,
foreach and for-loop CPU kernels, at odd offsets too): this is what lets the
parity tests compare with plain ``torch.optim.AdamW`` at zero tolerance.

[Note: when CPU steps can start]
Clipping by global norm and fp16 overflow checks need every gradient before any
parameter may change. The plan says which schedule it was costed for
(``schedule.cpu_adam``): ``after_backward`` submits offloaded chunks' steps after
backward (with the clip coefficient), losing the overlap; ``during_backward``
starts each chunk's step as soon as its gradients land on the host. Gradient
accumulation steps only after the last micro-batch.

[Note: gradient offload]
Offloading a chunk's gradients never blocks the host on the device. The main
thread (inside backward) queues the D2H copy into a pinned host buffer on the copy
stream, frees the device gradient buffer at once (the copy engine recorded it on
that stream), and hands the copy's handle to the CPU worker, which waits for the
copy, converts or accumulates into the fp32 accumulator, and, on the step's last
micro-batch, steps and writes the chunk's home, after the last upload that read
that home has completed. The worker touches the device only to wait on events.
The copy lands directly in the fp32 accumulator when nothing needs converting
(fp32 compute, first micro-batch); otherwise in the chunk's staging buffer, which
the next offload of the chunk reuses only after the worker has consumed it
(``Chunk.pending``, a host-side wait that in practice is long over).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.autograd.profiler import record_function

from .chunks import ChunkStore
from .transfer import delay


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW hyper-parameters, applied to every parameter alike (as one param group)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = None
    """Clip gradients to this global L2 norm (None: no clipping)."""
    loss_scale: float = 2.0**16
    """Initial dynamic loss scale for fp16 compute (ignored otherwise)."""
    scale_window: int = 1000
    """Steps without overflow before the fp16 loss scale doubles."""


class LossScaler:
    """Dynamic loss scaling for fp16: halve and skip the step on overflow, grow after a window."""

    def __init__(self, enabled: bool, init_scale: float, window: int):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.window = window
        self.good_steps = 0  # consecutive steps without overflow

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale /= 2.0
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps % self.window == 0:
                self.scale *= 2.0


class ChunkOptimizer:
    """Masters, moments and the update of every chunk. See [Note: optimizer placement]."""

    def __init__(self, store: ChunkStore, config: AdamWConfig):
        self.store = store
        self.config = config
        fp32 = store.dtype == torch.float32
        kw = dict(lr=config.lr, betas=config.betas, eps=config.eps,
                  weight_decay=config.weight_decay, fused=True)
        # One fp32 master per chunk: 1D (numel,), device for persistent chunks, host for
        # offloaded ones; the chunk's own tensor when the compute dtype is fp32.
        self.master: dict[int, torch.Tensor] = {}
        # Host fp32 gradient accumulators of offloaded chunks: 1D (shard_numel,), pinned host.
        self.cpu_grad: dict[int, torch.Tensor] = {}
        # Host staging for gradients that cannot land in the accumulator directly (16-bit
        # compute, later micro-batches): 1D (shard_numel,), pinned host, compute dtype.
        self.staging: dict[int, torch.Tensor] = {}
        self.adam: dict[int, torch.optim.AdamW] = {}
        for c in store.chunks:
            if c.persistent:
                # See [Note: masters from the user's fp32 values] in chunks.py.
                m = c.dev if fp32 else c.master_init
                if not fp32:
                    store.ledger.alloc("optim", c.numel * 4)
                store.ledger.alloc("optim", c.numel * 8)  # exp_avg and exp_avg_sq, fp32
            else:
                # Host-side states are this rank's shard only (executor/dist.py [Note: sharding]).
                n = c.home.numel()
                m = c.home if fp32 else c.master_init
                self.cpu_grad[c.id] = store.arena.take(n, torch.float32)
                host = n * (8 + 4)  # moments + gradient accumulator, fp32
                if not fp32:
                    host += n * 4  # master
                if store.staged:
                    self.staging[c.id] = store.arena.take(n, store.dtype)
                    host += n * store.element_bytes(store.dtype)
                store.ledger.host_alloc(host)
            c.master_init = None
            self.master[c.id] = m
            self.adam[c.id] = torch.optim.AdamW([m], **kw)
        # One worker: CPU steps run in submission order, overlapping the main thread.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="protrain-cpu-adam")

    # -- gradients

    def offload_grad(self, cid: int, first_micro_batch: bool, last_micro_batch: bool = True) -> None:
        """Queue an offloaded chunk's gradient for the host fp32 accumulator and free the
        device buffer (``submit_cpu_step`` queues the step behind it). See [Note: gradient offload].

        Under ZeRO-3 the gradient is first reduce-scattered: only this rank's shard,
        summed over ranks, goes down; after the step's last micro-batch it is divided by
        the world size (the global batch's mean gradient).
        """
        c = self.store.chunks[cid]
        acc = self.cpu_grad[cid]
        comm = self.store.comm
        src = c.dev_grad
        if comm.world > 1:
            src = torch.empty(acc.numel(), dtype=c.dev_grad.dtype, device=c.dev_grad.device)
            comm.reduce_scatter(src, c.dev_grad, f"gradients of chunk {cid}")
        direct = src.dtype == torch.float32 and first_micro_batch
        dst = acc if direct else self.staging[cid]
        if c.pending is not None:  # the worker may still read dst (or acc) from the last offload
            c.pending.result()
            c.pending = None
        with record_function("protrain::offload"):
            down = self.store.copies.download(dst, src)
        self.store.close_grad(cid)  # safe: the copy engine recorded src on the copy stream
        divide = comm.world if comm.world > 1 and last_micro_batch else 1

        def land() -> None:
            down.synchronize()  # a wait on the copy's event: the only device call here
            delay("before_grad_land")
            if not direct:
                if first_micro_batch:
                    acc.copy_(dst)
                else:
                    acc.add_(dst)
            if divide != 1:
                acc.div_(divide)

        c.pending = self.worker.submit(land)

    def grad_views(self) -> dict[int, torch.Tensor]:
        """id(parameter) → its gradient as the optimizer sees it (device or host accumulator)."""
        views = {}
        for c in self.store.chunks:
            flat = c.dev_grad if c.persistent else self.cpu_grad[c.id]
            for p, off, n in c.params:
                views[id(p)] = flat[off: off + n].view(p.shape)
        return views

    def global_norm(self, param_order: list[torch.nn.Parameter]) -> torch.Tensor:
        """L2 norm over all gradients, reduced exactly as ``clip_grad_norm_`` does.

        Per-parameter norms in the model's parameter order, then the norm of their
        stack: the same reduction order as plain PyTorch, so clipping is bit-exact
        on CPU fp32. Host accumulators' norms are moved to the device to be stacked.
        Under ZeRO-3 (no parameter is whole on one rank) it is the square root of the
        all-reduced sum of squares of the own shards plus the replicated persistent
        chunks' (counted once).
        """
        comm = self.store.comm
        if comm.world > 1:
            sq = torch.zeros((), dtype=torch.float32, device=self.store.device)
            for c in self.store.chunks:
                if not c.persistent:
                    sq += self.cpu_grad[c.id].double().square().sum().float().to(sq.device)
            comm.all_reduce(sq, "the gradient norm")
            for c in self.store.chunks:
                if c.persistent:
                    sq += c.dev_grad.double().square().sum().float()
            return sq.sqrt()
        views = self.grad_views()
        norms = [torch.linalg.vector_norm(views[id(p)], 2.0, dtype=torch.float32).to(self.store.device)
                 for p in param_order]
        return torch.linalg.vector_norm(torch.stack(norms), 2.0)

    # -- steps

    def _set_grad(self, cid: int, coef: torch.Tensor | float | None, inv_scale: float) -> None:
        """Point the chunk master's ``.grad`` at the fp32 gradient, unscaled and clipped."""
        c = self.store.chunks[cid]
        g = c.dev_grad if c.persistent else self.cpu_grad[cid]
        if g.dtype != torch.float32:
            g = g.float()  # a fresh fp32 copy; the compute-dtype buffer is zeroed next step
        if inv_scale != 1.0:
            g.mul_(inv_scale)
        if coef is not None:
            # as clip_grad_norm_: in place, per element, by the fp32 coefficient (a host
            # float on the worker: exactly the fp32 value, so the same products)
            g.mul_(coef)
        self.master[cid].grad = g

    def step_device(self, cid: int, coef: torch.Tensor | None = None, inv_scale: float = 1.0) -> None:
        """Update a persistent chunk on the device."""
        c = self.store.chunks[cid]
        with record_function("protrain::dev_adam"):
            self._set_grad(cid, coef, inv_scale)
            self.adam[cid].step()
            self.master[cid].grad = None
            if self.master[cid] is not c.dev:
                c.dev.copy_(self.master[cid])

    def submit_cpu_step(self, cid: int, coef: float | None = None, inv_scale: float = 1.0) -> None:
        """Queue an offloaded chunk's CPU step (after its gradients have landed: the worker
        runs in submission order); the chunk's next fetch waits for it."""
        c = self.store.chunks[cid]
        previous = c.pending
        reads_home = c.last_upload

        def run() -> None:
            if previous is not None:
                previous.result()  # re-raise the landing's error, if any
            self._cpu_step(cid, coef, inv_scale, reads_home)

        c.pending = self.worker.submit(run)

    def _cpu_step(self, cid: int, coef: float | None, inv_scale: float, reads_home=None) -> None:
        """On the worker: AdamW on the host master, then the new weights into home."""
        c = self.store.chunks[cid]
        if reads_home is not None:
            # The last upload from home must have read it before the step changes it (in
            # place, for fp32: home is the master). Only a prefetch can still be in flight.
            reads_home.synchronize()
        delay("before_cpu_adam")
        with record_function("protrain::cpu_adam"):
            self._set_grad(cid, coef, inv_scale)
            self.adam[cid].step()
            self.master[cid].grad = None
        delay("before_weights_return")
        if self.master[cid] is not c.home:
            c.home.copy_(self.master[cid])

    def wait_all(self) -> None:
        """Wait for every chunk's queued host work (re-raising the first error)."""
        for c in self.store.chunks:
            if c.pending is not None:
                c.pending.result()
                c.pending = None

    def shutdown(self) -> None:
        self.worker.shutdown(wait=True)


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_``'s coefficient: max_norm / (norm + 1e-6), clamped to at most 1."""
    coef = max_norm / (total_norm + 1e-6)
    return torch.clamp(coef, max=1.0)

