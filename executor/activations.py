"""Per-block activation policies: keep, swap, checkpoint; and the CPU ledger's activation count.

- ``keep``: nothing happens; autograd keeps what it saves.
- ``checkpoint``: the block's forward runs under ``torch.utils.checkpoint``
  (non-reentrant, RNG state preserved, so dropout masks in the recomputation equal
  the first forward's). Only the block's input is kept.
- ``swap``: the block's forward runs under ``saved_tensors_hooks`` whose pack hook
  copies the storage of every saved tensor that is not a chunk's parameter storage
  to host memory, once per storage (on the D2H stream on CUDA), and drops the device
  copy; the schedule's ``swap_in`` event brings the storages back ahead of the
  block's backward, and the unpack hook waits for that copy (or copies synchronously
  if no swap-in was scheduled yet) and rebuilds the saved view on it. See
  [Note: swap per storage].

[Note: policy wrappers]
Checkpoint and swap replace the block's ``forward`` attribute with a wrapper, so
the module's forward hooks (where the schedule lives) run once per forward and
never during recomputation: ``torch.utils.checkpoint`` re-runs the original
forward function, not the module call. Recomputation therefore cannot re-trigger
forward-only events. The wrapper is removed by ``uninstall``.

[Note: swap per storage]
Autograd saves views: slices of a fused projection (``qkv[..., :d]``), a transposed
key, several views of one base, broadcasts with stride 0. Backward kernels pick their
loops by layout (a non-dense operand splits the work between vector and scalar code,
whose math differs in the last bit, elsewhere than a contiguous one; measured on
Phi-3 at intermediate width 100: |dparam| 1e-5 after 5 steps), so a swap must give
back each saved tensor with its exact size, stride and storage offset, views of one
base still sharing one storage; a per-tensor ``empty_like`` does neither (it makes
non-dense views contiguous, and copies a base once per view).
So a swapped block moves storages, not tensors:

- the first time one forward of the block saves a view of a device storage, the
  whole storage's bytes are downloaded (``uint8``, so views of another dtype and
  stride-0 broadcasts need no special case), into one ``SwapHandle``;
- every saved view is packed as (handle, dtype, size, stride, storage offset) and
  unpacked as exactly that view of the handle's swapped-in device storage (``set_``);
  ``swap_in`` uploads each handle once, so the views share one device copy again;
- storages are keyed by data pointer within one forward call of the block. That
  forward holds each swapped storage until it returns, so no new storage can take a
  key's address meanwhile; the cost model already charges a swapped block's saved
  bytes on the device during its own forward segment (planner/search/cost.py). A storage
  written in place after its download (its version counter moved) is downloaded
  again, so each view comes back with the bytes it was saved with;
- what a swap moves per segment is therefore the bytes of the distinct storages it
  saves (``segment_swap_bytes``). Under keep the CPU count fills it by the same rule,
  for the profiler (it also counts the few bytes of 0-dim and host tensors, which a
  swap leaves where they are). A storage two blocks save is moved by each of them.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from protrain.plans.plan import PRE, Plan

from .chunks import ChunkStore
from .transfer import CopyHandle


@dataclass(slots=True, eq=False)  # (a handle is compared by identity)
class SwapHandle:
    """One swapped storage: its host copy, and its device copy once swapped in.

    See [Note: swap per storage]; the saved tensors are views of it.
    """

    host: torch.Tensor  # 1D uint8 (storage nbytes,), the storage's bytes; pinned on CUDA
    down: CopyHandle  # the D2H copy that fills `host`
    dev: torch.Tensor | None = None  # 1D uint8 (storage nbytes,) once swapped in
    up: CopyHandle | None = None  # the H2D copy that fills `dev`


class Activations:
    """Installs the plan's activation policies and counts activation bytes for the CPU ledger."""

    def __init__(self, model: nn.Module, plan: Plan, store: ChunkStore):
        # the engine's (chunks.py)
        self.store, self.copies, self.ledger = store, store.copies, store.ledger
        self.count = not self.ledger.cuda  # on CUDA the allocator counts; see memory.py
        modules = dict(model.named_modules())
        self.blocks = {a.block: (modules[a.block], a.policy) for a in plan.activations}
        self.segment = PRE  # segment whose forward is running (set by the schedule)
        # Swapped storages per block, in pack order; emptied when the block's backward ends.
        self.swapped: dict[str, list[SwapHandle]] = {b: [] for b in self.blocks}
        # CPU ledger: storage → (segment, bytes) of activations counted now, and per-segment sums.
        self.counted: dict[int, tuple[str, int]] = {}
        self.segment_bytes: Counter[str] = Counter()
        # What a swap of the segment moves (swapped blocks) or would move (counted ones):
        # bytes of the distinct storages it saves. See [Note: swap per storage]. Reset at
        # each counted forward, reported in ``saved`` events (events.py); its storages per
        # segment, until the segment's backward ends.
        self.segment_swap_bytes: Counter[str] = Counter()
        self._swap_counted: dict[str, set[int]] = {}
        self._originals: dict[str, Callable] = {}

    # -- installation

    def install(self) -> None:
        for name, (module, policy) in self.blocks.items():
            if policy == "keep":
                continue
            original = self._originals[name] = module.forward
            module.forward = (self._checkpointed if policy == "checkpoint" else self._swapped)(
                name, original
            )

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
            return checkpoint(
                original, *args, use_reentrant=False, preserve_rng_state=True, **kwargs
            )

        return forward

    def _swapped(self, name: str, original: Callable) -> Callable:
        # See [Note: swap per storage].
        def pack(live: dict[int, tuple[torch.Tensor, int, SwapHandle]], t: torch.Tensor):
            # Kept as it is: a parameter (its chunk's residency is the schedule's business), or
            # not a device activation: flash/efficient SDPA save philox seed and offset as CPU
            # int64 scalars (a D2H copy of a host tensor has no stream to record on), and a
            # 0-dim tensor is not worth a copy.
            if self.store.owns(t) or t.device != self.store.device or t.dim() == 0:
                return (False, t)
            storage = t.untyped_storage()
            key = storage.data_ptr()
            held = live.get(key)
            if held is None or held[1] != t._version:  # new storage, or written since its download
                # all its bytes
                src = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
                host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=self.copies.cuda)
                handle = SwapHandle(host, self.copies.download(host, src, name="swap_out"))
                self.swapped[name].append(handle)
                held = live[key] = (src, t._version, handle)  # src: see the Note's third point
                # Each download counts (a storage rewritten in place is moved twice).
                self.segment_swap_bytes[name] += src.numel()
            return (True, (held[2], t.dtype, t.shape, t.stride(), t.storage_offset()))

        def unpack(packed):
            is_swapped, x = packed
            if not is_swapped:
                return x
            h, dtype, size, stride, offset = x
            if h.dev is None:  # not swapped in ahead of time: bring it back now
                self._swap_in_one(h, name)
            h.up.wait()
            # The saved view, exactly: same size, stride and offset, on the swapped-in storage.
            return torch.empty(0, dtype=dtype, device=h.dev.device).set_(
                h.dev.untyped_storage(), offset, size, stride
            )

        def forward(*args, **kwargs):
            # Storages this call swapped: data pointer → (device bytes held, version, handle).
            live: dict[int, tuple[torch.Tensor, int, SwapHandle]] = {}
            try:
                with saved_tensors_hooks(functools.partial(pack, live), unpack):
                    return original(*args, **kwargs)
            finally:
                live.clear()  # the device storages may go once their downloads are done

        return forward

    # -- events

    def swap_in(self, block: str) -> None:
        """Start bringing a swapped block's saved tensors back to the device (``swap_in``)."""
        for h in self.swapped[block]:
            if h.dev is None:
                self._swap_in_one(h, block)

    def _swap_in_one(self, h: SwapHandle, block: str) -> None:
        h.dev = torch.empty(h.host.numel(), dtype=torch.uint8, device=self.store.device)
        h.up = self.copies.upload(h.dev, h.host, name="swap_in", after=h.down)
        if self.count:  # one count per swapped storage, however many views it backs
            self._add(id(h), block, h.dev.numel())

    def end_backward(self, segment: str) -> None:
        """The segment's backward is over: its saved activations are gone."""
        self.swapped.get(segment, []).clear()
        self._swap_counted.pop(segment, None)
        if self.count:
            self.ledger.free("activations", self.segment_bytes.pop(segment, 0))
            self.counted = {k: v for k, v in self.counted.items() if v[0] != segment}

    # -- CPU ledger counting (see memory.py)

    @contextlib.contextmanager
    def counting(self):
        """Around a whole forward on CPU (or when a listener asked, ``Engine.on_event``): count
        saved tensors held on the device; then tell listeners each segment's ``saved`` bytes."""
        if not self.count:
            yield
            return
        self.segment_swap_bytes.clear()  # this forward's

        def pack(t: torch.Tensor):
            self._count(t, self.segment)
            return t.detach()  # not t itself: a saved output must not point back at its grad_fn

        with saved_tensors_hooks(pack, lambda t: t):
            yield
        if self.copies.events.listeners:  # events.py [Note: events]
            for seg in {**self.segment_swap_bytes, **self.segment_bytes}:
                self.copies.events.emit(
                    "saved",
                    "mark",
                    phase="forward",
                    segment=seg,
                    nbytes=self.segment_bytes[seg],
                    swap_bytes=self.segment_swap_bytes[seg],
                )

    def _count(self, t: torch.Tensor, segment: str) -> None:
        if not self.count or self.store.owns(t):
            return
        s = t.untyped_storage()
        seen = self._swap_counted.setdefault(segment, set())  # what a swap of the segment moves:
        if s.data_ptr() not in seen:  # once per storage and segment
            seen.add(s.data_ptr())
            self.segment_swap_bytes[segment] += s.nbytes()
        self._add(s.data_ptr(), segment, s.nbytes())

    def _add(self, key: int, segment: str, nbytes: int) -> None:
        if key in self.counted:
            return
        self.counted[key] = (segment, nbytes)
        self.segment_bytes[segment] += nbytes
        self.ledger.alloc("activations", nbytes)
