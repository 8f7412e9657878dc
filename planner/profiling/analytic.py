"""Analytic profiles: a Profile estimated from one forward+backward on ``meta`` and a hardware spec.

``protrain profile`` measures a Profile on the device (``profile.measure``). For a card
we do not have, or a model larger than anything we can run, this module estimates
the same Profile without allocating a byte: the model runs one training step on the
``meta`` device (llama-70b at T=4096: under 3 s and ~340 MiB on a 2-core CI box), and every
aten op is charged to the segment running at that moment (``<pre>``, a block,
``<post>``), the same segments the executor's schedule and the profiler use.

The model, op by op (``_OpCounter``):

- **FLOPs** from ``torch.utils.flop_counter``'s formulas (matmuls, attention); every
  other op counts zero FLOPs. SDPA counts the full ``T x T`` score matrix, as
  FlopCounterMode does: a causal kernel skips half of it, but flash attention also
  runs at about half the dense-matmul rate, and we let the two cancel.
- **Bytes moved**: every tensor argument read (dense size, capped by its storage for
  broadcast views, parameters included) plus every tensor output written.
- **Time, per op (roofline)**: ``max(flops / matmul rate, bytes / mem_bytes_per_s)
  + KERNEL_OVERHEAD_US``. The matmul rate is ``matmul_flops_per_s`` for 16-bit
  operands and ``matmul_fp32_flops_per_s`` for fp32 ones (the op's first floating
  input decides). Per op, not per segment: a layer norm is memory-bound even in a
  segment whose matmuls are compute-bound, and a per-segment roofline would hide it.
  Ops that launch no kernel (views, ``detach``, ``empty``) cost nothing, except in
  forward on a ``cpu`` spec (below).
- **CPU forward, eager**: on a ``cpu`` spec the host runs the model's Python and
  the dispatcher in line with the kernels, so in forward an op that launches no kernel
  costs ``CPU_FORWARD_FREE_OP_US``, and every saved tensor ``CPU_SAVED_TENSOR_US``
  for the executor's ledger hook. A routed expert bank adds ``CPU_MOE_EXPERT_US`` per
  expert its tokens reach and ``CPU_MOE_ROW_US`` per routed row (token x top_k): the
  routing kernels that run per row and the grouped GEMM's per-expert GEMMs, which the
  per-op roofline misses on a CPU. None of these is charged in backward, which runs in
  the autograd engine's C++ (backward times land within 25% without). Not modelled,
  so a CPU forward can still come out short (tests/test_moe.py says by how much): flash
  SDPA at small head sizes runs below the matmul rate.
- **Segments in backward**: identity autograd Functions on each block's input and
  output, as the executor's ``_Boundary`` (see [Note: segment boundaries] in
  executor/schedule.py). Gradient buffers are preset on the parameters, so each
  gradient is accumulated in place by an ``add_`` charged to its segment, as into
  the executor's chunk gradient buffers.
- **Saved activations**: ``saved_tensors_hooks`` during forward, attributed to the
  running segment, exactly as the executor's CPU ledger counts them
  (``executor/activations.py``): parameter storages skipped, each storage counted
  once (by the first segment that saves it) for ``saved_bytes``, and once per
  segment that saves it for ``saved_tensor_bytes`` (what a swap moves: each swapped
  block copies every storage it saves once, see [Note: swap per storage] in
  executor/activations.py). On meta the storage identity is
  ``untyped_storage()._cdata`` (meta storages have no data pointer).
- **Transient peaks**: a simulated allocator. Every storage an op creates is live
  from that op until Python and autograd drop it (a weakref on the storage);
  parameters and their preset gradient buffers (the executor's chunks) are not
  counted. ``fwd_peak_bytes`` / ``bwd_peak_bytes`` are the highest live count inside
  the segment minus the larger of the live counts at its begin and end - the
  definition ``profile.measure`` reads from the CUDA allocator. It sees whole
  tensors only: kernels' internal workspaces (cuBLAS, flash attention) are missed.
  For a ``cpu`` spec the profile carries 0, as a measured CPU profile does (the CPU
  ledger counts no transients); ``count_segments`` still reports them.

Kernel choices, where meta and a GPU would differ:

- ``F.scaled_dot_product_attention`` runs as the fused flash kernel
  (``_scaled_dot_product_flash_attention_for_cpu``, whose meta kernel exists), which
  saves q, k, v, the output and an fp32 log-sum-exp, as the CUDA flash kernel and
  the CPU executor do. Left alone, meta would pick the math backend and save the
  ``T x T`` attention matrix. Attention dropout is passed as 0 (a fused kernel keeps
  only its RNG state, not a mask); ``enable_gqa`` is expanded by repeating k and v.
- ``F.dropout`` on a ``gpu`` spec runs as ``native_dropout`` (CUDA's kernel, a
  1-byte mask); on a ``cpu`` spec as the CPU does (a mask the size of the input).

Mixture-of-experts blocks (``planner/models/moe.py``): the router's top-k depends on values
``meta`` does not have, and transformers' grouped GEMM over the experts needs them
(its groups are the experts' token counts). ``moe.balanced_experts`` runs each fused
expert bank at balanced load instead: ``tokens x top_k / n_experts`` rows per expert
in one ``bmm``, so a block is charged for its *active* experts (top-k of n, plus the
router and any shared experts, which are ordinary modules), while every expert's
parameters still count as parameters. What routing imbalance can add is bounded in
[Note: routing imbalance] in planner/models/moe.py.

Every block is run: a llama-70b step (80 blocks, ~21k ops) is cheap enough on meta
that we do not profile one block and replicate it, so models whose blocks differ
(and the first and last blocks, whose neighbours differ) come out right without a
rule for which blocks are alike. The result is deterministic (same inputs, same bytes).
Where many profiles are needed of models known to repeat one block (``protrain fit``'s
ladders), ``deepen.py`` extends a ``REPLICA_BLOCKS``-deep profile, checked equal byte for
byte to profiling every block (tests/test_analytic.py).

``scale_profile`` rescales a measured Profile to another (micro_batch, seq_len):
DESIGN §5 prefers a measurement of the same model over the datasheet.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from protrain.executor.check import model_fingerprint, tied_pairs
from protrain.executor.schedule import Boundary, block_input, first_tensor
from protrain.plans.errors import ConfigError
from protrain.plans.plan import POST, PRE

from ..hardware.spec import HardwareSpec
from ..models.moe import balanced_experts
from .graph import ExecutionGraph, trace
from .profile import (
    PROFILE_VERSION,
    ParamInfo,
    Profile,
    ProfileModel,
    ProfileTraining,
    SegmentProfile,
    generator,
)

KERNEL_OVERHEAD_US = 5.0
"""Fixed cost added to every op that launches a kernel: launch latency plus the tail of a
small kernel that never reaches the roofline (a few µs on current GPUs)."""

CPU_FORWARD_FREE_OP_US = 5.0
"""On a ``cpu`` spec, in forward: what an op that launches no kernel (a view, ``t``,
``_unsafe_view``, ``empty``) costs, with the model's Python between ops folded in. A GPU
hides that host time behind the kernels it queues; a CPU runs it in line. Measured as
(forward time − 5 µs per kernel op) / ops without a kernel, at B=1, T=1 where kernels
cost next to nothing, one thread, the thread's CPU clock: transformers' tiny Llama
5.3 µs (91 kernel ops, 98 without), the zoo's gpt2-tiny 3.7, llama-tiny 1.9; a bare
``x.view(...)`` in a Python loop is 1.0 µs, the rest is the Python around it. We take
transformers' figure rounded down, the heavier code. Backward runs in the autograd engine's C++ with
no Python between ops, and is not charged."""

CPU_SAVED_TENSOR_US = 5.5
"""On a ``cpu`` spec, in forward: the executor's ledger hook per saved tensor (a Python
``saved_tensors_hooks`` pack that counts the storage and detaches it; on CPU the ledger
always counts, ``executor/activations.py``). Parameters pass through the hook too.
Measured with ``Engine.step`` on transformers' tiny Mistral and Mixtral (B=4, T=64, one
thread, the thread's CPU clock), the forward with counting on less off, over the pack
calls (89 and 111): 5.7 and 5.6 µs; 5.3 and 4.6 in a second run with the other core
busy."""

CPU_MOE_EXPERT_US = 14.0
"""On a ``cpu`` spec, in forward: what each routed expert a MoE block's tokens reach costs
the host beyond the per-op model (``min(n_experts, tokens x top_k)`` per bank call, at
balanced load). transformers' grouped GEMM on a CPU runs one small GEMM per expert and
group (up, down), on expert weights fetched cold, plus its per-group dispatch; the bmm
that stands in for it (``moe.balanced_forward``) is charged as one kernel at the matmul
rate. Measured with ``CPU_MOE_ROW_US`` by ```python -m tools.bench moe-cpu```: the MoE block's
forward (a measured profile, one thread, the thread's CPU clock) less its analytic charge, less
the same for its dense twin (what the two share cancels), on eight Mixtral-shaped configs that
are not the tested ones (hidden 32-128, expert width 32-128, 4-32 experts, top-1 to top-4, 1-1536
routed rows, B*T 1-512, T <= 64), each block the least of 4-7 runs on the shared 2-core box,
least squares over the pair: 14.3 us and 0.51 us (leave-one-out error 209 us rms against
differences of 130-960 us; single runs of the tool, on a busy box, gave 13.9-15.6 us and
0.28-0.60 us). Not charged in backward (measured within 25% without)."""

CPU_MOE_ROW_US = 0.5
"""On a ``cpu`` spec, in forward: what each routed row (a token's visit to one expert,
``tokens x top_k`` per bank call) costs the host beyond the per-op model: the routing's
kernels run per row on a CPU (softmax and top-k over a few experts per token, the sort,
the row gathers, the weighting and the un-permute; isolated, one thread, softmax over
(256, 8) took 38 us where its bytes and the kernel overhead charge 5), and the grouped
GEMM's rows run below the square-matmul rate. Measured with ``CPU_MOE_EXPERT_US`` (its
docstring says how)."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)
_aten = torch.ops.aten
# SDPA's CPU flash kernel has no formula of its own; it does the CUDA flash kernel's work.
_SDPA_CPU = _aten._scaled_dot_product_flash_attention_for_cpu
_SDPA_CPU_BWD = _aten._scaled_dot_product_flash_attention_for_cpu_backward
# Ops that only reserve memory: no kernel, no time (the bytes still count as live).
_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


# ---------------------------------------------------------------------------- counts


@dataclass
class PhaseCount:
    """What one segment does in one phase (forward or backward)."""

    flops: int = 0
    """Matmul and attention FLOPs (FlopCounterMode's formulas)."""
    bytes_moved: int = 0
    """Bytes read and written by the ops that launch kernels."""
    kernels: int = 0
    """Ops that launch a kernel (each costs ``KERNEL_OVERHEAD_US``)."""
    free_ops: int = 0
    """Ops without a kernel charged ``CPU_FORWARD_FREE_OP_US`` (cpu spec, forward only)."""
    saved_tensors: int = 0
    """Pack-hook calls charged ``CPU_SAVED_TENSOR_US`` (cpu spec, forward only)."""
    experts_run: int = 0
    """Routed experts given rows, summed over bank calls, charged ``CPU_MOE_EXPERT_US`` (cpu
    spec, forward only)."""
    routed_rows: int = 0
    """Routed (token, expert) rows, summed over bank calls, charged ``CPU_MOE_ROW_US`` (cpu spec,
    forward only)."""
    time_s: float = 0.0
    """Sum over ops of the per-op roofline time plus overhead (plus, cpu spec forward, the eager
    costs)."""
    peak_bytes: int = 0
    """Transient peak above the larger of the live bytes at begin and end."""


@dataclass
class SegmentCount:
    """One segment's counts: the numbers a ``SegmentProfile`` is rounded from."""

    segment: str
    fwd: PhaseCount = field(default_factory=PhaseCount)
    bwd: PhaseCount = field(default_factory=PhaseCount)
    saved_bytes: int = 0
    """Saved activations, one count per storage, first segment owns it (ledger rule)."""
    saved_tensor_bytes: int = 0
    """Saved activations, one count per storage and segment (what swap moves)."""
    input_bytes: int = 0
    """Storage bytes of the segment's input activation."""


# ---------------------------------------------------------------------------- the counter


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _dense_bytes(t: torch.Tensor) -> int:
    # A broadcast (stride-0) view reads its storage, not numel elements.
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


class _OpCounter(TorchDispatchMode):
    """Charges every aten op to the running (phase, segment) and simulates live bytes."""

    def __init__(self, spec: HardwareSpec, segments: list[str], external: set[int]):
        super().__init__()
        self.spec = spec
        # Running phase ("fwd"/"bwd") and segment; moved by begin().
        self.phase, self.segment = "fwd", PRE
        self.counts = {s: SegmentCount(s) for s in segments}
        # A cpu spec's forward charges the host's eager costs (CPU_FORWARD_FREE_OP_US,
        # CPU_SAVED_TENSOR_US); muted while our own pack hook detaches a saved tensor,
        # whose cost is in CPU_SAVED_TENSOR_US.
        self.cpu = spec.kind == "cpu"
        self.muted = False
        # Simulated allocator: storage key (_cdata) → weakref that un-counts it on death.
        self.external = external  # parameters, gradient buffers, token ids: never counted
        self.tracked: dict[int, weakref.ref] = {}
        self.live_bytes = 0
        self.base_bytes = 0  # live bytes at the running segment's begin
        self.top_bytes = 0  # highest live bytes since that begin

    # -- segments

    def begin(self, phase: str, segment: str) -> None:
        self.phase, self.segment = phase, segment
        self.base_bytes = self.top_bytes = self.live_bytes

    def end(self) -> None:
        c = self._phase_count()
        # Same rule as profile.measure: the peak above the larger end of the segment.
        c.peak_bytes = max(c.peak_bytes, self.top_bytes - max(self.base_bytes, self.live_bytes))

    def _phase_count(self) -> PhaseCount:
        seg = self.counts[self.segment]
        return seg.fwd if self.phase == "fwd" else seg.bwd

    # -- ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = _tensors(out)
        for t in outs:
            self._track(t)
        if not self._free(func, args, kwargs, outs):
            self._charge(func, args, kwargs, out, outs)
        elif self.cpu and self.phase == "fwd" and not self.muted:
            c = self._phase_count()
            c.free_ops += 1
            c.time_s += CPU_FORWARD_FREE_OP_US * 1e-6
        return out

    def saved(self) -> None:
        """A tensor saved for backward: on a cpu spec the executor's ledger hook runs for it."""
        if self.cpu and self.phase == "fwd":
            c = self._phase_count()
            c.saved_tensors += 1
            c.time_s += CPU_SAVED_TENSOR_US * 1e-6

    def routed(self, n_tokens: int, top_k: int, n_experts: int) -> None:
        """A routed expert bank runs (``moe.balanced_experts``): on a cpu spec, its host costs."""
        if self.cpu and self.phase == "fwd" and not self.muted:
            rows = n_tokens * top_k
            experts = min(n_experts, rows)  # at balanced load, every expert a row reaches
            c = self._phase_count()
            c.experts_run += experts
            c.routed_rows += rows
            c.time_s += (experts * CPU_MOE_EXPERT_US + rows * CPU_MOE_ROW_US) * 1e-6

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.tracked or key in self.external:
            return
        nbytes = storage.nbytes()

        def dead(_ref, key=key, nbytes=nbytes):
            self.live_bytes -= nbytes
            self.tracked.pop(key, None)

        # The storage's Python object lives exactly as long as the StorageImpl, so the
        # callback fires when the last tensor (view, saved variable, grad) lets go.
        self.tracked[key] = weakref.ref(storage, dead)
        self.live_bytes += nbytes
        self.top_bytes = max(self.top_bytes, self.live_bytes)

    @staticmethod
    def _free(func, args, kwargs, outs) -> bool:
        """Ops that only make metadata or reserve memory launch no kernel."""
        if func.is_view or func._overloadpacket.__name__ in _ALLOCATIONS:
            return True
        if func._schema.is_mutable:
            return False  # in-place: aliases its input but does the work
        # e.g. _unsafe_view, alias: every output is an input's storage.
        ins = {t.untyped_storage()._cdata for t in _tensors((args, kwargs))}
        return bool(outs) and all(t.untyped_storage()._cdata in ins for t in outs)

    def _charge(self, func, args, kwargs, out, outs) -> None:
        packet = func._overloadpacket
        ins = _tensors((args, kwargs))
        if packet is _SDPA_CPU:
            flops = sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape)
        elif packet is _SDPA_CPU_BWD:
            flops = sdpa_backward_flop_count(
                args[0].shape, args[1].shape, args[2].shape, args[3].shape
            )
        elif packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
        else:
            flops = 0
        nbytes = sum(_dense_bytes(t) for t in ins) + sum(_dense_bytes(t) for t in outs)
        dtype = next((t.dtype for t in ins if t.is_floating_point()), None)
        rate = (
            self.spec.matmul_flops_per_s
            if dtype in _SIXTEEN_BIT
            else self.spec.matmul_fp32_flops_per_s
        )
        c = self._phase_count()
        c.flops += flops
        c.bytes_moved += nbytes
        c.kernels += 1
        # Roofline per op, then the fixed per-kernel cost.
        c.time_s += (
            max(flops / rate, nbytes / self.spec.mem_bytes_per_s) + KERNEL_OVERHEAD_US * 1e-6
        )


class _FusedKernels(TorchFunctionMode):
    """Runs SDPA as the flash kernel (and dropout as CUDA's on a GPU spec); see the module
    docstring."""

    def __init__(self, gpu: bool):
        super().__init__()
        self.gpu = gpu

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._sdpa(*args, **kwargs)
        if func is F.dropout and self.gpu:
            x, p, training = _dropout_args(*args, **kwargs)
            if training and 0.0 < p < 1.0:
                return torch.native_dropout(x, p, True)[0]
        return func(*args, **kwargs)

    @staticmethod
    def _sdpa(
        q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        if enable_gqa and k.size(-3) != q.size(-3):
            groups = q.size(-3) // k.size(-3)
            k = k.repeat_interleave(groups, dim=-3)
            v = v.repeat_interleave(groups, dim=-3)
        dv = v.size(-1)
        if dv != q.size(-1):
            # The flash kernel takes one head size for q, k and v; MLA (DeepSeek) has narrower
            # value heads. Padding v with zeros counts the P @ V product at q's head size (an
            # over-estimate of (d_q - d_v) / d_v on that one matmul) and the same memory.
            v = F.pad(v, (0, q.size(-1) - dv))
        return _SDPA_CPU(q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0][..., :dv]


def _dropout_args(input, p=0.5, training=True, inplace=False):
    return input, p, training


# ---------------------------------------------------------------------------- counting


def count_segments(
    model: nn.Module,
    *,
    blocks: list[str],
    micro_batch: int,
    seq_len: int,
    compute_dtype: str,
    spec: HardwareSpec,
) -> list[SegmentCount]:
    """Run one training step of ``model`` (on meta) and return its counts per segment.

    The model is not changed: its parameters are replaced, for this call only, by
    ``compute_dtype`` copies (``torch.func.functional_call``) whose gradient buffers are
    preset, so gradients accumulate in place as into the executor's chunks.
    """
    if compute_dtype not in DTYPES:
        raise ConfigError(f"compute dtype {compute_dtype!r} is not one of {', '.join(DTYPES)}")
    dtype = DTYPES[compute_dtype]
    modules = dict(model.named_modules())
    for b in blocks:
        if b not in modules:
            raise ConfigError(
                f"block {b!r} is not a module of the model", "check the block paths (`--blocks`)"
            )
    if any(p.device.type != "meta" for p in model.parameters()):
        raise ConfigError(
            "analytic profiling needs the model on the meta device",
            "build it with `build(name, device='meta')`, or measure it with `protrain profile`",
        )

    params: dict[str, torch.Tensor] = {}
    for n, p in model.named_parameters():
        q = p.detach().to(dtype) if p.is_floating_point() else p.detach()
        if p.requires_grad:
            q.requires_grad_(True)
            q.grad = torch.zeros_like(q)
        params[n] = q
    idx = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")  # (B, T)
    # Targets in their own storage, as the data loader gives them: <post> saves them.
    targets = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")  # (B, T)
    external = {t.untyped_storage()._cdata for t in (idx, targets)}
    for q in params.values():
        external.add(q.untyped_storage()._cdata)
        if q.grad is not None:
            external.add(q.grad.untyped_storage()._cdata)
    param_storages = {q.untyped_storage()._cdata for q in params.values()}

    segments = [PRE, *blocks, POST]
    counter = _OpCounter(spec, segments, external)
    counter.counts[PRE].input_bytes = idx.untyped_storage().nbytes()
    owner: dict[int, str] = {}  # saved storage → the segment that counted it
    moved: set[tuple[str, int]] = set()  # (segment, saved storage) counted in saved_tensor_bytes

    def pack(t: torch.Tensor):
        counter.saved()
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in param_storages:
            seg = counter.counts[counter.segment]
            if (counter.segment, key) not in moved:
                moved.add((counter.segment, key))
                seg.saved_tensor_bytes += storage.nbytes()
            if key not in owner:
                owner[key] = counter.segment
                seg.saved_bytes += storage.nbytes()
        counter.muted = True  # the executor's hook detaches too: in CPU_SAVED_TENSOR_US
        try:
            return t.detach()  # not t: a saved output must not point back at its grad_fn
        finally:
            counter.muted = False

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    # Forward: block hooks move the segment; backward: Boundary callbacks do (the executor's own
    # Function).
    last = len(blocks) - 1

    def pre_hook(i: int, name: str):
        def hook(_m, args, kwargs):
            if counter.phase != "fwd":
                return None
            counter.end()
            counter.begin("fwd", name)
            x, put = block_input(args, kwargs)  # HF blocks may take it as hidden_states=
            counter.counts[name].input_bytes = x.untyped_storage().nbytes()
            if not x.requires_grad:
                return None

            def after():  # gradient w.r.t. the block's input exists: its backward is over
                counter.end()
                counter.begin("bwd", blocks[i - 1] if i else PRE)

            return put(Boundary.apply(after, x))

        return hook

    def post_hook(i: int, name: str):
        def hook(_m, _args, output):
            if counter.phase != "fwd":
                return None
            y, put = first_tensor(output)
            if i == last:
                counter.end()
                counter.begin("fwd", POST)
                counter.counts[POST].input_bytes = y.untyped_storage().nbytes()
            if not y.requires_grad:
                return None

            def before():  # the output's gradient is complete: the block's backward starts
                if i == last:
                    counter.end()
                    counter.begin("bwd", name)

            return put(Boundary.apply(before, y))

        return hook

    handles = []
    for i, b in enumerate(blocks):
        handles.append(modules[b].register_forward_pre_hook(pre_hook(i, b), with_kwargs=True))
        handles.append(modules[b].register_forward_hook(post_hook(i, b)))
    try:
        with (
            balanced_experts(model, on_bank=counter.routed),
            _FusedKernels(gpu=spec.kind == "gpu"),
            counter,
        ):
            counter.begin("fwd", PRE)
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                loss = torch.func.functional_call(model, params, (idx, targets))
            counter.end()
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ConfigError("the model's forward(idx, targets) must return the scalar loss")
            counter.begin("bwd", POST)
            loss.backward()
            del loss
            counter.end()
    finally:
        for h in handles:
            h.remove()
    return [counter.counts[s] for s in segments]


# ---------------------------------------------------------------------------- profiles


def parameter_trace(model: nn.Module, blocks: list[str], seq_len: int) -> ExecutionGraph:
    """The trace ``analytic_profile`` reads the parameters' uses from (as emit.model_facts
    traces)."""
    with balanced_experts(model):  # the trace runs the model too (on meta)
        return trace(model, blocks, seq_len=min(seq_len, 8))


def analytic_profile(
    model: nn.Module,
    *,
    name: str,
    blocks: list[str],
    micro_batch: int,
    seq_len: int,
    compute_dtype: str,
    spec: HardwareSpec,
    progress: Callable[[int, int], None] | None = None,
    graph: ExecutionGraph | None = None,
) -> Profile:
    """Estimate the Profile of ``model`` (built on meta) on the machine ``spec`` describes.

    Same fields and units as a measured profile; see the module docstring for how each
    number is made. ``progress(done, total)`` is called after each of the two passes
    (parameter trace, counted training step). ``graph``: ``parameter_trace(model, blocks,
    seq_len)`` where the caller has it (the micro-batches of one model share it).
    """
    graph = parameter_trace(model, blocks, seq_len) if graph is None else graph
    if progress is not None:
        progress(1, 2)
    counts = count_segments(
        model,
        blocks=blocks,
        micro_batch=micro_batch,
        seq_len=seq_len,
        compute_dtype=compute_dtype,
        spec=spec,
    )
    if progress is not None:
        progress(2, 2)
    named = dict(model.named_parameters())
    params = [
        ParamInfo(
            name=n,
            shape=list(named[n].shape),
            dtype=str(named[n].dtype).removeprefix("torch."),
            uses=[s for s in graph.segments if n in graph.uses[s]],
            frozen=not named[n].requires_grad,
        )
        for n in graph.order
    ]
    return Profile(
        profile_version=PROFILE_VERSION,
        source="analytic",
        generator=generator(),
        model=ProfileModel(
            name=name,
            fingerprint=model_fingerprint(model, blocks),
            n_params=sum(p.numel() for p in model.parameters()),
            blocks=list(blocks),
            tied=tied_pairs(model),
        ),
        training=ProfileTraining(
            micro_batch=micro_batch, seq_len=seq_len, compute_dtype=compute_dtype
        ),
        device=f"analytic:{spec.name}",
        attention="sdpa (analytic)",
        bootstrap=False,
        iterations=0,
        segments=[_segment_profile(c, spec) for c in counts],
        params=params,
        hardware=spec,
    )


def _segment_profile(c: SegmentCount, spec: HardwareSpec) -> SegmentProfile:
    # A CPU "device" has no allocator to observe: measured CPU profiles and the CPU
    # ledger carry no transients (profile.py), so neither does an analytic one.
    cpu = spec.kind == "cpu"
    return SegmentProfile(
        segment=c.segment,
        fwd_us=round(c.fwd.time_s * 1e6),
        bwd_us=round(c.bwd.time_s * 1e6),
        saved_bytes=c.saved_bytes,
        saved_tensor_bytes=c.saved_tensor_bytes,
        input_bytes=c.input_bytes,
        fwd_peak_bytes=0 if cpu else c.fwd.peak_bytes,
        bwd_peak_bytes=0 if cpu else c.bwd.peak_bytes,
    )


_SCALED = (
    "fwd_us",
    "bwd_us",
    "saved_bytes",
    "saved_tensor_bytes",
    "input_bytes",
    "fwd_peak_bytes",
    "bwd_peak_bytes",
)


def scale_profile(
    measured: Profile, *, micro_batch: int, seq_len: int, model: nn.Module | None = None
) -> Profile:
    """``measured`` rescaled to another (micro_batch, seq_len); ``source`` becomes ``analytic``.

    Without ``model``: every time and activation size is scaled linearly in tokens
    (``B*T``). That ignores attention's ``T^2`` FLOPs (time is under-estimated when T
    grows: the error is about the attention share of the segment), per-kernel fixed
    costs (over-estimated when the shape grows from a small one), and the few
    activations that scale with T alone (GPT-2's position ids, a handful of bytes).

    With ``model`` (the same model, on meta): each number is scaled by the ratio of
    the analytic estimates at the two shapes (``count_segments`` on the measured
    profile's hardware), which carries the ``T^2`` part, the fixed costs and the
    exact activation structure, while keeping the measured device's level.
    """
    old = measured.training
    if model is None:
        ratio = (micro_batch * seq_len) / (old.micro_batch * old.seq_len)

        def scaled(_i: int, key: str, value: int) -> int:
            return round(value * ratio)
    else:
        kw = dict(
            blocks=measured.model.blocks, compute_dtype=old.compute_dtype, spec=measured.hardware
        )
        if model_fingerprint(model, measured.model.blocks) != measured.model.fingerprint:
            raise ConfigError(
                f"the model given to scale_profile is not the profiled {measured.model.name}",
                "pass the model the profile was measured for",
            )
        before = [
            _segment_profile(c, measured.hardware)
            for c in count_segments(model, micro_batch=old.micro_batch, seq_len=old.seq_len, **kw)
        ]
        after = [
            _segment_profile(c, measured.hardware)
            for c in count_segments(model, micro_batch=micro_batch, seq_len=seq_len, **kw)
        ]
        tokens = (micro_batch * seq_len) / (old.micro_batch * old.seq_len)

        def scaled(i: int, key: str, value: int) -> int:
            a, b = getattr(before[i], key), getattr(after[i], key)
            return round(value * (b / a if a else tokens))

    segments = [
        msgspec.structs.replace(s, **{k: scaled(i, k, getattr(s, k)) for k in _SCALED})
        for i, s in enumerate(measured.segments)
    ]
    return msgspec.structs.replace(
        measured,
        source="analytic",
        segments=segments,
        training=ProfileTraining(
            micro_batch=micro_batch, seq_len=seq_len, compute_dtype=old.compute_dtype
        ),
    )
