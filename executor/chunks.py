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
schedule must fetch every chunk a segment uses (``plan.simulate_residency``).

[Note: gradients in chunks]
``param.grad`` is pre-set to a view of the chunk's gradient buffer. With grad mode
off during backward, ``AccumulateGrad`` adds into an existing ``.grad`` in place,
so gradients land in the chunk with no copy. We zero the buffers and never set
``.grad`` to ``None``. A tied parameter is one Parameter object under two names,
so it has one slot and one gradient.
"""

from __future__ import annotations

import enum
from concurrent.futures import Future

import torch
from torch import nn

from .memory import Ledger
from .plan import Plan
from .transfer import Copy, CopyEngine, HostArena

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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

    def __init__(self, cid: int, numel: int, shard_numel: int, rank: int, persistent: bool,
                 dtype: torch.dtype, device: torch.device):
        self.id = cid
        self.persistent = persistent
        self.numel = numel
        self.shard = slice(rank * shard_numel, (rank + 1) * shard_numel)  # this rank's slice
        self.nbytes = numel * torch.empty((), dtype=dtype).element_size()
        # Parameters' values; params' .data are views. 1D (numel,), device, compute dtype.
        self.dev = torch.zeros(numel, dtype=dtype, device=device)
        # Gradients; params' .grad are views. 1D (numel,), device, compute dtype.
        self.dev_grad = torch.zeros(numel, dtype=dtype, device=device)
        # Offloaded chunks only: this rank's shard of the values between fetches.
        # 1D (shard_numel,), host (pinned on CUDA), compute dtype.
        self.home: torch.Tensor | None = None
        self.residency = Residency.RESIDENT
        self.grad_live = True  # gradient buffer has device storage
        # The upload issued by the last fetch/prefetch; compute waits on it before use.
        self.upload: Copy | None = None
        # CPU optimizer step that must finish (and write home) before the next upload.
        self.update: Future | None = None
        # (parameter, offset, numel) in the chunk, in plan order.
        self.params: list[tuple[nn.Parameter, int, int]] = []


class ChunkStore:
    """All chunks of one plan on one device. The schedule drives it; it decides nothing."""

    def __init__(self, model: nn.Module, plan: Plan, device: torch.device,
                 copies: CopyEngine, ledger: Ledger, comm):
        self.device = device
        self.copies = copies
        self.ledger = ledger
        self.comm = comm  # executor.dist.Comm (passed in: chunks sits below dist)
        self.dtype = DTYPES[plan.training.compute_dtype]
        persistent = set(plan.placement.persistent)
        params = dict(model.named_parameters())
        shard_numel = comm.shard_numel(plan.chunks.chunk_numel)
        # One pinned arena for every offloaded chunk's home and (16-bit compute) gradient
        # staging buffer, sized from the plan ([Note: pinned arena] in transfer.py).
        n_off = len(plan.chunks.items) - len(persistent)
        per_chunk = HostArena.span(shard_numel, self.dtype) * (1 if self.dtype == torch.float32 else 2)
        self.arena = HostArena(n_off * per_chunk, pin=copies.cuda)
        self.chunks: list[Chunk] = []
        for spec in plan.chunks.items:
            c = Chunk(spec.id, shard_numel * comm.world, shard_numel, comm.rank,
                      spec.id in persistent, self.dtype, device)
            with torch.no_grad():
                for ps in spec.params:
                    p = params[ps.name]
                    view = c.dev[ps.offset: ps.offset + ps.numel].view(p.shape)
                    view.copy_(p.detach())
                    p.data = view  # see [Note: chunk storage resize]
                    p.grad = c.dev_grad[ps.offset: ps.offset + ps.numel].view(p.shape)
                    c.params.append((p, ps.offset, ps.numel))
            if not c.persistent:
                c.home = self.arena.take(shard_numel, self.dtype)
                c.home.copy_(c.dev[c.shard].detach())
                ledger.host_alloc(c.home.numel() * c.home.element_size())
                self._resize(c.dev, 0)
                self._resize(c.dev_grad, 0)
                c.residency, c.grad_live = Residency.RELEASED, False
            else:
                ledger.alloc("chunks", c.nbytes)
                ledger.alloc("grads", c.nbytes)
            self.chunks.append(c)
        self._live_ptrs: set[int] = set()  # data_ptr of every resident chunk's storage
        self._refresh_live()

    @staticmethod
    def element_bytes(dtype: torch.dtype) -> int:
        return torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def _resize(t: torch.Tensor, nbytes: int) -> None:
        t.untyped_storage().resize_(nbytes)

    def storage_bytes(self, cid: int) -> int:
        """Bytes of device storage the chunk's parameters hold now (0 when released)."""
        return self.chunks[cid].dev.untyped_storage().nbytes()

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view of some chunk's parameter storage (not an activation)."""
        # Called for every saved tensor, so a set lookup rather than a scan. Resident
        # storages only: a released chunk has no data pointer to match.
        return t.untyped_storage().data_ptr() in self._live_ptrs

    def _refresh_live(self) -> None:
        """Recompute the set of live parameter storages (after a fetch or release)."""
        self._live_ptrs = {x.dev.untyped_storage().data_ptr() for x in self.chunks
                           if x.dev.untyped_storage().nbytes() > 0}

    # -- residency (offloaded chunks only; the schedule only names those)

    def fetch(self, cid: int) -> None:
        """Make the chunk resident, starting its upload if it is not already (prefetch = fetch
        without ``wait``). Waits first for a pending CPU optimizer step of this chunk."""
        c = self.chunks[cid]
        assert not c.persistent, f"{cid=} is persistent; the plan's events name offloaded chunks"
        if c.residency is Residency.RESIDENT:
            return
        if c.update is not None:
            c.update.result()  # the updated weights must be in home before we read it
            c.update = None
        self._resize(c.dev, c.nbytes)
        self._refresh_live()
        self.ledger.alloc("chunks", c.nbytes)
        c.upload = self.copies.upload(c.dev[c.shard], c.home,
                                      gather=(lambda: self.comm.all_gather(c.dev, f"chunk {cid}"))
                                      if self.comm.world > 1 else None)
        c.residency = Residency.RESIDENT

    def wait(self, cid: int) -> None:
        """Make compute wait until the chunk's upload has landed."""
        c = self.chunks[cid]
        assert c.residency is Residency.RESIDENT, f"{cid=} {c.residency=}: fetch before wait"
        if c.upload is not None:
            c.upload.wait()
            c.upload = None

    def release(self, cid: int) -> None:
        c = self.chunks[cid]
        assert c.residency is Residency.RESIDENT, f"{cid=} {c.residency=}: release of a released chunk"
        c.upload = None
        self._resize(c.dev, 0)
        self._refresh_live()
        self.ledger.free("chunks", c.nbytes)
        c.residency = Residency.RELEASED

    # -- gradient buffers of offloaded chunks

    def open_grad(self, cid: int) -> None:
        """Give the chunk's gradient buffer device storage, zeroed, if it has none."""
        c = self.chunks[cid]
        if not c.grad_live:
            self._resize(c.dev_grad, c.nbytes)
            c.dev_grad.zero_()
            self.ledger.alloc("grads", c.nbytes)
            c.grad_live = True

    def close_grad(self, cid: int) -> None:
        c = self.chunks[cid]
        assert c.grad_live and not c.persistent, f"{cid=} {c.grad_live=} {c.persistent=}"
        self._resize(c.dev_grad, 0)
        self.ledger.free("grads", c.nbytes)
        c.grad_live = False

    def zero_persistent_grads(self) -> None:
        for c in self.chunks:
            if c.persistent:
                c.dev_grad.zero_()

    def resident_offloaded(self) -> frozenset[int]:
        return frozenset(c.id for c in self.chunks
                         if not c.persistent and c.residency is Residency.RESIDENT)
