"""The optimizer: fp32 masters, AdamW on the device for persistent (and device-homed)
chunks and on the CPU (a worker thread) for offloaded ones, global-norm clipping and fp16
loss scaling.

[Note: optimizer placement]
A persistent chunk's fp32 master and Adam moments live on the device and are
stepped after backward with the fused AdamW kernel on the device (under ZeRO-3 with
``placement.shard_persistent_states``, this rank's shard of them: executor/dist.py
[Note: sharding]). A device-homed chunk's (this rank's shard) live on the device too and
step in backward as soon as its gradients are complete (``step_homed``; chunks.py
[Note: device homes]). Any other
offloaded chunk's master and moments live in host memory; when its gradients
reach the host (``offload``), a single worker thread steps it with the fused
AdamW kernel on CPU tensors while backward goes on, then writes the
updated weights into the chunk's home in the compute dtype. The next fetch of the
chunk waits for that step (``Chunk.pending``), so the next forward never reads a
half-updated home. For fp32 compute the master *is* the chunk (device) or its home
(host): no second copy.

Stepping must equal ``torch.optim.AdamW(model.parameters(), fused=True)``, which
calls ``torch._fused_adamw_`` on a *list* of tensors, one per parameter. The CPU
fused kernel is not position-independent: it runs each tensor in vectors of
``Vec::size()`` elements (8 or 16 fp32) and the last ``numel % Vec::size()``
elements in a scalar loop that rounds ``exp_avg_sq`` differently. So a flat
chunk stepped as one tensor differs from the per-parameter reference wherever a
parameter's tail is not a whole vector (a 36-wide bias), from step 2 on. We call
the same kernel with per-parameter views into the flat master, gradient, moments
and per-parameter step tensors (``_per_param``): each parameter is then one
tensor of the kernel's list, exactly as in the reference, while the storage stays
flat. The flat single-tensor call (``_flat``) is kept where it is provably the same
arithmetic: on CPU, when every parameter's numel and the chunk's are multiples of
``VEC_ALIGN`` (then no element of either call takes the scalar tail; the kernel's
thread split is in whole cache lines, so threading changes nothing), every
parameter has a gradient this step and all share one step count. On the device
we always take the per-parameter call, like the reference. Under ZeRO-3 a
parameter may straddle two shards (of an offloaded chunk, or of a persistent one
whose states are sharded); each rank steps its piece as one tensor, so a
straddling parameter is exact only when its first piece is a whole number of
vectors (a parameter that does not straddle always is).

[Note: which parameters step]
Plain AdamW skips a parameter whose ``.grad`` is None: no update, no decay, no
step count. Our ``.grad`` views always exist (``chunks.py`` [Note: gradients in
chunks]), so the schedule's post-accumulate-grad hooks record in
``Chunk.has_grad`` which parameters received a gradient in any micro-batch of
this step; only those step, each with its own step count (a MoE expert routed on
some steps only). Frozen parameters (``requires_grad=False``) never receive one,
so they never step and have no optimizer state in ``state_dict``. Under ZeRO-3 a
gradient is summed over ranks, so every trainable parameter counts as having one
(as with DDP without ``find_unused_parameters``).

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

[Note: gradients land in home]
With 16-bit compute and no gradient accumulation, an offloaded chunk's home is free
from its last use in backward until its CPU step: its values are the fp32 master
rounded (an invariant: wrap, every step and every in-place write keep it), and the
step writes them again. So the gradients land in the home itself, and the chunk has
no accumulator and no staging buffer: 14 host bytes per element (home 2, master 4,
moments 8) instead of 20, plus one fp32 ``scratch`` of ``STEP_PIECE`` elements for the
whole run: the step copies the home's gradients into it a piece at a time (one chunk
at a time: one worker), divided by the world size under ZeRO-3 as the accumulator
was, so the arithmetic is the accumulator's (``_adamw_pieces``). A homeless chunk
(chunks.py [Note: host slots]) is the same with a slot for the home: 12 B. A chunk
whose gradients did not land (never fetched in backward) steps on zeros under
ZeRO-3; one that landed but has nothing to step gets its home back from the master.
Its uploads were all waited on by compute before its last backward segment, so the
download, ordered after compute, never races one.

[Note: finite-state guard]
A NaN or infinite gradient must never reach a master or a moment that a checkpoint
could write. Without fp16 loss scaling (whose scaler skips such steps), every chunk's
gradient is checked before that chunk steps: after backward by the global norm the
step computes anyway (``after_backward`` plans: a finite norm proves every gradient
finite; only a non-finite one is looked at chunk by chunk, so finite gradients whose
squares overflow still step), nothing having stepped yet; with ``during_backward``
each offloaded chunk on the worker before its CPU step, each device-homed chunk before
its device step and the persistent chunks before theirs. The check is one sum per
gradient (``all_finite``: NaN and ±inf survive a sum), so it reads each gradient once
and changes no bit. The first failure is recorded in ``poisoned`` (chunk, step, and
whether other chunks may have stepped already: ``partial``); every later step of the
worker refuses too, and the engine refuses to step, save or export a partly updated
state (``Engine._refuse_poisoned``). Under ZeRO-3 the global norm is all-reduced, so
every rank stops at once; a check of a rank's own shard (``during_backward``) stops that
rank, and the others at their next collective (``--timeout``), before any of them saves.

Adam's state is checked where the gradient is (issue 39 item 7): finite gradients can still
make it non-finite (a gradient above ~1.8e19 has a square past fp32's range, so
``exp_avg_sq`` becomes inf and its parameters stop training; a huge rate overflows a master).
So every chunk that stepped has its master and moments checked right after its step, before
anything reads them: one fused reduction per chunk (``all_finite`` of the three tensors, one
read back), on the worker for a CPU step (an NVMe chunk's a piece at a time, before the piece
leaves memory), and for the device steps (persistent, device-homed) once per step over all of
them (``guard_device_states``: one read back). A failure poisons the optimizer as a
non-finite gradient does, naming the state (``poisoned``'s fourth field), with ``partial``
true: that chunk has stepped.

[Note: learning rate]
``hyper`` (the rate among them) is what the step being run uses. It changes only between
steps (``Engine.set_lr`` refuses while a step is in flight), but the worker runs past a
step's return: step k's CPU steps may still be queued when the caller sets step k+1's rate.
So the worker never reads ``hyper``: ``submit_cpu_step``, called on the main thread inside
step k, copies it into the queued closure, and the device steps (persistent, device-homed),
which run on the main thread inside step k, read it there. Every chunk of step k thus steps
with step k's rate, whatever the caller sets meanwhile.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.autograd.profiler import record_function

from protrain.plans.accounting import STEP_PIECE
from protrain.plans.homes import VEC_ALIGN

from .chunks import ChunkStore
from .nvme import copy_pieces


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

    def __init__(self, enabled: bool, config: AdamWConfig):
        self.enabled = enabled
        self.scale = config.loss_scale if enabled else 1.0
        self.window = config.scale_window
        self.good_steps = 0  # consecutive steps without overflow

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        self.good_steps = 0 if overflow else self.good_steps + 1
        # halve on overflow, double after a window
        if overflow or self.good_steps % self.window == 0:
            self.scale *= 0.5 if overflow else 2.0


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` (all on one device) is finite, reading each once:
    NaN and ±inf propagate through a sum, so finite sums prove it; only when a sum is not
    finite (also finite values whose sum overflows) are the elements themselves checked."""
    if not tensors:
        return True
    sums = torch.stack([t.sum().float() for t in tensors])  # (a 16-bit sum accumulates in fp32)
    if bool(torch.isfinite(sums).all()):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


class ChunkOptimizer:
    """Masters, moments and the update of every chunk. See [Note: optimizer placement]."""

    def __init__(self, store: ChunkStore, config: AdamWConfig):
        self.store = store
        fp32 = store.dtype == torch.float32
        self.hyper = dict(
            amsgrad=False,
            lr=config.lr,
            beta1=config.betas[0],
            beta2=config.betas[1],
            weight_decay=config.weight_decay,
            eps=config.eps,
            maximize=False,
        )
        # One fp32 master per chunk: 1D (numel,), device for persistent and device-homed
        # chunks (their shard), host for other offloaded ones; the chunk's own tensor (or
        # home) when the compute dtype is fp32, except for a device-homed chunk.
        self.master: dict[int, torch.Tensor] = store.masters
        # Adam moments, same shape and place as the master; zero until a parameter's first step.
        self.exp_avg: dict[int, torch.Tensor] = {}
        self.exp_avg_sq: dict[int, torch.Tensor] = {}
        # Per-parameter step counts (in Chunk.params order): 0-dim fp32 tensors beside the
        # master (what the kernel reads), and the same counts as ints (what we decide on,
        # without reading the device). A count of 0 means "no optimizer state yet".
        self.steps: dict[int, list[torch.Tensor]] = {}
        self.counts: dict[int, list[int]] = {}
        # Per-parameter (start, end) in master coordinates: its piece of this rank's shard
        # (None: no piece here). The views' bounds for _per_param.
        self.spans: dict[int, list[tuple[int, int] | None]] = {}
        # Chunks whose flat step may equal the per-parameter one (see the Note).
        self.flat_ok: set[int] = set()
        # Host fp32 gradient accumulators of offloaded chunks: 1D (shard_numel,), pinned host.
        self.cpu_grad: dict[int, torch.Tensor] = {}
        # Host staging for gradients that cannot land in the accumulator directly (16-bit
        # compute, later micro-batches): 1D (shard_numel,), pinned host, compute dtype.
        self.staging: dict[int, torch.Tensor] = {}
        # Chunks whose gradients landed this step in their home, or for homeless chunks in a
        # host slot (chunks.py [Note: host slots]), until their CPU step: the 16-bit buffer,
        # 1D (shard_numel,), pinned host. [Note: gradients land in home]
        self.landed: dict[int, torch.Tensor] = {}
        for c in store.chunks:
            if not c.trainable:  # chunks.py [Note: frozen chunks]: no master, moments, gradients
                m = c.dev if c.persistent else c.home
                self.exp_avg[c.id] = self.exp_avg_sq[c.id] = torch.zeros(0, device=m.device)
            elif c.persistent:
                # See [Note: masters from the user's fp32 values] in chunks.py. Sharded: this
                # rank's slice only (for fp32 a view of it in the chunk); dist.py [Note: sharding].
                if fp32:
                    m = c.dev[c.own]
                else:
                    m = c.master_init[c.own].clone() if c.sharded else c.master_init
            elif c.homed:  # chunks.py [Note: device homes]: the master alone, on the device
                m = c.master_init
            else:
                # Host-side states are this rank's shard only (executor/dist.py [Note: sharding]).
                n = c.own.stop - c.own.start
                m = c.home if fp32 else c.master_init
                # the master goes to the disk (nvme.py [Note: NVMe tier])
                if c.on_disk and not fp32:
                    m = store.disk.take(n)
                    copy_pieces(m, c.master_init, store.disk, drop_dst=True)
                if not store.grad_in_home:  # [Note: gradients land in home]
                    self.cpu_grad[c.id] = store.arena.take(n, torch.float32)
                if store.staged:
                    self.staging[c.id] = store.arena.take(n, store.dtype)
            lo = c.own.start  # where the master starts in the chunk
            c.master_init = None
            self.master[c.id] = m
            if c.trainable:
                disk = store.disk if c.on_disk else None  # (its moments: zeros, as the file starts)
                for moment in (self.exp_avg, self.exp_avg_sq):
                    moment[c.id] = (
                        disk.take(m.numel()) if disk else torch.zeros_like(m, dtype=torch.float32)
                    )
                # What the ledger counts is what was allocated (Ledger.check holds it to
                # accounting.py).
                own = [self.cpu_grad.get(c.id), self.staging.get(c.id)]
                if not disk:  # (an NVMe chunk's moments and master are in the file, not memory)
                    own += [self.exp_avg[c.id], self.exp_avg_sq[c.id]]
                    own.append(m if not fp32 or c.homed else None)  # (fp32: the chunk's own)
                nbytes = sum(x.numel() * x.element_size() for x in own if x is not None)
                store.ledger.alloc(
                    "optim", nbytes
                ) if c.persistent or c.homed else store.ledger.host_alloc(nbytes)
            self.steps[c.id] = [
                torch.zeros((), dtype=torch.float32, device=m.device) for _ in c.params
            ]
            self.counts[c.id] = [0] * len(c.params)
            hi = lo + m.numel()
            self.spans[c.id] = [
                (max(off, lo) - lo, min(off + n, hi) - lo) if off < hi and off + n > lo else None
                for _, off, n in c.params
            ]
            if (
                m.device.type == "cpu"
                and not c.sharded
                and not c.on_disk
                and m.numel() % VEC_ALIGN == 0
                and all(n % VEC_ALIGN == 0 for _, _, n in c.params)
            ):
                self.flat_ok.add(c.id)
        # The fp32 buffers that landed gradients are read through, a piece at a time: 1D
        # (min(shard_numel, STEP_PIECE),), or (0,) where no chunk needs one. ``scratch``: the CPU
        # step's, host (one chunk at a time: one worker); ``dev_scratch``: the device steps'
        # ([Note: device homes] in chunks.py).
        piece = (
            min(store.comm.shard_numel(store.chunks[0].numel), STEP_PIECE) if store.chunks else 0
        )
        host = any(not c.persistent and not c.homed and c.trainable for c in store.chunks)
        self.scratch = torch.empty(piece if host and store.grad_in_home else 0, dtype=torch.float32)
        self.dev_scratch = torch.empty(
            piece if any(c.homed and c.trainable for c in store.chunks) else 0,
            dtype=torch.float32,
            device=store.device,
        )
        store.ledger.host_alloc(self.scratch.numel() * 4)
        store.ledger.alloc("optim", self.dev_scratch.numel() * 4)
        # [Note: finite-state guard]: the first non-finite gradient (chunk, step, partial), the
        # engine's step number (set before each step, read when a step is queued) and the error
        # to raise (the engine's, naming the last finite checkpoint).
        # A fourth field names a state that became non-finite ("" for a gradient).
        self.poisoned: tuple[int, int, bool, str] | None = None
        self.step_no = 0
        # fp16: the loss scaler skips such steps. PROTRAIN_NO_FINITE_CHECK=1 (debug and
        # tools/bench/finite.py only, read once here) turns the guard off to measure its cost.
        self.guarded = store.dtype != torch.float16 and not os.environ.get(
            "PROTRAIN_NO_FINITE_CHECK"
        )
        self.guard_seconds = 0.0  # wall time inside the guard's checks (approximate across threads)
        self.nonfinite_error = lambda cid, step, partial, what="": AssertionError(
            f"non-finite {what or 'gradient'}, chunk {cid}"
        )
        # Chunks stepped on the device this step, whose states ``guard_device_states`` checks.
        self.device_stepped: list[int] = []
        # One worker: CPU steps run in submission order, overlapping the main thread.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="protrain-cpu-adam")

    def guard(self, cid: int, step: int, grads: list[torch.Tensor], partial: bool = True) -> None:
        """Raise before chunk ``cid`` steps when one of its ``grads`` is not finite, or when an
        earlier chunk's were ([Note: finite-state guard]). ``partial``: other chunks may have
        stepped already in this step."""
        if not self.guarded or self.poisoned is None and self._finite(grads):
            return
        self._poison(cid, step, partial, "")

    def _poison(self, cid: int, step: int, partial: bool, what: str) -> None:
        """Record the first failure (it stays the one named) and raise its error."""
        self.poisoned = self.poisoned or (cid, step, partial, what)
        raise self.nonfinite_error(*self.poisoned)

    def states(self, cid: int, a: int = 0, b: int | None = None) -> dict[str, torch.Tensor]:
        """The chunk's master and moments (elements ``a:b``), by the names the error uses."""
        return {
            "master": self.master[cid][a:b],
            "exp_avg": self.exp_avg[cid][a:b],
            "exp_avg_sq": self.exp_avg_sq[cid][a:b],
        }

    def nonfinite_state(self, states: dict[str, torch.Tensor]) -> str:
        """The name of the first of ``states`` that is not all finite, "" when all are: one
        fused reduction (``all_finite``: a sum each, one read back), the elements only then."""
        t0 = time.perf_counter()
        try:
            if all_finite(list(states.values())):
                return ""
            return next(k for k, t in states.items() if not bool(torch.isfinite(t).all()))
        finally:
            self.guard_seconds += time.perf_counter() - t0

    def guard_state(self, cid: int, step: int, what: str | None = None) -> None:
        """Raise when chunk ``cid``'s master or a moment is not finite after its step (``what``:
        already known, from its pieces). See [Note: finite-state guard]."""
        if not self.guarded:
            return
        what = self.nonfinite_state(self.states(cid)) if what is None else what
        if what:
            self._poison(cid, step, True, what)

    def guard_device_states(self) -> None:
        """After the device steps of a step: the states of every chunk stepped on the device
        (persistent, device-homed), checked together (one read back), then one by one to name
        the first that is not finite."""
        cids, self.device_stepped = self.device_stepped, []
        if not self.guarded or not cids:
            return
        if self.nonfinite_state({f"{i}.{k}": t for i in cids for k, t in self.states(i).items()}):
            for cid in cids:
                self.guard_state(cid, self.step_no)

    def guard_persistent(self) -> None:
        """Before the persistent chunks step (``during_backward``): their gradients, checked
        together (one read back), then one by one to name the first that is not finite."""
        if not self.guarded:
            return
        grads = {
            c.id: self.step_grads(c.id) for c in self.store.chunks if c.persistent and c.trainable
        }
        if not self._finite([g for views in grads.values() for g in views]):
            for cid, views in grads.items():
                self.guard(cid, self.step_no, views)

    def _finite(self, grads: list[torch.Tensor]) -> bool:
        """``all_finite(grads)``, its wall time counted in ``guard_seconds``."""
        t0 = time.perf_counter()
        finite = all_finite(grads)
        self.guard_seconds += time.perf_counter() - t0
        return finite

    def step_grads(self, cid: int) -> list[torch.Tensor]:
        """What the chunk's step now reads of its gradients (``read_by_step`` of ``grad``)."""
        return self.read_by_step(cid, self.stepping(cid), self.grad(cid))

    def read_by_step(
        self, cid: int, which: list[int], g: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """The elements of the chunk's gradient ``g`` (master coordinates) that stepping the
        parameters ``which`` reads, adjacent spans merged: what the guard checks (a host slot's
        tail past the chunk, or padding, holds no gradient)."""
        merged: list[list[int]] = []
        for a, b in (
            self.spans[cid][i] for i in which if g is not None and self.spans[cid][i] is not None
        ):
            if merged and merged[-1][1] == a:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        return [g[a:b] for a, b in merged]

    def stepping(self, cid: int) -> list[int]:
        """Indices (in Chunk.params) of the chunk's parameters that step now. See [Note: which
        parameters step]."""
        c = self.store.chunks[cid]
        if self.store.comm.world > 1:
            return [i for i, (p, _, _) in enumerate(c.params) if p.requires_grad]
        return sorted(c.has_grad)

    # -- gradients

    def offload_grad(
        self, cid: int, first_micro_batch: bool, last_micro_batch: bool = True
    ) -> None:
        """Queue an offloaded chunk's gradient for the host fp32 accumulator and free the
        device buffer (``submit_cpu_step`` queues the step behind it). See [Note: gradient offload].

        Under ZeRO-3 the gradient is first reduce-scattered: only this rank's shard,
        summed over ranks, goes down; after the step's last micro-batch it is divided by
        the world size (the global batch's mean gradient).
        """
        c = self.store.chunks[cid]
        if not c.trainable:
            return  # no gradient buffer, nothing to step (chunks.py [Note: frozen chunks])
        home = self.store.grad_in_home
        acc = c.home if home else self.cpu_grad[cid]
        self.landed.pop(cid, None)
        if not c.grad_live:
            # Never fetched in this backward (every parameter unused or frozen): no gradient
            # buffer, so no copy. The accumulator must read zero for the micro-batches after.
            if first_micro_batch and not home:
                previous = c.pending
                c.pending = self.worker.submit(
                    lambda: (previous and previous.result(), acc.zero_())
                )
            return
        if acc is None:  # homeless: the gradients land in a slot (chunks.py [Note: host slots])
            acc = self.store.take_slot()
        src = self.store.own_grad(cid)
        direct = home or (src.dtype == torch.float32 and first_micro_batch)
        dst = acc if direct else self.staging[cid]
        c.settle()  # the worker may still read dst (or acc) from the last offload
        # (a slot: one shard; the copy engine names it "protrain::offload" for the profiler)
        down = self.store.copies.download(dst[: src.numel()], src)
        self.store.close_grad(cid)  # safe: the copy engine recorded src on the copy stream
        # (1: nothing to divide)
        divide = self.store.comm.world if last_micro_batch and not home else 1
        if home:
            self.landed[cid] = acc

        def land() -> None:
            down.synchronize()  # a wait on the copy's event: the only device call here
            self.store.copies.events.emit("land", "mark", chunk=cid)  # events.py; worker thread
            if not direct:
                acc.copy_(dst) if first_micro_batch else acc.add_(dst)
            if divide != 1:
                acc.div_(divide)

        c.pending = self.worker.submit(land)

    def global_norm(self, param_order: list[torch.nn.Parameter]) -> torch.Tensor:
        """L2 norm over all gradients, reduced exactly as ``clip_grad_norm_`` does.

        Per-parameter norms in the model's parameter order, then the norm of their
        stack: the same reduction order as plain PyTorch, so clipping is bit-exact
        on CPU fp32. Host accumulators' norms are moved to the device to be stacked.
        Under ZeRO-3 (no parameter is whole on one rank) it is the square root of the
        all-reduced sum of squares of the own shards (offloaded chunks, and persistent
        ones whose states are sharded: their reduce-scattered slices) plus the
        replicated persistent chunks' (counted once).
        """
        comm = self.store.comm
        if comm.world > 1:
            sq = torch.zeros((), dtype=torch.float32, device=self.store.device)
            for c in self.store.chunks:
                if c.sharded and c.trainable:  # (a persistent chunk's own slice: c.own is c.shard)
                    sq += self.grad(c.id).double().square().sum().float().to(sq.device)
            comm.all_reduce(sq, "the gradient norm")
            for c in self.store.chunks:
                if c.persistent and c.trainable and not c.sharded:
                    sq += c.dev_grad.double().square().sum().float()
            return sq.sqrt()
        # id(parameter) → its gradient as the optimizer sees it, if it received one this step
        views = {}
        for c in self.store.chunks:
            # (device-homed: stepped at its offload, its gradients gone)
            if c.trainable and not c.homed:
                # 16-bit: where the gradients landed (home or slot), as grad() and the CPU step read
                # them
                flat = (
                    c.dev_grad
                    if c.persistent
                    else self.landed.get(c.id)
                    if self.store.grad_in_home
                    else self.cpu_grad[c.id]
                )
                for i in self.stepping(c.id):
                    p, off, n = c.params[i]
                    views[id(p)] = flat[off : off + n].view(p.shape)
        # as clip_grad_norm_, parameters without a gradient are skipped
        norms = [
            torch.linalg.vector_norm(views[id(p)], 2.0, dtype=torch.float32).to(self.store.device)
            for p in param_order
            if id(p) in views
        ]
        if not norms:
            return torch.zeros((), device=self.store.device)
        return torch.linalg.vector_norm(torch.stack(norms), 2.0)

    # -- steps

    def _grad(self, cid: int, coef: torch.Tensor | float | None, inv_scale: float) -> torch.Tensor:
        """The chunk's fp32 gradient, unscaled and clipped (1D, beside the master)."""
        # (16-bit: a fresh fp32 copy, the compute-dtype buffer is zeroed next step; fp32: itself)
        return _unscale(self.grad(cid).float(), inv_scale, coef)

    def grad(self, cid: int) -> torch.Tensor:
        """This rank's gradient of the chunk, in master coordinates: a persistent chunk's device
        buffer (``own``: its slice when the states are sharded); an offloaded chunk's host fp32
        accumulator, or for 16-bit gradients that landed (home or slot) a fresh fp32 copy,
        divided by the world size (zeros when none landed). For the ZeRO-3 norm and the guard;
        the CPU step reads landed gradients in pieces (``_adamw_pieces``)."""
        c = self.store.chunks[cid]
        if c.persistent:
            return c.dev_grad[c.own]
        if not self.store.grad_in_home:
            return self.cpu_grad[cid]
        g = (
            self.landed[cid].float()
            if cid in self.landed
            else torch.zeros(self.master[cid].numel())
        )
        return g.div_(self.store.comm.world) if self.store.comm.world > 1 else g

    def _adamw(self, cid: int, which: list[int], g: torch.Tensor, hyper: dict) -> None:
        """``torch._fused_adamw_`` on the parameters ``which`` of the chunk, as
        ``AdamW(fused=True)`` steps them, with ``hyper`` (the step's: [Note: learning rate]).
        See [Note: optimizer placement]."""
        counts, steps = self.counts[cid], self.steps[cid]
        m, ea, es = self.states(cid).values()
        if (
            cid in self.flat_ok
            and len(which) == len(counts)
            and all(k == counts[0] for k in counts)
        ):
            # _flat: one tensor; every parameter's elements take the vector path, as in the
            # per-parameter call. The kernel reads one step count: the chunk's common one.
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_([m], [g], [ea], [es], [], [steps[0]], **hyper)
        else:  # _per_param: one view per parameter, as the reference's tensor list
            # A parameter without a piece on this rank counts its step all the same, so that
            # every rank's counts (state_dict's "step") are the parameter's.
            spans = [(i, self.spans[cid][i]) for i in which if self.spans[cid][i] is not None]
            if spans:
                st = [steps[i] for i, _ in spans]
                torch._foreach_add_(st, 1)
                torch._fused_adamw_(
                    *([t[a:b] for _, (a, b) in spans] for t in (m, g, ea, es)), [], st, **hyper
                )
        for i in which:
            counts[i] += 1

    def _adamw_pieces(
        self,
        cid: int,
        which: list[int],
        grads: torch.Tensor | None,
        coef: float | None,
        inv_scale: float,
        hyper: dict,
        ready: bool = False,
    ) -> str:
        """``_adamw`` on 16-bit gradients that landed in the home or a slot (``grads``; None:
        zeros): they reach the fp32 ``scratch`` one piece at a time, then as ``_grad`` (divided
        by the world size, unscaled, clipped; per element). ``ready``: ``grads`` is ``_grad``'s
        fp32 gradient already, read in place. A piece starts a multiple of ``STEP_PIECE`` (of
        ``VEC_ALIGN``) elements into its parameter, so the kernel takes its vector path on the
        same elements as in one call per parameter ([Note: optimizer placement]): the same
        arithmetic, bit for bit, with no shard-sized fp32 copy. An NVMe chunk's pieces of
        master and moments leave host memory after each piece (nvme.py [Note: NVMe tier]),
        checked first when guarded ([Note: finite-state guard]): returns the name of a state
        found non-finite there ("" when none, or not an NVMe chunk)."""
        m, ea, es = self.states(cid).values()
        steps = self.steps[cid]
        scratch = self.dev_scratch if self.store.chunks[cid].homed else self.scratch
        disk = self.store.disk if self.store.chunks[cid].on_disk else None
        spans = [(i, self.spans[cid][i]) for i in which if self.spans[cid][i] is not None]
        if spans:  # (none under ZeRO-3 on a rank whose shard of the chunk is padding only)
            torch._foreach_add_([steps[i] for i, _ in spans], 1)
        bad = ""
        for i, (lo, hi) in spans:
            for a in range(lo, hi, STEP_PIECE):
                b = min(a + STEP_PIECE, hi)
                if ready:
                    g = grads[a:b]
                else:
                    g = scratch[: b - a]
                    g.copy_(grads[a:b]) if grads is not None else g.zero_()
                    if self.store.comm.world > 1:
                        g.div_(self.store.comm.world)
                    _unscale(g, inv_scale, coef)
                torch._fused_adamw_([m[a:b]], [g], [ea[a:b]], [es[a:b]], [], [steps[i]], **hyper)
                if disk is not None:
                    if self.guarded and not bad:
                        bad = self.nonfinite_state(self.states(cid, a, b))
                    disk.drop(m[a:b], ea[a:b], es[a:b])
        for i in which:
            self.counts[cid][i] += 1
        return bad

    def step_device(
        self, cid: int, coef: torch.Tensor | None = None, inv_scale: float = 1.0
    ) -> None:
        """Update a persistent chunk on the device: the whole chunk, or with sharded states
        this rank's shard, then every rank's updated shard into every rank's chunk."""
        c = self.store.chunks[cid]
        self.store.write_back(cid)  # a forward's in-place writes reach the master first
        which = self.stepping(cid)
        if not which:
            return
        with record_function("protrain::dev_adam"):
            self._adamw(cid, which, self._grad(cid, coef, inv_scale), self.hyper)
            own = c.dev[c.own]
            if self.master[cid].data_ptr() != own.data_ptr():  # fp32: the master is the chunk
                own.copy_(self.master[cid])
        if self.guarded:
            self.device_stepped.append(cid)  # its states checked after the device steps
        if c.sharded:
            self.store.comm.all_gather(c.dev, f"chunk {cid}")

    def step_homed(self, cid: int) -> None:
        """Step a device-homed chunk whose gradients are complete (its offload in backward):
        reduce-scatter them into this rank's shard (ZeRO-3), step its master on the device
        through the device scratch, free the gradient buffer. Arithmetic of ``_adamw_pieces``,
        as a homeless chunk's CPU step. See chunks.py [Note: device homes]."""
        c = self.store.chunks[cid]
        which = self.stepping(cid)  # complete: the chunk is offloaded
        grads = self.store.own_grad(cid) if c.grad_live else None
        # No wait for an upload reading the master: compute waited for each of this chunk's
        # uploads before its segments ran (``ChunkStore.wait``), and this runs on compute after
        # them.
        if which:
            self.guard(cid, self.step_no, self.read_by_step(cid, which, grads))
        self.store.copies.events.emit("device_step", "begin", chunk=cid)
        with record_function("protrain::dev_adam"):
            if which:
                self._adamw_pieces(cid, which, grads, None, 1.0, self.hyper)
                if self.guarded:
                    self.device_stepped.append(cid)  # its states checked after the device steps
        self.store.copies.events.emit("device_step", "end", chunk=cid)
        if c.grad_live:
            self.store.close_grad(cid)

    def submit_cpu_step(
        self, cid: int, coef: float | None = None, inv_scale: float = 1.0, checked: bool = False
    ) -> None:
        """Queue an offloaded chunk's CPU step (after its gradients have landed: the worker
        runs in submission order); the chunk's next fetch waits for it. ``checked``: its
        gradients are known finite ([Note: finite-state guard])."""
        c = self.store.chunks[cid]
        previous, reads_home = c.pending, c.last_upload
        which = self.stepping(cid)  # now, on this thread: complete once the chunk is offloaded
        grads = self.landed.pop(cid, None)
        step = None if checked else self.step_no  # None: the global norm proved them finite
        step_no = self.step_no
        hyper = dict(self.hyper)  # this step's rate, read now: [Note: learning rate]

        def run() -> None:
            if previous is not None:
                previous.result()  # re-raise the landing's error, if any
            self._cpu_step(cid, which, coef, inv_scale, hyper, reads_home, grads, step, step_no)

        c.pending = self.worker.submit(run)
        if c.home is None and grads is not None:  # the slot is free once this step has read it
            self.store.slots.append((grads, c.pending.result))

    def _cpu_step(
        self,
        cid: int,
        which: list[int],
        coef: float | None,
        inv_scale: float,
        hyper: dict,
        reads_home=None,
        grads: torch.Tensor | None = None,
        step: int | None = None,
        step_no: int = 0,
    ) -> None:
        """On the worker: AdamW on the host master, then the new weights into home (if any).
        ``grads``: where 16-bit gradients landed (home or slot; None: none did). ``step``: the
        engine's step it belongs to, whose gradients are checked first ([Note: finite-state guard]);
        None: known finite. ``step_no``: that step, whose updated states are checked after."""
        c = self.store.chunks[cid]
        disk = self.store.disk if c.on_disk else None
        if which and step is not None:
            g = grads if self.store.grad_in_home else self.cpu_grad.get(cid)
            self.guard(cid, step, self.read_by_step(cid, which, g))
        if not which:
            # gradients overwrote it: the values come back
            if grads is not None and grads is c.home:
                self._refresh_home(cid)
            return
        if reads_home is not None:
            # The last upload from home must have read it before the step changes it (in
            # place, for fp32: home is the master). Only a prefetch can still be in flight.
            reads_home.synchronize()
        self.store.copies.events.emit("cpu_step", "begin", chunk=cid)  # worker thread
        with record_function("protrain::cpu_adam"):
            if disk is not None:
                disk.prefetch(self.master[cid], self.exp_avg[cid], self.exp_avg_sq[cid])
            if self.store.grad_in_home:
                bad = self._adamw_pieces(cid, which, grads, coef, inv_scale, hyper)
            elif disk is not None:  # (the fp32 gradient is in host memory: read in place)
                bad = self._adamw_pieces(
                    cid, which, self._grad(cid, coef, inv_scale), None, 1.0, hyper, ready=True
                )
            else:
                self._adamw(cid, which, self._grad(cid, coef, inv_scale), hyper)
                bad = None
        self.store.copies.events.emit("cpu_step", "end", chunk=cid)
        # before the home is refreshed: a non-finite master never reaches the next forward
        self.guard_state(cid, step_no, bad if disk is not None else None)
        if c.home is not None and self.master[cid] is not c.home:
            self._refresh_home(cid)

    def _refresh_home(self, cid: int) -> None:
        """The chunk's home from its master (an NVMe master a piece at a time)."""
        home, master = self.store.chunks[cid].home, self.master[cid]
        if self.store.chunks[cid].on_disk:
            copy_pieces(home, master, self.store.disk)
        else:
            home.copy_(master)

    def discard_home_grads(self) -> None:
        """A skipped step (fp16 overflow): the homes that hold gradients get their weights back
        from the master, so the next fetch uploads the unchanged model. Call after ``wait_all``."""
        for cid in sorted(self.landed):  # fp16: no chunk is homeless (validation.py)
            self._refresh_home(cid)
        self.landed.clear()

    def wait_all(self) -> None:
        """Wait for every chunk's queued host work (re-raising the first error)."""
        for c in self.store.chunks:
            c.settle()

    def shutdown(self) -> None:
        self.worker.shutdown(wait=True)


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_``'s coefficient: max_norm / (norm + 1e-6), clamped to at most 1."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def _unscale(g: torch.Tensor, inv_scale: float, coef: torch.Tensor | float | None) -> torch.Tensor:
    """``g`` unscaled (fp16 loss scaling) and clipped, in place. As ``clip_grad_norm_``: per
    element, by the fp32 coefficient (a host float on the worker: exactly the fp32 value, so
    the same products)."""
    if inv_scale != 1.0:
        g.mul_(inv_scale)
    if coef is not None:
        g.mul_(coef)
    return g
