"""ChunkStore: the model's parameters and gradients as flat chunks, resident or not.

Each chunk of the plan becomes one flat device tensor in the compute dtype; every
parameter's ``.data`` is a view into it at the plan's offset, and every
parameter's ``.grad`` is a view into a chunk-shaped gradient buffer. A persistent
chunk's buffers are allocated once. An offloaded chunk keeps its *home* copy in
host memory (pinned on CUDA) and occupies device memory only between a fetch and a
release.

[Note: chunk storage resize]
Releasing a chunk frees its device memory with ``untyped_storage().resize_(0)``
and fetching re-materialises it with ``resize_(nbytes)`` plus a copy from home.
The tensor objects, and every view of them, survive: a parameter, an autograd
node that saved the parameter, and ``param.grad`` all keep pointing at the same
StorageImpl, whose data pointer is simply swapped. So autograd's saved views stay
valid across a release/fetch cycle and no module is ever re-pointed. Touching a
released chunk's parameter is an error (zero-byte storage), which is why the
schedule must fetch every chunk a segment uses (``validation.simulate_residency``).

[Note: gradients in chunks]
``param.grad`` is pre-set to a view of the chunk's gradient buffer. With grad mode
off during backward, ``AccumulateGrad`` adds into an existing ``.grad`` in place,
so gradients land in the chunk with no copy. We zero the buffers and never set
``.grad`` to ``None``. A tied parameter is one Parameter object under two names,
so it has one slot and one gradient. A frozen parameter's ``.grad`` stays None.

[Note: frozen chunks]
A chunk whose parameters are all frozen (``requires_grad=False``) never steps, so
it gets no gradient buffer (device or host), no Adam moments and no fp32 master:
its values live only in the compute-dtype chunk (persistent) or home (offloaded),
and ``state_dict`` reports them from there (under 16-bit compute, the rounded
values). A frozen parameter that shares a chunk with trainable ones still has
the chunk's buffers under it (they are flat); it just never steps.

[Note: device homes]
A *device-homed* chunk (``placement.device_homed``) is offloaded in the schedule: it
is fetched into a buffer for its segments and released after, and its gradients are
complete at its offload. But it keeps nothing on the host: this rank's shard of its
fp32 master and Adam moments (12 B per element) stays on the device. A fetch rounds
the master into the chunk's buffer (a device copy on the copy stream, which first waits
for compute, then the ZeRO-3 all-gather), and at its offload, inside backward, the
gradients are reduce-scattered into a shard and the chunk steps on the device at once
(optim.py ``step_homed``: on the compute stream, from autograd's thread on CUDA), after
its forward's in-place writes reached the master. So the next fetch reads the updated
master. Per card that is 12/W B per parameter of state beside the shared buffers,
against a persistent chunk's whole values and gradients (2 + 2 B in bf16) plus 12/W:
ZeRO-3 on the device, which is why the planner reaches for it when the host runs out.
A frozen device-homed chunk (no master, no moments) keeps its values' shard on the
device in the compute dtype (its ``home``), and the fetch copies from there.
"""

from __future__ import annotations

import collections
import enum
import os
from concurrent.futures import Future

import torch
from torch import nn
from torch.autograd.profiler import record_function

from protrain.plans import homes as H
from protrain.plans.accounting import STEP_PIECE, chunk_homes, host_numel, setup
from protrain.plans.errors import ConfigError
from protrain.plans.plan import Plan

from .memory import Ledger
from .nvme import DiskStates, copy_pieces
from .transfer import CopyEngine, CopyHandle, HostArena

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pool_slots(plan: Plan) -> int:
    """Chunk-sized device buffers the plan holds at most at once: each persistent chunk's
    values and gradients, ``n_buffer`` offloaded chunks' values, and the offloaded
    gradient buffers open at once in backward (from a chunk's backward fetch to its
    offload). What the chunk pool is sized for."""
    open_grads, most = set(), 0
    for step in plan.schedule.backward:
        open_grads |= set(step.fetch)
        most = max(most, len(open_grads))
        open_grads -= set(step.offload)
    return 2 * len(plan.placement.persistent) + plan.placement.n_buffer + most


class Residency(enum.Enum):
    """Where an offloaded chunk's parameters are (persistent chunks are always RESIDENT)."""

    RELEASED = "released"
    """Device storage is zero bytes; the values live in ``home``."""
    RESIDENT = "resident"
    """Device storage holds the values (or an upload into it is in flight: see ``Chunk.upload``)."""


class Chunk:
    """One chunk's tensors and state. Sizes are in elements of the compute dtype.

    With world size W the buffers hold ``numel = W * shard_numel`` elements (the
    plan's ``chunk_numel`` padded up); see executor/dist.py [Note: sharding].
    """

    def __init__(
        self,
        cid: int,
        numel: int,
        shard_numel: int,
        rank: int,
        where: H.Home,
        trainable: bool,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.id = cid
        # The chunk's home (plans/homes.py): where its values, gradients and optimizer
        # states live between uses. Fixed for the run, as is ``trainable``; the three flags
        # below are read from them once.
        self.where = where
        # Some parameter requires grad. A chunk of frozen parameters only has no gradient
        # buffer, no optimizer state and no fp32 master (see [Note: frozen chunks]).
        self.trainable = trainable
        # Always on the device, stepped there (never fetched or released).
        self.persistent = not where.offloaded
        # Offloaded, with its master and moments on the device ([Note: device homes]).
        self.homed = where.offloaded and where.steps_on == "device"
        # Trainable, with its master and moments (fp32: and home) in the NVMe file (nvme.py).
        self.on_disk = where.on_disk and trainable
        self.numel = numel
        self.shard = slice(rank * shard_numel, (rank + 1) * shard_numel)  # this rank's slice
        # The elements whose master and moments (and home, if offloaded) this rank keeps: the
        # whole chunk, or its shard (sharded), or at one rank an offloaded chunk up to its last
        # parameter (accounting.host_numel: its padding has no host state). Set by _lay_out.
        self.own = slice(0, numel)
        self.nbytes = numel * dtype.itemsize
        # Parameters' values; params' .data are views. 1D (numel,), device, compute dtype.
        self.dev = torch.zeros(numel, dtype=dtype, device=device)
        # Gradients; params' .grad are views. 1D (numel,), device, compute dtype.
        self.dev_grad = torch.zeros(numel, dtype=dtype, device=device)
        # Offloaded chunks only, unless homeless ([Note: host slots]) or device-homed ([Note:
        # device homes]; a frozen one's is on the device): this rank's shard of the values
        # between fetches. 1D (shard_numel,), host (pinned on CUDA), compute dtype.
        self.home: torch.Tensor | None = None
        # 16-bit compute only (and device-homed chunks), between wrap and the optimizer's
        # construction: the fp32 values of the user's parameters (the masters start from
        # these, not from the rounded chunk). 1D: (numel,) device for persistent chunks,
        # (shard_numel,) host for offloaded ones, device for device-homed ones.
        # See [Note: masters from the user's fp32 values].
        self.master_init: torch.Tensor | None = None
        # Residency and the gradient buffer's storage change only through the transitions
        # below, each of which asserts the state it starts from (FSDP2's _assert_in_states).
        self.residency = Residency.RESIDENT
        self.grad_live = True  # gradient buffer has device storage
        # This rank keeps only its shard of the chunk's master and moments (offloaded chunks
        # under ZeRO-3; trainable persistent ones when the plan shards their states). See
        # executor/dist.py [Note: sharding]; set by ChunkStore._lay_out.
        self.sharded = False
        # The upload issued by the last fetch/prefetch, until compute has waited on it.
        self.upload: CopyHandle | None = None
        # The last upload that read ``home``: the CPU step waits for it before writing home.
        self.last_upload: CopyHandle | None = None
        # Host work on this chunk's buffers queued on the CPU worker (gradient accumulation,
        # the AdamW step, writing home); the next fetch or offload of the chunk waits for it.
        self.pending: Future | None = None
        # (parameter, offset, numel) in the chunk, in plan order.
        self.params: list[tuple[nn.Parameter, int, int]] = []
        # Indices into ``params`` of those that received a gradient in this step (any
        # micro-batch); set by the schedule's hooks. See optim.py [Note: which parameters step].
        self.has_grad: set[int] = set()
        # Each parameter's ``_version`` when last synced with home/master: a forward that
        # writes a parameter in place bumps it. See [Note: in-place writes in forward].
        self.versions: list[int] = []

    def settle(self) -> None:
        """Wait for the chunk's ``pending`` host work (re-raising its error), then forget it."""
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def _move(self, start: Residency, to: Residency, verb: str) -> None:
        """From ``start`` (asserted) to ``to``: an offloaded chunk's fetch or release."""
        assert self.where.offloaded, f"chunk {self.id} is {self.where.name}: never {verb}"
        assert self.residency is start, (
            f"chunk {self.id}: {self.residency=}, expected one of {(start,)}"
        )
        self.residency = to

    def to_resident(self) -> None:
        """A fetch has given the chunk's values device storage (offloaded chunks only)."""
        self._move(Residency.RELEASED, Residency.RESIDENT, "fetched")

    def to_released(self) -> None:
        """A release has freed the chunk's device values (offloaded chunks only)."""
        self._move(Residency.RESIDENT, Residency.RELEASED, "released")

    def grad_opened(self) -> None:
        """The gradient buffer got device storage (a trainable chunk; offloaded ones in
        backward)."""
        assert self.trainable and not self.grad_live, (
            f"chunk {self.id}: {self.trainable=} {self.grad_live=}"
        )
        self.grad_live = True

    def grad_closed(self) -> None:
        """The gradient buffer's device storage was freed (an offloaded chunk's offload, or at
        wrap)."""
        assert self.grad_live and (self.where.offloaded or not self.trainable), (
            f"chunk {self.id}: {self.grad_live=} {self.where.name=} {self.trainable=}"
        )
        self.grad_live = False


class ChunkStore:
    """All chunks of one plan on one device. The schedule drives it; it decides nothing."""

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        copies: CopyEngine,
        ledger: Ledger,
        comm,
        nvme_dir: str | os.PathLike | None = None,
    ):
        self.device = copies.device  # the engine's
        self.copies = copies
        self.ledger = ledger
        self.comm = comm  # executor.dist.Comm (passed in: chunks sits below dist)
        self.dtype = DTYPES[plan.training.compute_dtype]
        self.n_buffer = plan.placement.n_buffer
        self.shard_persistent = plan.placement.shard_persistent_states and comm.world > 1
        params = dict(model.named_parameters())
        shard_numel = comm.shard_numel(plan.chunks.chunk_numel)
        su, homes = setup(plan), chunk_homes(plan)
        train = [
            any(params[p.name].requires_grad for p in spec.params) for spec in plan.chunks.items
        ]
        self.grad_in_home = su.grads_in_home
        self.staged = plan.training.grad_accum > 1
        # One pinned arena for every offloaded chunk's host buffers ([Note: pinned arena]
        # in transfer.py): its home (compute dtype) and, unless its gradients land in the
        # home (optim.py [Note: gradients land in home]), an fp32 gradient accumulator (the
        # download's target) and, with grad_accum > 1, a compute-dtype staging buffer for
        # the micro-batches that cannot land in the accumulator directly. Homeless chunks have
        # no home, and the plan's host slots are carved from it too ([Note: host slots]).
        n_slots = plan.placement.n_host_slots
        size = n_slots * HostArena.span(shard_numel, self.dtype)
        # the arena's parts of each chunk's home (homes.py ARENA_PARTS)
        for c, home in enumerate(homes):
            n = host_numel(plan, c)
            size += sum(
                HostArena.span(p.nbytes(n, n), torch.uint8)
                for p in home.parts(su, train[c])
                if p.where == "host" and p.name in H.ARENA_PARTS
            )
        self.disk: DiskStates | None = None
        # (frozen: no states)
        on_disk = [c for c, home in enumerate(homes) if home.on_disk and train[c]]
        if on_disk:
            if nvme_dir is None:
                raise ConfigError(
                    f"the plan keeps the optimizer states of chunks {on_disk} on disk "
                    "(placement.nvme) but no directory was given for them",
                    "pass --nvme DIR to `protrain train` (wrap(..., nvme_dir=DIR)): a directory on "
                    "a fast local disk",
                )
            # The file holds each chunk's disk parts (homes.py: master and moments, page-aligned).
            own = {c: host_numel(plan, c) for c in on_disk}
            self.disk = DiskStates(
                nvme_dir, sum(homes[c].nbytes(su, "disk", n, n) for c, n in own.items())
            )
            self.ledger.host_alloc(H.NVME_WINDOW)
        # The optimizer's fp32 masters (ChunkOptimizer.master, the same dict): a homeless
        # chunk's fetch rounds its values from there; write_back writes into them.
        self.masters: dict[int, torch.Tensor] = {}
        self.arena: HostArena | None = None
        try:
            self.arena = HostArena(size, pin=copies.cuda)
            # [Note: chunk memory pool] in transfer.py
            copies.reserve(pool_slots(plan) * shard_numel * comm.world * self.dtype.itemsize)
            self.chunks = [
                self._lay_out(
                    spec,
                    params,
                    shard_numel,
                    homes[spec.id],
                    train[spec.id],
                    host_numel(plan, spec.id),
                )
                for spec in plan.chunks.items
            ]
        except BaseException:
            for held in (self.arena, self.disk):  # a failed wrap must not leave host memory pinned
                if held is not None:
                    held.close()
            raise
        # The host slots (see [Note: host slots]), free for a next use once guard() returns:
        # (slot, guard | None), oldest returned first. Each 1D (shard_numel,), pinned, compute
        # dtype.
        self.slots = collections.deque(
            (self.arena.take(shard_numel, self.dtype), None) for _ in range(n_slots)
        )
        self.ledger.host_alloc(n_slots * shard_numel * self.dtype.itemsize)
        self._refresh_live()  # _live_ptrs: the data_ptr of every resident chunk's storage

    def _lay_out(
        self,
        spec,
        params: dict[str, nn.Parameter],
        shard_numel: int,
        where: H.Home,
        trainable: bool,
        own_numel: int,
    ) -> Chunk:
        """Build one chunk: views for its parameters, its values, a home if offloaded.

        [Note: masters from the user's fp32 values]
        Under 16-bit compute the fp32 masters must start from the user's parameters,
        not from their 16-bit rounding: a plan moves tensors, it never changes the
        math. So the chunk's values are first assembled in fp32 (``master_init``),
        the optimizer adopts that as the master, and the compute-dtype chunk (device)
        or home (host) is cast from it. Persistent and device-homed chunks assemble on the
        device (their master lives there; one chunk's fp32 image at a time); offloaded ones
        on the host, one shard at a time, so wrap never needs a whole offloaded model on
        the device.
        """
        with self.copies.pooled():  # values and gradients come from the chunk pool
            c = Chunk(
                spec.id,
                shard_numel * self.comm.world,
                shard_numel,
                self.comm.rank,
                where,
                trainable,
                self.dtype,
                self.device,
            )
        persistent = c.persistent
        c.sharded = self.comm.world > 1 and (
            not persistent or self.shard_persistent and c.trainable
        )
        c.own = c.shard if c.sharded else slice(0, c.numel if persistent else own_numel)
        # no master: see [Note: frozen chunks]
        fp32 = self.dtype == torch.float32 or not c.trainable
        at = self.device if persistent or c.homed else torch.device("cpu")
        image = (
            c.dev if (persistent and fp32) else torch.zeros(c.numel, dtype=torch.float32, device=at)
        )
        with torch.no_grad():
            for ps in spec.params:
                p = params[ps.name]
                image[ps.offset : ps.offset + ps.numel].copy_(p.detach().reshape(-1))
                # [Note: chunk storage resize]
                p.data = c.dev[ps.offset : ps.offset + ps.numel].view(p.shape)
                if p.requires_grad:  # a frozen parameter's .grad stays None, as in PyTorch
                    p.grad = c.dev_grad[ps.offset : ps.offset + ps.numel].view(p.shape)
                c.params.append((p, ps.offset, ps.numel))
                c.versions.append(p._version)
            if persistent:
                if image is not c.dev:  # (16-bit compute, trainable)
                    c.dev.copy_(image)
                    c.master_init = image
                self.ledger.alloc("chunks", c.nbytes)
                if c.trainable:
                    self.ledger.alloc("grads", c.nbytes)
                    return c
            else:
                # (fp32: the home is the master, unless homed)
                if (not fp32 or c.homed) and c.trainable:
                    c.master_init = image[c.own].clone()
                # no master: values stay on the device ([Note: device homes])
                if c.homed and not c.trainable:
                    c.home = image[c.own].to(self.dtype)
                    self.ledger.alloc("chunks", c.home.numel() * c.home.element_size())
                # the home is the master, on the disk (nvme.py [Note: NVMe tier])
                elif c.on_disk and fp32:
                    c.home = self.disk.take(own_numel)
                    copy_pieces(c.home, image[c.own], self.disk, drop_dst=True)
                elif not c.where.uses_slots and not c.homed:
                    c.home = self.arena.take(own_numel, self.dtype)
                    c.home.copy_(image[c.own])
                    self.ledger.host_alloc(c.home.numel() * c.home.element_size())
                # its master would be its only copy, and frozen chunks have none
                elif not c.trainable:
                    raise ConfigError(
                        f"chunk {c.id} is homeless (placement.homeless) but its parameters "
                        "are frozen",
                        "make the plan for the model with its parameters frozen as they are now",
                    )
                self.copies.resize(c.dev, 0, f"chunk {c.id}")
                c.to_released()
        # (a frozen chunk never opens them)
        self.copies.resize(c.dev_grad, 0, f"gradients of chunk {c.id}")
        c.grad_closed()
        return c

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view of some chunk's parameter storage (not an activation)."""
        # Called for every saved tensor, so a set lookup rather than a scan. Resident
        # storages only: a released chunk has no data pointer to match.
        return t.untyped_storage().data_ptr() in self._live_ptrs

    def _refresh_live(self) -> None:
        """Recompute the set of live parameter storages (after a fetch or release)."""
        self._live_ptrs = {
            x.dev.untyped_storage().data_ptr()
            for x in self.chunks
            if x.dev.untyped_storage().nbytes() > 0
        }

    # -- residency (offloaded chunks only; the schedule only names those)

    def fetch(self, cid: int) -> None:
        """Make the chunk resident, starting its upload if it is not already (prefetch = fetch
        without ``wait``). Waits first for the chunk's pending host work (its CPU step)."""
        c = self.chunks[cid]
        assert not c.persistent, f"{cid=} is persistent; the plan's events name offloaded chunks"
        if c.residency is Residency.RESIDENT:
            return
        # n_buffer is the plan's bound on resident offloaded chunks; the validator's
        # replay checks it, and this holds the executor to it.
        assert len(self.resident_offloaded()) < self.n_buffer, (
            f"{cid=}: fetch beyond placement.n_buffer={self.n_buffer}"
        )
        c.settle()  # the updated weights must be in home before we read it
        self.copies.resize(c.dev, c.nbytes, f"chunk {cid}")
        self._refresh_live()
        self.ledger.alloc("chunks", c.nbytes)
        n = c.own.stop - c.own.start
        # homeless: the master rounded into a slot ([Note: host slots])
        slotted = c.where.uses_slots
        # (device-homed: the device master, rounded by the copy itself ([Note: device homes]))
        src = (
            self.masters[cid]
            if c.homed and c.trainable
            else self.take_slot()
            if slotted
            else c.home
        )
        if slotted:
            with record_function("protrain::round_master"):
                copy_pieces(src[:n], self.masters[cid], self.disk if c.on_disk else None)
        gather = (
            (lambda: self.comm.all_gather(c.dev, f"chunk {cid}")) if self.comm.world > 1 else None
        )
        # the home: the master, on disk
        if c.on_disk and src is c.home and self.dtype == torch.float32:
            # A piece at a time, each dropped once issued (data-safe under an upload still
            # reading it: it faults back), so the fetch maps one piece, not the shard. One copy
            # stream: the last piece's handle covers them all.
            self.disk.prefetch(src[:n])
            for a in range(0, n, STEP_PIECE):
                b = min(a + STEP_PIECE, n)
                c.upload = self.copies.upload(
                    c.dev[c.own][a:b], src[a:b], gather=gather if b == n else None
                )
                self.disk.drop(src[a:b])
        else:
            c.upload = self.copies.upload(c.dev[c.own], src[:n], gather=gather)
        if slotted:
            self.slots.append((src, c.upload.synchronize))
        c.last_upload = c.upload
        c.to_resident()

    def take_slot(self) -> torch.Tensor:
        """A host slot, once its last use is over.

        [Note: host slots] A homeless chunk (``placement.homeless``) keeps no compute-dtype
        home: its fp32 master is its only host copy (12 B per element with the moments).
        A fetch rounds the master into a slot and uploads from it; an offload downloads the
        gradients into a slot and the CPU step reads them from there. A slot goes back to
        ``slots`` as soon as its use is *issued*, with a guard: the host waits for it before
        the slot's next use writes it (the upload's event, or the CPU step that reads the
        gradients), so a slot is never overwritten under an upload still reading it or a step
        still reading gradients. ``placement.n_host_slots`` slots, whatever the model: too
        few only make the host wait for a copy or a step sooner (both always complete:
        neither waits for the main thread).
        """
        slot, guard = self.slots.popleft()
        if guard is not None:
            guard()
        return slot

    def wait(self, cid: int) -> None:
        """Make compute wait until the chunk's upload has landed."""
        c = self.chunks[cid]
        assert c.residency is Residency.RESIDENT, f"{cid=} {c.residency=}: fetch before wait"
        if c.upload is not None:
            c.upload.wait()
            c.upload = None

    def release(self, cid: int) -> None:
        c = self.chunks[cid]
        assert c.residency is Residency.RESIDENT, (
            f"{cid=} {c.residency=}: release of a released chunk"
        )
        # A prefetch never used (evaluate, an error): its copy and all-gather still write the
        # storage we are about to free.
        self.wait(cid)  # a prefetch never used
        self.write_back(cid)
        self.copies.resize(c.dev, 0, f"chunk {cid}")
        self._refresh_live()
        self.ledger.free("chunks", c.nbytes)
        c.to_released()

    def write_back(self, cid: int) -> None:
        """Keep what forward wrote into parameters in place.

        [Note: in-place writes in forward]
        A module may write its parameter in place during forward (``nn.Embedding`` with
        ``max_norm`` renormalises the rows it looks up, under no_grad). Plain PyTorch keeps
        that write; a release that frees the device copy would lose it. A Parameter's
        ``_version`` is its own counter (``param.data = view`` keeps it; our copies into
        the chunk go through the chunk tensor and do not bump it), so a changed version
        means the model wrote it. Before a release, and before a chunk's step (a persistent
        chunk's, or an offloaded chunk's offload, which its step follows: engine.py ``_offload``),
        such a parameter's device values go to its home (offloaded chunks) and, under
        16-bit compute, to its fp32 master. On CUDA this copy blocks the host (a rare path).
        """
        c = self.chunks[cid]
        for i, (p, off, n) in enumerate(c.params):
            if p._version == c.versions[i]:
                continue
            c.versions[i] = p._version
            lo, hi = c.own.start, c.own.stop  # where home and master start and end
            a, b = max(off, lo), min(off + n, hi)  # the parameter's piece on this rank
            with torch.no_grad():
                if a < b and c.home is not None:
                    c.home[a - lo : b - lo].copy_(c.dev[a:b])
                # (fp32: the chunk or home is the master)
                if a < b and (self.dtype != torch.float32 or c.homed):
                    self.masters[cid][a - lo : b - lo].copy_(c.dev[a:b])
                if a < b and c.on_disk:
                    self.disk.drop(self.masters[cid][a - lo : b - lo])

    def begin_step(self) -> None:
        """A new optimizer step: zero persistent gradients, forget who had a gradient."""
        for c in self.chunks:
            c.has_grad.clear()
            if c.persistent and c.trainable:
                c.dev_grad.zero_()

    # -- gradient buffers of offloaded chunks

    def open_grad(self, cid: int) -> None:
        """Give the chunk's gradient buffer device storage, zeroed, if it has none."""
        c = self.chunks[cid]
        if not c.grad_live and c.trainable:
            self.copies.resize(c.dev_grad, c.nbytes, f"gradients of chunk {cid}")
            c.dev_grad.zero_()
            self.ledger.alloc("grads", c.nbytes)
            c.grad_opened()

    def own_grad(self, cid: int) -> torch.Tensor:
        """This rank's elements of the chunk's gradients (``own``): a view of the buffer (at one
        rank, not the padding past the last parameter), or under ZeRO-3 a new buffer holding
        their sum over the ranks (reduce-scatter)."""
        c = self.chunks[cid]
        if self.comm.world == 1:
            return c.dev_grad[c.own]
        out = c.dev_grad.new_empty(c.own.stop - c.own.start)
        self.comm.reduce_scatter(out, c.dev_grad, f"gradients of chunk {cid}")
        return out

    def close_grad(self, cid: int) -> None:
        c = self.chunks[cid]
        self.copies.resize(c.dev_grad, 0, f"gradients of chunk {cid}")
        self.ledger.free("grads", c.nbytes)
        c.grad_closed()

    def resident_offloaded(self) -> frozenset[int]:
        return frozenset(
            c.id for c in self.chunks if not c.persistent and c.residency is Residency.RESIDENT
        )
