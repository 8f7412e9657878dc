"""The optimizer: fp32 masters, AdamW on the device for persistent chunks and on the
CPU (a worker thread) for offloaded ones, global-norm clipping and fp16 loss scaling.

[Note: optimizer placement]
A persistent chunk's fp32 master and Adam moments live on the device and are
stepped after backward with ``torch.optim.AdamW(fused=True)`` on the device. An
offloaded chunk's master and moments live in host memory; when its gradients
reach the host (``offload``), a single worker thread steps it with
``AdamW(fused=True)`` on CPU tensors while backward goes on, then writes the
updated weights into the chunk's home in the compute dtype. The next fetch of the
chunk waits for that step (``Chunk.update``), so the next forward never reads a
half-updated home. For fp32 compute the master *is* the chunk (device) or its home
(host): no second copy.

AdamW's update is elementwise, so stepping a flat chunk gives bit-identical
results to stepping each parameter tensor on its own (checked for the fused,
foreach and for-loop CPU kernels, at odd offsets too): this is what lets the
parity tests compare with plain ``torch.optim.AdamW`` at zero tolerance.

[Note: when CPU steps can start]
Clipping by global norm and fp16 overflow checks need every gradient before any
parameter may change. With either one on, offloaded chunks' steps are submitted
after backward (with the clip coefficient), losing the overlap; without them,
each chunk's step starts as soon as its gradients land on the host. Gradient
accumulation steps only after the last micro-batch.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
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
        # Host fp32 gradient accumulators of offloaded chunks: 1D (numel,), host.
        self.cpu_grad: dict[int, torch.Tensor] = {}
        # Host staging for non-fp32 gradients coming down: 1D (numel,), pinned host.
        self.staging: dict[int, torch.Tensor] = {}
        self.adam: dict[int, torch.optim.AdamW] = {}
        for c in store.chunks:
            if c.persistent:
                m = c.dev if fp32 else c.dev.detach().float()
                if not fp32:
                    store.ledger.alloc("optim", c.numel * 4)
                store.ledger.alloc("optim", c.numel * 8)  # exp_avg and exp_avg_sq, fp32
            else:
                # Host-side states are this rank's shard only (executor/dist.py [Note: sharding]).
                n = c.home.numel()
                m = c.home if fp32 else c.home.float()
                self.cpu_grad[c.id] = torch.zeros(n, dtype=torch.float32)
                host = n * (8 + 4)  # moments + gradient accumulator, fp32
                if not fp32:
                    self.staging[c.id] = store.arena.take(n, store.dtype)
                    host += n * 4 + n * store.element_bytes(store.dtype)  # master + staging
                store.ledger.host_alloc(host)
            self.master[c.id] = m
            self.adam[c.id] = torch.optim.AdamW([m], **kw)
        # One worker: CPU steps run in submission order, overlapping the main thread.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="protrain-cpu-adam")
        self.accumulated = 0  # micro-batches accumulated into cpu_grad since the last step

    # -- gradients

    def offload_grad(self, cid: int, first_micro_batch: bool, last_micro_batch: bool = True) -> None:
        """Bring an offloaded chunk's gradient to the host fp32 accumulator; free the device buffer.

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
        with record_function("protrain::offload"):
            if src.dtype == torch.float32 and first_micro_batch:
                self.store.copies.download(acc, src).synchronize()
            else:
                stage = self.staging.get(cid)
                if stage is None:  # fp32 compute, later micro-batch: a plain host buffer
                    stage = self.staging[cid] = torch.empty_like(acc)
                    self.store.ledger.host_alloc(stage.numel() * stage.element_size())
                self.store.copies.download(stage, src).synchronize()
                if first_micro_batch:
                    acc.copy_(stage)
                else:
                    acc.add_(stage)
        if comm.world > 1 and last_micro_batch:
            acc.div_(comm.world)
        self.store.close_grad(cid)

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

    def _set_grad(self, cid: int, coef: torch.Tensor | None, inv_scale: float) -> None:
        """Point the chunk master's ``.grad`` at the fp32 gradient, unscaled and clipped."""
        c = self.store.chunks[cid]
        g = c.dev_grad if c.persistent else self.cpu_grad[cid]
        if g.dtype != torch.float32:
            g = g.float()  # a fresh fp32 copy; the compute-dtype buffer is zeroed next step
        if inv_scale != 1.0:
            g.mul_(inv_scale)
        if coef is not None:
            g.mul_(coef.to(g.device))  # as clip_grad_norm_: in place, per element
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

    def submit_cpu_step(self, cid: int, coef: torch.Tensor | None = None,
                        inv_scale: float = 1.0) -> None:
        """Queue an offloaded chunk's CPU step; the chunk's next fetch waits for it."""
        c = self.store.chunks[cid]
        assert c.update is None, f"{cid=}: a CPU step is already pending"
        fut: Future = self.worker.submit(self._cpu_step, cid, coef, inv_scale)
        c.update = fut

    def _cpu_step(self, cid: int, coef: torch.Tensor | None, inv_scale: float) -> None:
        c = self.store.chunks[cid]
        delay("before_cpu_adam")
        with record_function("protrain::cpu_adam"):
            self._set_grad(cid, None if coef is None else coef.cpu(), inv_scale)
            self.adam[cid].step()
            self.master[cid].grad = None
        delay("before_weights_return")
        if self.master[cid] is not c.home:
            c.home.copy_(self.master[cid])

    def wait_all(self) -> None:
        for c in self.store.chunks:
            if c.update is not None:
                c.update.result()
                c.update = None

    def shutdown(self) -> None:
        self.worker.shutdown(wait=True)


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_``'s coefficient: max_norm / (norm + 1e-6), clamped to at most 1."""
    coef = max_norm / (total_norm + 1e-6)
    return torch.clamp(coef, max=1.0)


def is_finite(total_norm: torch.Tensor) -> bool:
    return math.isfinite(total_norm.item())
