"""Per-block activation policies: keep, swap, checkpoint; and the CPU ledger's activation count.

- ``keep``: nothing happens; autograd keeps what it saves.
- ``checkpoint``: the block's forward runs under ``torch.utils.checkpoint``
  (non-reentrant, RNG state preserved, so dropout masks in the recomputation equal
  the first forward's). Only the block's input is kept.
- ``swap``: the block's forward runs under ``saved_tensors_hooks`` whose pack hook
  copies every saved tensor that is not a chunk's parameter storage to host memory
  (on the D2H stream on CUDA) and drops the device copy; the schedule's ``swap_in``
  event brings them back ahead of the block's backward, and the unpack hook waits
  for that copy (or copies synchronously if no swap-in was scheduled yet).

[Note: policy wrappers]
Checkpoint and swap replace the block's ``forward`` attribute with a wrapper, so
the module's forward hooks (where the schedule lives) run once per forward and
never during recomputation: ``torch.utils.checkpoint`` re-runs the original
forward function, not the module call. Recomputation therefore cannot re-trigger
forward-only events. The wrapper is removed by ``uninstall``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from .chunks import ChunkStore
from .memory import Ledger
from .plan import PRE, Plan
from .transfer import Copy, CopyEngine


class SwapHandle:
    """One swapped tensor: its host copy, and its device copy once swapped in."""

    __slots__ = ("host", "down", "dev", "up")

    def __init__(self, host: torch.Tensor, down: Copy):
        self.host = host  # host copy, same shape/strides/dtype; pinned on CUDA
        self.down = down  # the D2H copy that fills `host`
        self.dev: torch.Tensor | None = None  # device copy after swap-in
        self.up: Copy | None = None  # the H2D copy that fills `dev`


class Activations:
    """Installs the plan's activation policies and counts activation bytes for the CPU ledger."""

    def __init__(self, model: nn.Module, plan: Plan, store: ChunkStore, copies: CopyEngine,
                 ledger: Ledger):
        self.store = store
        self.copies = copies
        self.ledger = ledger
        self.count = not ledger.cuda  # on CUDA the allocator counts; see memory.py
        modules = dict(model.named_modules())
        self.blocks = {a.block: (modules[a.block], a.policy) for a in plan.activations}
        self.segment = PRE  # segment whose forward is running (set by the schedule)
        # Swapped tensors per block, in pack order; emptied when the block's backward ends.
        self.swapped: dict[str, list[SwapHandle]] = {b: [] for b in self.blocks}
        # CPU ledger: storage → (segment, bytes) of activations counted now, and per-segment sums.
        self.counted: dict[int, tuple[str, int]] = {}
        self.segment_bytes: dict[str, int] = {}
        # Per-tensor (not de-duplicated) bytes of the same tensors: what a swap would move.
        # Read by the profiler; reset by it too.
        self.segment_tensor_bytes: dict[str, int] = {}
        self._originals: dict[str, Callable] = {}

    # -- installation

    def install(self) -> None:
        for name, (module, policy) in self.blocks.items():
            if policy == "keep":
                continue
            original = module.forward
            self._originals[name] = original
            if policy == "checkpoint":
                module.forward = self._checkpointed(name, original)
            else:
                module.forward = self._swapped(name, original)

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            module = self.blocks[name][0]
            del module.forward  # back to the class's forward
            assert module.forward.__func__ is original.__func__, f"{name=}"
        self._originals.clear()

    def _checkpointed(self, name: str, original: Callable) -> Callable:
        def forward(*args, **kwargs):
            # A checkpointed block keeps only its inputs alive for backward: the hidden
            # states, and for Hugging Face blocks the keyword tensors too (RoPE cos/sin,
            # shared by all blocks and so counted once, by the first block that holds them).
            if torch.is_grad_enabled():  # not in ``evaluate``, which keeps nothing for backward
                for a in tree_flatten((args, kwargs))[0]:
                    if isinstance(a, torch.Tensor):
                        self._count(a, name)
            return checkpoint(original, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

        return forward

    def _swapped(self, name: str, original: Callable) -> Callable:
        def pack(t: torch.Tensor):
            if self.store.owns(t):
                return (False, t)  # a parameter: its chunk's residency is the schedule's business
            if t.device != self.store.device or t.dim() == 0:
                # Not a device activation: flash/efficient SDPA save philox seed and offset
                # as CPU int64 scalars (a D2H copy of a host tensor has no stream to record
                # on), and a 0-dim tensor is not worth a copy. Kept as it is.
                return (False, t)
            # preserve_format keeps the original's strides where it is dense, so backward
            # formulas that care about layout see what they saved.
            host = torch.empty_like(t, device="cpu", pin_memory=self.copies.cuda)
            handle = SwapHandle(host, self.copies.download(host, t, name="swap_out"))
            self.swapped[name].append(handle)
            return (True, handle)

        def unpack(packed):
            is_swapped, x = packed
            if not is_swapped:
                return x
            if x.dev is None:  # not swapped in ahead of time: bring it back now
                self._swap_in_one(x, name)
            x.up.wait()
            return x.dev

        def forward(*args, **kwargs):
            with saved_tensors_hooks(pack, unpack):
                return original(*args, **kwargs)

        return forward

    # -- events

    def swap_in(self, block: str) -> None:
        """Start bringing a swapped block's saved tensors back to the device (``swap_in``)."""
        for h in self.swapped[block]:
            if h.dev is None:
                self._swap_in_one(h, block)

    def _swap_in_one(self, h: SwapHandle, block: str) -> None:
        h.dev = torch.empty_strided(h.host.shape, h.host.stride(), dtype=h.host.dtype,
                                    device=self.store.device)
        h.up = self.copies.upload(h.dev, h.host, name="swap_in", after=h.down)
        if self.count:
            self._add(id(h), block, h.dev.untyped_storage().nbytes())

    def end_backward(self, segment: str) -> None:
        """The segment's backward is over: its saved activations are gone."""
        self.swapped.get(segment, []).clear()
        if self.count:
            nbytes = self.segment_bytes.pop(segment, 0)
            if nbytes:
                self.ledger.free("activations", nbytes)
            self.counted = {k: v for k, v in self.counted.items() if v[0] != segment}

    # -- CPU ledger counting (see memory.py)

    @contextlib.contextmanager
    def counting(self):
        """Around a whole forward on CPU: count saved tensors held on the device."""
        if not self.count:
            yield
            return

        def pack(t: torch.Tensor):
            self._count(t, self.segment)
            return t.detach()  # not t itself: a saved output must not point back at its grad_fn

        with saved_tensors_hooks(pack, lambda t: t):
            yield

    def _count(self, t: torch.Tensor, segment: str) -> None:
        if not self.count or self.store.owns(t):
            return
        self.segment_tensor_bytes[segment] = (self.segment_tensor_bytes.get(segment, 0)
                                              + t.numel() * t.element_size())
        s = t.untyped_storage()
        self._add(s.data_ptr(), segment, s.nbytes())

    def _add(self, key: int, segment: str, nbytes: int) -> None:
        if key in self.counted:
            return
        self.counted[key] = (segment, nbytes)
        self.segment_bytes[segment] = self.segment_bytes.get(segment, 0) + nbytes
        self.ledger.alloc("activations", nbytes)
