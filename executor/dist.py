"""ZeRO-3 collectives over torch.distributed: the same plan on every rank, ranks differ only
in their shard index.

[Note: sharding]
With world size W every chunk buffer is padded to ``W * shard_numel`` elements,
``shard_numel = ceil(chunk_numel / W)``, and rank r owns elements
``[r * shard_numel, (r + 1) * shard_numel)``. For an *offloaded* chunk a rank keeps
only its shard in host memory — the compute-dtype home, the fp32 master, the Adam
moments, the gradient accumulator — so host memory per rank is 1/W of a single
rank's. A fetch uploads the own shard into its slot of the device buffer and
all-gathers the rest; gradients are reduce-scattered (then averaged) and only the
own shard goes down to the host, where only the own shard is stepped.

*Persistent* chunks keep their values and gradients whole on every rank (forward
and backward read them without a fetch). Their fp32 master and Adam moments are
either replicated or sharded, as ``placement.shard_persistent_states`` says:

- replicated (``false``): every rank holds the whole chunk's master and moments,
  all-reduces (and averages) the gradients and steps the whole
  chunk identically;
- sharded (``true``, ZeRO-1/2 for these chunks): rank r keeps the master and
  moments of only its shard (the same slices as an offloaded chunk's), the
  gradients are reduce-scattered (then averaged) into its slice of the gradient
  buffer, it steps that slice, and the updated values are all-gathered into
  every rank's chunk. That saves ``(W-1)/W`` of the 12 (fp32: 8) optimizer
  bytes per persistent element per rank and ``(W-1)/W`` of the device Adam time,
  for the same ring traffic (reduce-scatter + all-gather = one all-reduce). gloo's
  reduce-scatter is its all-reduce and a slice (BENCHMARKS.md), so on CPU the two
  layouts sum the ranks' gradients alike and train bit for bit alike
  (tests/test_dist.py); NCCL's two collectives may sum in other orders.

Collectives are issued in the plan's order on every rank — fetches in schedule
order, gradient reduce-scatters in the plan's offload order (the engine holds back
a chunk whose turn has not come), persistent chunks' reductions in that same order
at the end of the backward step of their first segment, asynchronously, waited on
after backward (engine.py [Note: overlapped reductions]), their all-gathers after
the step in chunk order — so hooks can never make ranks diverge and deadlock. A failing
collective (a rank died, the timeout of ``init_process_group`` expired) becomes a
``RankFailure`` naming the operation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from protrain.plans import homes as H
from protrain.plans.errors import PlanError, ProtrainError

from .events import Events


def _agreement_value(value: object) -> int:
    """An int64 for ``Comm.agree``: an int as itself (when it fits), anything else a digest."""
    if isinstance(value, int) and not isinstance(value, bool) and -(1 << 62) < value < 1 << 62:
        return value
    return int(hashlib.sha256(repr(value).encode()).hexdigest()[:15], 16)


class RankFailure(ProtrainError):
    """A collective failed: another rank died or the process group timed out."""


class Comm:
    """The rank's view of the process group; a no-op stand-in for world size 1."""

    def __init__(self, plan_world_size: int):
        self.active = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size() if self.active else 1
        self.rank = dist.get_rank() if self.active else 0
        if self.world != plan_world_size:
            where = (
                f"torch.distributed has {self.world} ranks"
                if self.active
                else "torch.distributed is not initialised (one rank)"
            )
            raise PlanError(
                f"plan is for world size {plan_world_size} but {where}",
                f"launch with `torchrun --nproc-per-node {plan_world_size} …`, or make a plan with "
                f"`protrain plan --world-size {self.world} …`",
            )
        # torch >= 2.10 renamed the tensor collectives; keep the floor (2.6) working.
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter = (
            getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        )
        # Runs each collective call: directly, or (the asynchronous CPU emulation) on the
        # copy engine's upload worker so gloo sees every rank's calls in plan order.
        self.runner = lambda fn: fn()
        self.events = Events()  # the engine's, once wrapped (events.py)

    def shard_numel(self, numel: int) -> int:
        return H.shard_numel(numel, self.world)

    def _run(self, what: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, its failure a ``RankFailure``; returns what it returns (an
        ``async_op`` collective's work: its end event then means issued, not done)."""
        out = []
        try:
            with record_function(f"protrain::{what.split()[0]}"):
                self.events.emit("collective", "begin", detail=what)  # events.py
                self.runner(lambda: out.append(fn(*args, **kwargs)))
                self.events.emit("collective", "end", detail=what)
            return out[0]
        except torch.OutOfMemoryError:
            raise  # our own device is full: the engine reports it as a BudgetError
        except RuntimeError as e:  # DistBackendError and gloo/NCCL errors derive from it
            raise RankFailure(
                f"rank {self.rank} of {self.world}: {what} failed "
                f"({str(e).splitlines()[0][:200]}); another rank probably died or the process "
                "group timed out",
                "look at the other ranks' logs; resume from the last checkpoint",
            ) from None

    def all_gather(self, full: torch.Tensor, what: str) -> None:
        """Fill ``full`` (W shards) from every rank's own shard, in place."""
        n = full.numel() // self.world
        own = full[self.rank * n : (self.rank + 1) * n]
        self._run(f"all-gather of {what}", self._all_gather, full, own)

    def reduce_scatter(
        self, shard: torch.Tensor, full: torch.Tensor, what: str, async_op: bool = False
    ):
        """``shard`` = the sum over ranks of this rank's slice of ``full`` (``async_op``: the
        work to ``wait`` on)."""
        return self._run(
            f"reduce-scatter of {what}", self._reduce_scatter, shard, full, async_op=async_op
        )

    def start_reduce_scatter(
        self, full: torch.Tensor, own: slice, what: str
    ) -> tuple[torch.Tensor, object]:
        """Start summing this rank's slice ``own`` of ``full`` over the ranks: ``(out, work)``.
        ``out`` is the slice itself on CUDA (NCCL reduces in place when the output is the
        rank's slice of the input: no memory beyond what accounting.py counts), a buffer of
        its own on CPU: an in-place asynchronous gloo reduce-scatter aborted a rank
        ("terminate called without an active exception") in 2 of ~20 runs of
        tests/test_dist.py, 0 of 10 with the buffer."""
        out = full[own] if full.is_cuda else full.new_empty(own.stop - own.start)
        return out, self.reduce_scatter(out, full, what, async_op=True)

    def agree(self, fields: Mapping[str, object], device: torch.device | str = "cpu") -> None:
        """Refuse, on every rank, ``fields`` whose values differ between the ranks.

        [Note: ranks agree] Ranks replaying different plans (another ``grad_accum`` or
        activation policy) issue different collectives and hang until the timeout; another
        ``micro_batch`` trains silently on other batches. So ``wrap`` (and ``protrain
        train``, for its data seed and step counts) all-gathers each field, as the integer
        itself or a 60-bit digest of its ``repr``, one all-gather in all, and every rank
        sees the same table and raises the same ``PlanError`` naming the rank and the field.
        """
        if self.world == 1 or not fields:
            return
        names = list(fields)
        mine = torch.tensor(
            [_agreement_value(fields[n]) for n in names], dtype=torch.int64, device=device
        )
        table = torch.empty(self.world * len(names), dtype=torch.int64, device=device)
        what = "all-gather of what the ranks must agree on (plan, training shape, data)"
        self._run(what, self._all_gather, table, mine)
        rows = table.view(self.world, len(names)).tolist()
        differ = [
            (r, i)
            for r in range(1, self.world)
            for i in range(len(names))
            if rows[r][i] != rows[0][i]
        ]
        if not differ:
            return
        shown = [
            f"rank {r} has {names[i]} = {rows[r][i]} where rank 0 has {rows[0][i]}"
            if isinstance(fields[names[i]], int) and not isinstance(fields[names[i]], bool)
            else f"rank {r}'s {names[i]} differs from rank 0's"
            for r, i in differ[:4]
        ]
        more = f" (and {len(differ) - 4} more)" if len(differ) > 4 else ""
        raise PlanError(
            f"rank {self.rank} of {self.world}: the ranks disagree: {'; '.join(shown)}{more}",
            "start every rank with the same plan file and options (torchrun runs one command "
            "on every rank: check that the plan file is the same on every node)",
        )

    def all_reduce(self, t: torch.Tensor, what: str, async_op: bool = False):
        return self._run(f"all-reduce of {what}", dist.all_reduce, t, async_op=async_op)

    def wait(self, work, what: str) -> None:
        """Wait for an ``async_op`` collective's work; a failure is a ``RankFailure`` too."""
        self._run(f"wait for {what}", work.wait)

    def sum(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """The sum over the ranks of ``t`` (left unchanged), on every rank; ``t`` itself for one
        rank."""
        if self.world > 1:
            t = t.clone()
            self.all_reduce(t, what)
        return t

    def mean(self, t: torch.Tensor, what: str) -> float:
        """The mean over the ranks of the scalar ``t`` (left unchanged), on every rank."""
        return (self.sum(t, what) / self.world).item()

    def barrier(self, what: str) -> None:
        if self.world > 1:
            self._run(f"barrier for {what}", dist.barrier)

    def broadcast(self, t: torch.Tensor, what: str) -> None:
        """Rank 0's ``t`` on every rank, in place."""
        self._run(f"broadcast of {what}", dist.broadcast, t, 0)
