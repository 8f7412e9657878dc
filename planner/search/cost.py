"""Runtime and peak-memory models of one configuration (ProTrain, arXiv 2406.08334 App. A).

A configuration is ``(n_persist, n_buffer, n_swap, n_checkpoint)`` on a fixed chunk
layout. The first ``n_persist`` chunks (execution order) are persistent; blocks
get policies by ``block_policies``. Everything here works on numpy arrays over a
grid of ``(n_swap, n_checkpoint)`` for one ``(n_persist, n_buffer)``, so the
search (``exhaustive.py``) evaluates the whole space in a few hundred array passes and
``predict`` is the same code on a 1×1 grid (one model, no twin to drift).

The same code evaluates configurations outside the paper's space (the MILP's,
``milp.py``): any set of persistent chunks (``Placement``) and any per-block strip
(``strips_grid``, ``predict_plan``). Nothing below assumes a prefix or the
``S C C … K K`` layout; for those the numbers are the paper-space ones, bit for bit.

Time (µs) — paper Eq. 2: ``T_iter = T_fwd + max(T_bwd + T_gpu_optim, T_cpu_optim)``,
with ``T_cpu_optim`` replaced by when the CPU worker actually finishes (see
[CPU Adam timeline] in ``evaluate``). That is the plan's ``during_backward``
schedule; ``after_backward`` (clipping, fp16) starts every CPU step after backward:
``T_iter = T_fwd + T_bwd + max(T_gpu_optim, T_cpu_optim)`` (from when the last
gradients land, if that is later than the end of backward).
Per segment ``s`` of forward (``<pre>``, blocks, ``<post>``):
``t_fwd(s) = max(comp_fwd(s), up(s+1), swap_out(s), (up(s+1) + swap_out(s)) / LINK_DUPLEX)``
— the schedule prefetches the next segment's chunks while ``s`` computes
(one-segment pipeline); uploads go H2D while swap-outs go D2H, two directions of
one link that do not add up to twice one direction (see ``LINK_DUPLEX``).
The first segment's uploads are not hidden. Backward, in reverse:
``t_bwd(s) = max(comp_bwd(s) + recompute(s), h2d(s), grad_offload(s),
(h2d(s) + grad_offload(s)) / LINK_DUPLEX)``
with ``h2d(s) = refetch(next) + swap_in(next)``: swap-ins share the H2D lane with chunk re-fetches
(the paper's "contention for shared resources" — here literally summed on the lane), and the H2D
lane shares the link with the gradient offloads going D2H. Gradient offloads never share the D2H
lane with swap-outs: a swap-out ends within its own forward segment (the segment lasts at least as
long), and gradients go down only in backward. On a ``cpu`` device every copy is synchronous, so the
max becomes a sum.

Transfer counts are an upper bound of what ``emit.build_schedule`` issues
(tested): a chunk is uploaded when a segment uses it and the previous segment did
not; in backward, the ``n_buffer`` offloaded chunks used last in forward are still
resident and their first backward use is free.

Peak memory (bytes) — paper Eqs. 8–11, walked step by step in the executor's own
accounting (plans/accounting.py, reading plans/homes.py): persistent chunk states + resident buffers
+ live offloaded gradient buffers + activations held + (GPU) recomputed activations of the
checkpointed block being run + (GPU) the segment's transient peak, all × ``alpha`` (fragmentation)
on GPU. Activations held after forward segment ``s``: ``saved_bytes`` for keep blocks and the
non-block segments, ``input_bytes`` for checkpointed blocks, nothing for swapped ones, which come
back (``saved_tensor_bytes``) one segment ahead of their backward. On a GPU a swapped block's
activations leave the device only when their D2H copy completes; the copy overlaps the next segment,
so they are charged (``saved_bytes``, what keeping them would hold) during their own forward segment
and the next one (``swap_out`` in ``MemoryTerms``). On a ``cpu`` device the copies are synchronous:
nothing in flight.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from protrain.plans import accounting as A
from protrain.plans import homes as H

from ..hardware.datasheets import ADAM_BYTES_PER_PARAM
from ..hardware.spec import link_bandwidth
from ..profiling.profile import Profile
from . import host_tiers, memory_walk
from .grid import (  # noqa: F401  (re-exported: the search and tools use them from here)
    SWAP_OVERHEAD_US,
    GridTerms,
    PolicyGrid,
    grid_codes,
    grid_terms,
    policy_grid,
    strips_grid,
)
from .host_tiers import homeless_order  # noqa: F401  (re-exported: the search names chunks by it)
from .layout import (  # noqa: F401  (re-exported: the chunk size's choice, which tools and tests read here)
    CHUNK_GRID,
    MIN_CHUNKS,
    choose_chunk_numel,
    chunk_candidates,
    chunk_need,
    chunk_trainable,
)
from .memo import last_call
from .placement import (  # noqa: F401  (re-exported: the search and the MILP use them from here)
    Placement,
    fixed_terms,
    host_bytes_per_chunk,
    min_buffers,
    offload_mask,
    persist_bytes_per_chunk,
    placed,
    placement_memory,
    trains,
)
from .policy_layout import block_policies  # noqa: F401  (re-exported: the search and the MILP use it)
from .rules import HOST_SLOTS, ModelFacts, facts_from_profile  # noqa: F401  (re-exported: the search reads facts here)
from .terms import Terms

DTYPE_BYTES = A.DTYPE_BYTES
ALPHA_GPU = memory_walk.ALPHA_GPU


LINK_DUPLEX = 1.45
"""Bytes a host link moves with copies running both ways at once, as a multiple of what it
moves one way: the two directions of a segment's copies (H2D uploads and swap-ins, D2H
swap-outs and gradient offloads) take at least ``(t_h2d + t_d2h) / LINK_DUPLEX`` together,
each at its one-way rate. PCIe is full duplex on paper (2.0); measured it is not.
nvbandwidth's ``host_to_device_bidirectional_memcpy_ce`` times H2D while a D2H copy
runs: on PCIe Gen4 x16, an A100 PCIe moves 25-26 GB/s one way and 12-13 H2D + 24 D2H
both ways (NVIDIA/nvbandwidth#11), an A100-SXM4 ~11 H2D + ~25 D2H (nvbandwidth#53):
(12.5 + 24) / 25.5 = 1.43; eight RTX 4090s 24-26 one way, 11-16 H2D both ways
(nvbandwidth#15; D2H not shown). One Gen5 host (RTX 5090, Xeon 8458P) keeps 51 of
56 GB/s H2D both ways (tinygrad/open-gpu-kernel-modules#29), closer to 2: for a Gen5
card this over-charges a link-bound segment (never a compute-bound one, where the max
is the compute). Under ZeRO-3 ``t_up``/``t_down`` include the collective, charged on
the link too (exact for GeForce cards, whose NCCL goes through host memory; a small
over-charge over NVLink). TODO(#17): probe the bidirectional rate
(``protrain hardware probe``) and carry it in the spec."""


def segment_bytes(profile: Profile) -> memory_walk.SegmentBytes:
    """The profile's activation bytes per segment, as ``plans/accounting.py`` takes them."""
    segs = profile.segments
    return memory_walk.SegmentBytes(
        saved=[x.saved_bytes for x in segs],
        swapped=[x.saved_tensor_bytes for x in segs],
        inputs=[x.input_bytes for x in segs],
        fwd_peak=[x.fwd_peak_bytes for x in segs],
        bwd_peak=[x.bwd_peak_bytes for x in segs],
        gpu=profile.hardware.kind == "gpu",
    )


def collective_bandwidth(spec, size_bytes: int) -> float:
    """Bus bandwidth of all-gather / reduce-scatter between ranks (bytes/s); a spec
    without one (a CPU box, gloo over loopback) falls back to its copy link."""
    return float(spec.allgather_bytes_per_s) or link_bandwidth(spec, size_bytes, "h2d")


def make_terms(
    profile: Profile,
    chunk_numel: int,
    world_size: int = 1,
    cpu_adam: str = "during_backward",
    grad_accum: int = 1,
    shard_persistent: bool | None = None,
    nvme: bool = False,
    facts: ModelFacts | None = None,
) -> Terms:
    """Precompute the model's terms for one chunk size and world size (ZeRO-3 per rank),
    for the plan's ``cpu_adam`` schedule (``emit.cpu_adam_schedule``) and persistent
    optimizer states sharded over the ranks or not (default: sharded when the world
    size is above 1, as ``emit.assemble`` writes plans). ``nvme``: the plan may keep
    chunks' states on disk (the spec's disk figures must be measured). ``facts``:
    ``facts_from_profile(profile)``, where the caller has them."""
    assert cpu_adam in ("during_backward", "after_backward"), cpu_adam
    facts = facts_from_profile(profile) if facts is None else facts
    need, per_chunk, ends = chunk_need(facts, chunk_numel)
    train = chunk_trainable(facts, chunk_numel)
    S, C = len(need), len(per_chunk)
    spec = profile.hardware
    su = H.Setup(profile.training.compute_dtype, grad_accum)  # the homes table's bytes per element
    eb = memory_walk.element_bytes(profile.training.compute_dtype, grad_accum)
    cb = eb.compute
    W = world_size
    shard = W > 1 and (shard_persistent is None or shard_persistent)
    # Device buffers are padded to W shards (executor/dist.py [Note: sharding]).
    chunk_numel = H.padded_numel(chunk_numel, W)
    chunk_bytes = chunk_numel * cb
    shard_bytes = chunk_bytes // W
    coll = collective_bandwidth(spec, chunk_bytes)
    gather_us = (
        (W - 1) / W * chunk_bytes / coll * 1e6
    )  # all-gather (fetch) or reduce-scatter (grads)
    up_fwd = np.zeros((S, C), dtype=np.int64)
    up_bwd = np.zeros((S, C), dtype=np.int64)
    offload_at = np.zeros((S, C), dtype=np.int64)
    grad_live = np.zeros((S, C), dtype=np.int64)
    uses = np.zeros((S, C), dtype=np.int64)
    last_fwd = np.zeros(C, dtype=np.int64)
    for s in range(S):
        for c in need[s]:
            uses[s, c] = 1
            if s == 0 or c not in need[s - 1]:
                up_fwd[s, c] = 1
            if s == S - 1 or c not in need[s + 1]:
                up_bwd[s, c] = 1  # backward runs s+1 before s
            last_fwd[c] = max(last_fwd[c], s)
    for c in range(C):
        used = [s for s in range(S) if c in need[s]]
        first_bwd, last_bwd = (max(used), min(used)) if used else (0, 0)
        offload_at[last_bwd, c] = 1  # backward order: the smallest index is reached last
        if used and (train is None or train[c]):  # unused or frozen: no gradient buffer, no offload
            grad_live[last_bwd : first_bwd + 1, c] = 1
        if train is not None and not train[c]:
            offload_at[last_bwd, c] = 0
    # A parameter two segments use (a tied embedding and head): its gradient is held from
    # the end of the later one's backward to the end of the earlier one's (accounting.tied_spans).
    segs_of: dict[str, list[int]] = {}  # parameter → the segments using it, in forward order
    for s, seg in enumerate(facts.segments):
        for n in set(facts.uses[seg]):
            segs_of.setdefault(n, []).append(s)
    shared = np.zeros(S)
    held = {n: math.prod(shape) * cb for n, shape, _ in facts.params if n not in facts.frozen}
    for first, last, nbytes in A.tied_spans(segs_of, held):
        shared[first:last] += nbytes
    segs = profile.segments
    arr = lambda f: np.array([getattr(x, f) for x in segs], dtype=np.float64)  # noqa: E731
    big = 64 * 2**20
    disk_rw = H.NVME.step_disk_bytes()
    return Terms(
        chunk_numel=chunk_numel,
        n_chunks=C,
        n_blocks=len(profile.model.blocks),
        chunk_bytes=chunk_bytes,
        chunk_params=per_chunk if train is None else per_chunk * train,  # (what steps)
        state_bytes_per_elem=eb.persistent,
        host_bytes_per_elem=eb.host,
        host_scratch_bytes=H.host_scratch_bytes(su, shard_bytes // cb),
        gpu=spec.kind == "gpu",
        comp_fwd=arr("fwd_us"),
        comp_bwd=arr("bwd_us"),
        saved=arr("saved_bytes"),
        saved_tensor=arr("saved_tensor_bytes"),
        inputs=arr("input_bytes"),
        fwd_peak=arr("fwd_peak_bytes"),
        bwd_peak=arr("bwd_peak_bytes"),
        up_fwd=up_fwd,
        up_bwd=up_bwd,
        offload_at=offload_at,
        grad_live=grad_live,
        uses=uses,
        shared_grads=shared,
        last_fwd_use=last_fwd,
        # A fetch uploads the own shard, then all-gathers; gradients reduce-scatter, then
        # the own shard goes down. With W = 1 both collectives cost nothing.
        t_up=shard_bytes / link_bandwidth(spec, shard_bytes, "h2d") * 1e6 + gather_us,
        t_down=shard_bytes / link_bandwidth(spec, shard_bytes, "d2h") * 1e6 + gather_us,
        world_size=W,
        # A persistent chunk's gradients: an all-reduce (replicated states), or (sharded) a
        # reduce-scatter and, after the step, an all-gather of the values: the same ring
        # traffic, 2 (W-1)/W of a chunk. Sharded, each rank steps 1/W of the chunk.
        allreduce_us_per_chunk=2 * gather_us,
        shard_persistent=shard,
        persist_chunk_bytes=H.PERSISTENT.nbytes(
            su, "device", chunk_numel, chunk_numel // (W if shard else 1)
        ),
        swap_out_us_per_byte=1e6 / link_bandwidth(spec, big, "d2h"),
        swap_in_us_per_byte=1e6 / link_bandwidth(spec, big, "h2d"),
        cpu_adam_us_per_param=1e6 / spec.cpu_adam_params_per_s / W,  # each rank steps its shard
        dev_adam_us_per_param=1e6 / spec.dev_adam_params_per_s / (W if shard else 1),
        cpu_adam=cpu_adam,
        homeless_ok=H.HOMELESS.refusal(su, cpu_adam) is None,
        home_bytes_per_elem=H.HOST.per_elem(su, "host") - H.HOMELESS.per_elem(su, "host"),
        # Host elements of each offloaded chunk per rank (homes.own_numel): its shard, or at
        # one rank the chunk up to its last parameter (rounded up to VEC_ALIGN), not its padding.
        host_numel=np.array(
            [H.own_numel(chunk_numel, W, int(e)) for e in ends], dtype=np.int64
        ).reshape(C),
        slot_pool_bytes=HOST_SLOTS * shard_bytes,
        homed_ok=H.DEVICE_HOMED.refusal(su, cpu_adam) is None,
        homed_bytes_per_elem=H.DEVICE_HOMED.per_elem(su, "device"),
        homed_scratch_bytes=H.device_scratch_bytes(shard_bytes // cb),
        homed_adam_us_per_param=1e6 / spec.dev_adam_params_per_s / W,
        nvme_ok=nvme and spec.disk_read_bytes_per_s > 0 and spec.disk_write_bytes_per_s > 0,
        disk_saves_per_elem=H.HOST.per_elem(su, "host") - H.NVME.per_elem(su, "host"),
        disk_step_us_per_elem=(
            disk_rw[0] * 1e6 / spec.disk_read_bytes_per_s
            + disk_rw[1] * 1e6 / spec.disk_write_bytes_per_s
            if nvme and spec.disk_read_bytes_per_s and spec.disk_write_bytes_per_s
            else 0.0
        ),
        disk_fetch_us_per_elem=(
            H.NVME.fetch_disk_bytes() * 1e6 / spec.disk_read_bytes_per_s
            if nvme and spec.disk_read_bytes_per_s
            else 0.0
        ),
        disk_fetch_with_home=H.NVME.fetch_reads_disk(su),
        trainable=train,
        frozen_persist_bytes=H.PERSISTENT.nbytes(
            su, "device", chunk_numel, chunk_numel, trainable=False
        ),
        frozen_host_bytes_per_elem=H.HOST.per_elem(su, "host", trainable=False),
        # Reading fp32 and writing the compute dtype is memory-bound, like the fused CPU AdamW
        # whose rate the specs derive from host DRAM bandwidth at ADAM_BYTES_PER_PARAM (28 B
        # per parameter; planner/hardware/datasheets.py): the same bandwidth moves (4 + cb) B per
        # element.
        convert_us=shard_bytes
        // cb
        * H.HOMELESS.fetch_host_bytes(su)
        / (spec.cpu_adam_params_per_s * ADAM_BYTES_PER_PARAM)
        * 1e6,
    )


_LAST_WALK: list = [None]
"""``(g, grads bytes, walk)`` of the last ``_walk``: a search evaluates one placement at several
buffer counts in a row, and the walk does not depend on the buffers."""


def _walk(g: GridTerms, grads: np.ndarray) -> np.ndarray:
    """The memory walk's highest step per strip (grid_terms: the rest of each step), (G,),
    read-only; the last one again for the same strip terms and gradient buffers."""

    def make() -> np.ndarray:
        walk = np.maximum(g.fwd_walk, (g.bwd_base + grads).max(axis=1))
        walk.flags.writeable = False
        return walk

    return last_call(_LAST_WALK, g, grads.tobytes(), make)


def evaluate(
    t: Terms,
    persist: Placement,
    n_buffer: int,
    grid: PolicyGrid,
    host_cap: float = math.inf,
    homeless: Sequence[int] | None = None,
    homed: Sequence[int] = (),
    nvme: Sequence[int] = (),
    *,
    time_only: bool = False,
) -> tuple[np.ndarray, np.ndarray, dict]:
    """Iteration time (µs) and peak memory (bytes) for every policy strip of ``grid``.

    ``persist`` is a count (the paper's prefix) or any set of persistent chunk ids;
    the grid holds any strips (``policy_grid`` for the paper's, ``strips_grid`` for
    others). Returns ``(time, peak, parts)``; ``parts`` holds the named terms (arrays
    over the grid) that ``predict`` reports as the breakdown. ``homeless``: the plan's
    homeless chunks; None: the fewest (in ``homeless_order``) that bring the host need
    under ``host_cap``, per strip ([Homeless chunks]), and where even every offloaded chunk
    homeless does not, the fewest device-homed ones or chunks on disk
    (planner/search/host_tiers.py).
    ``homed``, ``nvme``: the plan's device-homed chunks and chunks on disk, with ``homeless`` given.
    ``time_only``: the time alone, as ``(time, None, {})`` (the search's bounds).
    """
    C = t.n_chunks
    fixed = fixed_terms(t)
    pl = placed(t, persist, fixed)
    off = pl.off  # (C,) offloaded chunks
    # Chunks still resident when backward starts: the n_buffer offloaded ones used last.
    order = pl.order
    cached = np.zeros(C, dtype=np.int64)
    cached[order[:n_buffer]] = 1

    # -- host memory per rank (paper: none; issue 9): the offloaded chunks' states, and
    # the swapped blocks' saved tensors, all on the host at the forward→backward turn
    # (each block's come back only during backward). Separate terms: the first is what
    # the ledger counts as ``host``, the second lives in the swap's pinned buffers.
    host = pl.host
    g = grid_terms(t, grid)
    host_swap = g.host_swap  # (G,)
    # [Homeless chunks] A homeless chunk keeps no home on the host (home_bytes less) and
    # the plan gains HOST_SLOTS pinned slots (once); each fetch of it rounds its master
    # into a slot on the main thread before the upload is issued, which holds back the
    # segment's compute as much (charged serially, on GPU and CPU alike; backward's also
    # hold back the gradient landings, hence the CPU steps).
    uploads_f = fixed["uploads_f"]  # (C,) forward uploads of each chunk
    uploads_b = np.where(cached > 0, fixed["uploads_b_cached"], fixed["uploads_b"])  # (C,)
    # [Homeless chunks], [Device homes], [NVMe tier]: planner/search/host_tiers.py. Charged for
    # device homes: their device states and one fp32 scratch; their reduce-scatter and step serially
    # inside backward; no CPU step, no conversion; fetches and offloads as a host chunk's (an
    # over-estimate). For the disk: its traffic in the CPU step and in fetches that read it.
    tiers = host_tiers.choose(
        t, pl.trains, host, host_swap, host_cap, uploads_f, uploads_b, homeless, homed, nvme
    )
    k, kd, kn, is_homed, is_nvme = tiers.k, tiers.kd, tiers.kn, tiers.is_homed, tiers.is_nvme
    conv_f, conv_b, host, unhomed = tiers.conv_f, tiers.conv_b, tiers.host, tiers.unhomed
    any_disk = bool(kn.any())
    disk_us = (
        is_nvme * (t.host_numel * t.disk_step_us_per_elem) if any_disk else None
    )  # (G, C) each chunk's step's disk traffic
    any_homed = bool(kd.any())  # (skipped where none: keeping every value is exact)
    if any_homed:
        mask = is_homed.astype(np.float64)
        homed_dev = (
            mask @ (t.host_numel * t.homed_bytes_per_elem) + (kd > 0) * t.homed_scratch_bytes
        )  # (G,)
        homed_params = mask @ t.chunk_params  # (G,)
    else:  # (what the two products give where no chunk is device-homed)
        homed_dev, homed_params = np.zeros(len(kd)), np.zeros(len(kd))

    # -- time, paper Eq. 2 (per-segment pipeline; see module docstring)
    n_up_f, up_f = pl.n_up_f, pl.up_f  # (S,) chunks uploaded for forward segment s, and their time
    # A prefetch needs a free buffer: while segment s holds its own chunks, only
    # n_buffer - in_use(s) uploads for s+1 can run ahead; the rest wait for s to end.
    spare = np.maximum(n_buffer - pl.in_use, 0)  # (S,)
    ahead_f = np.minimum(np.append(n_up_f[1:], 0), spare)
    lane_up_f = ahead_f * t.t_up  # (S,) hidden under segment s (if compute is longer)
    late_f = (np.append(n_up_f[1:], 0) - ahead_f) * t.t_up  # (S,) serialised after segment s
    swap_overhead = g.swap_overhead_us  # (G,)
    # Backward visits s = S-1 … 0; the first backward use of a cached chunk is free.
    refetch = t.up_bwd @ (off * (1 - cached)) * t.t_up  # (S,) at backward segment s
    refetch += (fixed["up_bwd_again"] @ (off * cached)) * t.t_up
    n_ref = refetch / t.t_up if t.t_up > 0 else refetch  # (S,) chunk count
    # While backward segment s computes, the H2D lane carries what segment s-1 needs
    # next: its re-fetched chunks and, if it is a swapped block, its activations.
    ahead_b = np.zeros_like(refetch)
    ahead_b[1:] = np.minimum(n_ref[:-1], spare[1:])  # needs a free buffer too
    late_b = np.zeros_like(refetch)
    late_b[1:] = (n_ref[:-1] - ahead_b[1:]) * t.t_up
    grad_down = pl.grad_down  # (S,) gradients leaving at segment s's end
    if t.gpu:
        # A segment's terms take one of a few values each (grid.grid_codes): computed once per
        # value in a small table, then laid out over the grid (the same values, in the same
        # places, as computing them per strip).
        code_f, code_b = grid_codes(grid)
        swap_out = (
            np.array([[0.0], [1.0]]) * t.saved_tensor * t.swap_out_us_per_byte
        )  # (2, S): not / swapped
        # Each lane alone, and both directions of the link together (LINK_DUPLEX).
        duplex_f = (lane_up_f + swap_out) / LINK_DUPLEX  # (2, S)
        seg_f = np.maximum(np.maximum(t.comp_fwd, lane_up_f), np.maximum(swap_out, duplex_f))
        t_fwd = seg_f.ravel().take(code_f).sum(axis=1) + late_f.sum() + up_f[0] + swap_overhead
        # (4, S): (checkpointed, swapped before) = (0, 0), (0, 1), (1, 0), (1, 1)
        ck, sw = np.array([[0.0], [0.0], [1.0], [1.0]]), np.array([[0.0], [1.0], [0.0], [1.0]])
        comp_b = t.comp_bwd + ck * t.comp_fwd  # with a checkpointed block's forward again
        lane_up_b = np.zeros((4, len(t.comp_fwd)))
        lane_up_b[:, 1:] = (
            ahead_b[None, 1:] * t.t_up + (sw * t.saved_tensor * t.swap_in_us_per_byte)[:, :-1]
        )
        duplex_b = (lane_up_b + grad_down) / LINK_DUPLEX  # (4, S)
        seg_b = np.maximum(np.maximum(comp_b, lane_up_b), np.maximum(grad_down, duplex_b)) + late_b
        seg_b = seg_b.ravel().take(code_b)  # (G, S)
        start_b = refetch[-1]
    else:  # a cpu device copies synchronously: nothing overlaps
        comp_b = g.comp_b  # (G, S) with a checkpointed block's forward again
        t_fwd = t.comp_fwd.sum() + up_f.sum() + g.swap_out_total_us
        seg_b = comp_b + refetch + g.swap_in_us + grad_down  # (G, S)
        start_b = 0.0
    t_bwd = seg_b.sum(axis=1) + start_b
    # Backward runs segment S-1 first: segment s ends at the sum of s..S-1. Row i of done_b is
    # segments S-1 … S-1-i, summed in that order (each strip's running sum, one add at a time).
    done_b = np.cumsum(seg_b[:, ::-1], axis=1).T  # (S, G), a view

    def end_b(cols) -> np.ndarray:
        """When backward segment s ends, for each s of ``cols``: (len(cols), G)."""
        rows = done_b[len(t.comp_fwd) - 1 - np.asarray(cols, dtype=np.int64)]
        return (
            rows if start_b == 0.0 else start_b + rows
        )  # (adding 0.0 to sums of times >= 0 is exact)

    n_params_off = pl.n_params_off
    n_params_dev = fixed["n_params"] - n_params_off
    t_cpu = (n_params_off - homed_params) * t.cpu_adam_us_per_param  # (G,)
    if any_disk:  # (else adding zeros: exact)
        t_cpu = t_cpu + disk_us.sum(axis=1)
    # [Overlapped reductions] Under ZeRO-3 a persistent chunk's gradient reduction (an
    # all-reduce, or sharded a reduce-scatter) starts when backward has ended the first
    # segment using it, one after another on the collective lane, beside backward
    # (executor/engine.py [Note: overlapped reductions]); what is left of them when
    # backward ends delays the device step. Sharded, the all-gather of the updated values
    # follows the step. The lane is charged alone: the offloaded chunks' reduce-scatters
    # (in t_down, on the host link) are not made to wait for it.
    reduce_us = t.reduce_us_per_chunk
    reduced = np.zeros(len(grid.swap))  # when the collective lane is done with them
    offload_steps = fixed[
        "offload_steps"
    ]  # (s, c) of every chunk's gradients leaving, in backward order
    if reduce_us:
        for s, c in offload_steps:
            if not off[c]:
                reduced = np.maximum(reduced, end_b([s])[0]) + reduce_us
    gather_after = pl.n_trains_dev * (t.allreduce_us_per_chunk - reduce_us)
    t_gpu = (
        n_params_dev * t.dev_adam_us_per_param + gather_after + np.maximum(reduced - t_bwd, 0.0)
    )  # (G,) the device's side after backward
    # [CPU Adam timeline] Paper Eq. 2 takes max(T_bwd + T_gpu_optim, T_cpu_optim), as if
    # the CPU steps could all overlap backward. They cannot start before their gradients
    # land: one worker steps the offloaded chunks in offload order, each no earlier than
    # the end of its last backward segment plus its download. So the chunks offloaded
    # last (the first ones in execution order) add their step after backward — the
    # reason the paper keeps the first chunks persistent.
    #
    # With ``cpu_adam == "after_backward"`` (clipping, fp16: every gradient is needed
    # before any update) the worker starts only when backward has ended and the last
    # offloaded gradients have landed, then steps the chunks one after another while
    # the main thread runs the device Adam: T_iter = T_fwd + T_bwd + max(T_gpu_optim,
    # T_cpu_optim), with T_bwd stretched to the last landing when that comes later.
    # Never faster than the overlapped schedule: each chunk's step starts no earlier.
    cpu_done = np.zeros(len(grid.swap))
    landed = np.zeros(len(grid.swap))  # when the last offloaded gradients reach the host
    steps = list(pl.steps)
    if steps:
        # Each chunk's landing, (k, G) in offload order.
        ready_at = end_b(pl.offload_s) + t.t_down
    if steps and t.cpu_adam == "after_backward":  # (the timeline below is replaced then)
        landed = np.maximum(landed, ready_at.max(axis=0))  # (max is exact in any order)
        steps = []
    if steps and not (any_disk or any_homed):  # the loop below, in place
        cpu_us = pl.cpu_us
        for j in range(len(steps)):
            np.maximum(cpu_done, ready_at[j], out=cpu_done)
            cpu_done += cpu_us[j]
        steps = []
    for j, (_s, c) in enumerate(steps):
        stepped = np.maximum(cpu_done, ready_at[j]) + t.chunk_params[c] * t.cpu_adam_us_per_param
        if any_disk:
            stepped = stepped + disk_us[:, c]
        cpu_done = (
            np.where(is_homed[:, c], cpu_done, stepped) if any_homed else stepped
        )  # [Device homes]: no CPU step
    if t.cpu_adam == "after_backward":
        cpu_done = np.where(t_cpu > 0, np.maximum(t_bwd, landed) + t_cpu, 0.0)
    # [Homeless chunks]; [Device homes]: each one's reduce-scatter and step, serially on compute
    if (
        any_homed or conv_f.any() or conv_b.any()
    ):  # (else each add is of zeros and the where keeps all: exact)
        homed_us = homed_params * t.homed_adam_us_per_param + kd * t.allreduce_us_per_chunk / 2
        t_fwd, t_bwd = t_fwd + conv_f, t_bwd + conv_b + homed_us
        cpu_done = np.where(cpu_done > 0, cpu_done + conv_b, 0.0)
    time = t_fwd + np.maximum(t_bwd + t_gpu, cpu_done)
    if time_only:
        return time, None, {}

    # -- peak memory, paper Eqs. 8-11 walked per step as plans/accounting.py streams it
    states, resident, grads, alpha = placement_memory(
        t, off, n_buffer
    )  # (memory_terms without the grid's)
    walk = _walk(g, grads)
    states = states + homed_dev  # [Device homes]
    peak = (states + resident + walk) * alpha
    parts = {
        "t_fwd_us": t_fwd,
        "t_bwd_us": t_bwd,
        "t_cpu_optim_us": t_cpu + np.zeros_like(time),
        "t_cpu_optim_done_us": cpu_done,
        "t_gpu_optim_us": t_gpu + np.zeros_like(time),
        "states_bytes": states + np.zeros_like(time),
        "buffers_bytes": np.full_like(time, resident),
        "activation_walk_bytes": walk,
        "host_bytes": host.astype(np.float64),
        "host_swap_bytes": host_swap,
        "n_homeless": k.astype(np.float64),
        "t_convert_us": conv_f + conv_b,
        "n_device_homed": kd.astype(np.float64),
        "n_nvme": kn.astype(np.float64),
        # what the search reports when nothing fits: the figures without device homes
        "homed_peak_bytes": homed_dev * alpha,
        "unhomed_host_bytes": unhomed + np.zeros_like(time),
    }
    return time, peak, parts


def host_need(parts: dict):
    """Host bytes per rank a configuration needs (``evaluate``'s parts, arrays or floats):
    offloaded chunk states plus swapped activations — what the host budget bounds."""
    return parts["host_bytes"] + parts["host_swap_bytes"]


@dataclass(frozen=True)
class MemoryTerms:
    """The memory walk's terms for one placement, over a policy grid (bytes, before ``alpha``).

    ``evaluate`` takes the walk's maximum; ``memory_plot.memory_walk`` shows it step by step.
    """

    states: float  # persistent chunks' parameters, gradients, masters and moments
    resident: float  # the offloaded chunks' device buffers, reserved for the whole run
    held: np.ndarray  # (G, S) activations held after forward segment s / until its backward
    swap_out: np.ndarray  # (G, S) swapped activations still on the device at forward s (GPU only)
    swapped_in: np.ndarray  # (G, S) swapped activations back on the device at backward s
    grads: np.ndarray  # (S,) offloaded chunks' gradient buffers open at backward s
    shared_grads: np.ndarray  # (S,) gradients autograd holds at backward s (a tied weight's)
    recompute: np.ndarray  # (G, S) a checkpointed block's recomputed activations (GPU only)
    fwd_transient: np.ndarray | float  # (S,) transient peak in forward (0 on CPU)
    bwd_transient: np.ndarray | float  # (S,) transient peak in backward (0 on CPU)
    alpha: float  # fragmentation factor (ALPHA_GPU on GPU, 1 on CPU)


def memory_terms(t: Terms, off: np.ndarray, n_buffer: int, grid: PolicyGrid) -> MemoryTerms:
    """Terms of paper Eqs. 8-11 in ``plans/accounting.py``'s stream; ``off`` marks offloaded chunks.

    [Swap-out in flight] A swapped block's saved tensors stay on the device until their
    D2H copy completes (the copy engine holds them for it). The copies start as block
    s's forward saves them; the last ones are saved as the block ends, so they run on
    into segment s+1's compute. They count during segments s and s+1, at what keeping
    them would hold (``saved_bytes``, the ledger's rule: the block's own storages), and
    are assumed gone after s+1 (the time model gives each swap-out at least its own
    segment, and the search spaces swapped blocks by the swap interval, so the D2H
    lane is free again by then). On a cpu device the copy is synchronous: a swapped
    block's activations are gone when its segment ends, never held. (``grid_terms``.)
    """
    g = grid_terms(t, grid)
    states, resident, grads, alpha = placement_memory(t, off, n_buffer)
    return MemoryTerms(
        states=states,
        resident=resident,
        held=g.held,
        swap_out=g.swap_out_bytes,
        swapped_in=g.swapped_in,
        grads=grads,
        shared_grads=t.shared_grads,
        recompute=g.recompute_bytes,
        fwd_transient=t.fwd_peak if t.gpu else 0.0,
        bwd_transient=t.bwd_peak if t.gpu else 0.0,
        alpha=alpha,
    )


@dataclass(frozen=True)
class Prediction:
    time_us: float
    peak_bytes: float
    breakdown: dict[str, float]


def predict(
    t: Terms,
    n_persist: int,
    n_buffer: int,
    n_swap: int,
    n_checkpoint: int,
    host_cap: float = math.inf,
) -> Prediction:
    """One four-count configuration through the same arrays the search uses (a 1×1 grid),
    with as many homeless chunks as ``host_cap`` asks for ([Homeless chunks])."""
    time, peak, parts = evaluate(
        t, n_persist, n_buffer, policy_grid(t.n_blocks, [(n_swap, n_checkpoint)]), host_cap
    )
    return Prediction(float(time[0]), float(peak[0]), {k: float(v[0]) for k, v in parts.items()})


def predict_plan(
    t: Terms,
    persistent: Placement,
    n_buffer: int,
    policies: Sequence[str],
    homeless: Sequence[int] = (),
    homed: Sequence[int] = (),
    nvme: Sequence[int] = (),
) -> Prediction:
    """Any configuration: persistent chunks anywhere, any policy strip, any homeless chunks,
    device-homed ones and ones on disk (same arrays again)."""
    time, peak, parts = evaluate(
        t,
        persistent,
        n_buffer,
        strips_grid([list(policies)]),
        homeless=homeless,
        homed=homed,
        nvme=nvme,
    )
    return Prediction(float(time[0]), float(peak[0]), {k: float(v[0]) for k, v in parts.items()})
