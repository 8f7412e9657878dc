"""``Terms``: everything the cost models need, precomputed for one profile and chunk size.

``cost.make_terms`` builds them; the grid (``grid``), the placement (``placement``), the
host tiers and the MILP read them. They sit below all of those, so none imports the cost
model for its type.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Terms:
    """Everything the models need, precomputed for one profile and chunk size."""

    chunk_numel: int
    n_chunks: int
    n_blocks: int
    chunk_bytes: int  # compute dtype
    chunk_params: np.ndarray  # (C,) parameter elements in each chunk
    state_bytes_per_elem: int  # persistent: param + grad (compute) + moments (+ master), replicated
    host_bytes_per_elem: (
        int  # offloaded, on the host: home, moments, accumulator (+ master, staging)
    )
    host_scratch_bytes: (
        int  # the CPU step's fp32 gradient scratch, one piece (accounting.scratch_bytes)
    )
    host_numel: (
        np.ndarray
    )  # (C,) host elements of each offloaded chunk per rank (accounting.host_numel)
    gpu: bool
    # Per segment, forward order (S = n_blocks + 2).
    comp_fwd: np.ndarray  # (S,) µs
    comp_bwd: np.ndarray  # (S,) µs
    saved: np.ndarray  # (S,) bytes, ledger rule
    saved_tensor: np.ndarray  # (S,) bytes per tensor (swap traffic)
    inputs: np.ndarray  # (S,) bytes
    fwd_peak: np.ndarray  # (S,) bytes
    bwd_peak: np.ndarray  # (S,) bytes
    # Chunk ↔ segment structure (C chunks).
    up_fwd: np.ndarray  # (S, C) 1 if the chunk is uploaded for forward segment s
    up_bwd: np.ndarray  # (S, C) 1 if first used in backward at segment s (vs. the next one)
    offload_at: np.ndarray  # (S, C) 1 if the chunk's gradients leave at segment s's backward end
    grad_live: np.ndarray  # (S, C) 1 if the chunk's gradient buffer lives at segment s's backward
    uses: np.ndarray  # (S, C) 1 if segment s uses the chunk
    shared_grads: (
        np.ndarray
    )  # (S,) bytes of gradients autograd holds at backward s (accounting.shared_grads)
    last_fwd_use: np.ndarray  # (C,) forward index of the chunk's last use
    # Link times (µs) for one chunk, and per byte of swap traffic.
    t_up: float
    t_down: float
    swap_out_us_per_byte: float
    swap_in_us_per_byte: float
    cpu_adam_us_per_param: float  # per parameter of a chunk (already / world size)
    dev_adam_us_per_param: float  # per parameter of a persistent chunk (/ world size if sharded)
    world_size: int = 1
    allreduce_us_per_chunk: float = (
        0.0  # a persistent chunk's collectives after backward (see make_terms)
    )
    shard_persistent: bool = False  # the plan's placement.shard_persistent_states (world size > 1)
    persist_chunk_bytes: int = (
        0  # device bytes of one trainable persistent chunk (accounting.state_events)
    )
    cpu_adam: str = "during_backward"  # the plan's Schedule.cpu_adam: when CPU steps may start
    # Homeless chunks ([Homeless chunks] in ``evaluate``; executor/chunks.py [Note: host slots]).
    homeless_ok: bool = False  # 16-bit compute, grad_accum 1, CPU steps during backward
    home_bytes_per_elem: int = 0  # an offloaded chunk's home, per host element: what homeless saves
    slot_pool_bytes: int = (
        0  # the HOST_SLOTS pinned slots of one shard: what any homeless chunk adds
    )
    convert_us: float = 0.0  # rounding one shard's fp32 master into a slot, at each fetch
    # Device-homed chunks ([Device homes] in ``evaluate``; executor/chunks.py [Note: device homes]).
    homed_ok: bool = False  # grad_accum 1, steps during backward
    homed_bytes_per_elem: int = (
        0  # a trainable device-homed chunk's master and moments, per element
    )
    homed_scratch_bytes: int = (
        0  # the device steps' fp32 scratch, once if any chunk is device-homed
    )
    homed_adam_us_per_param: float = 0.0  # a device-homed chunk's step on the device (its shard)
    # Chunks on disk ([NVMe tier] in planner/search/host_tiers.py; executor/nvme.py): the plan may
    # use one.
    nvme_ok: bool = False  # asked for (``plan --nvme``) and the spec's disk measured
    disk_saves_per_elem: int = (
        0  # host bytes per element a chunk's states on disk save (homes.NVME)
    )
    disk_step_us_per_elem: float = 0.0  # a CPU step's disk traffic (homes.Home.step_disk_bytes)
    disk_fetch_us_per_elem: float = 0.0  # a fetch that reads the fp32 master from the disk
    disk_fetch_with_home: bool = (
        False  # whether a chunk on disk that keeps its home reads the disk to fetch (fp32)
    )
    # Frozen chunks (a LoRA model's base; executor/chunks.py [Note: frozen chunks]): values only.
    trainable: np.ndarray | None = None  # (C,) bool, None when every chunk trains (full training)
    frozen_persist_bytes: int = 0  # device bytes of one frozen persistent chunk: its values
    frozen_host_bytes_per_elem: int = (
        0  # a frozen offloaded chunk's host bytes per element: its home
    )

    @property
    def reduce_us_per_chunk(self) -> float:
        """A persistent chunk's gradient reduction, which starts in backward ([Overlapped
        reductions] in ``evaluate``): the all-reduce, or sharded the reduce-scatter; the rest of
        ``allreduce_us_per_chunk`` (sharded: the all-gather) runs after the step."""
        return self.allreduce_us_per_chunk / (2 if self.shard_persistent else 1)
