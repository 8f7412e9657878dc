"""Plan choice as a mixed-integer linear program (``scipy.optimize.milp``, HiGHS).

The exhaustive search (``exhaustive.py``) walks the paper's four-count space: the
first ``n_persist`` chunks persistent, blocks laid out ``S C C … K K``. The MILP
drops both restrictions: one binary per chunk (persistent or offloaded, anywhere
in execution order), a one-hot triple per block (keep / swap / checkpoint), and
``n_buffer`` as an integer variable. Its objective and constraints are the cost
model of ``cost.evaluate`` written linearly, *exactly* (no approximation) — see
[Note: why the linearisation is exact]. ``Terms`` are the same; what changes is
only who picks the configuration.

Units inside the program: times in ms (µs × 1e-3), device bytes as a fraction of
the budget, host bytes as a fraction of the host budget, so every coefficient is
O(1e-3 … 1e3) and HiGHS's absolute tolerances (1e-6 … 1e-7) mean microseconds
and bytes-per-gigabyte. The solution is rounded and re-evaluated by
``cost.evaluate``: the returned numbers are the cost model's, never the LP's.

[Note: why the linearisation is exact]
Every ``max`` in ``cost.evaluate`` is of terms the objective increases with, so
``T ≥ each term`` is tight at an optimum. The two ``min``s (how many uploads run
ahead in a free buffer, forward and backward) enter each segment time as
``max(c, a·t_up, x, (a·t_up + x) / LINK_DUPLEX) + (u − a)·t_up``, which never
increases with ``a`` (``LINK_DUPLEX`` > 1), so ``a ≤ u, a ≤ spare`` with ``a`` free
is tight too. The forward→backward buffer
cache ("the ``n_buffer`` offloaded chunks used last in forward are still
resident") is a rank condition on a fixed order, ``cached_c ≤ off_c`` and
``Σ_{i before c} off_i ≤ n_buffer − 1`` when cached; caching only lowers
re-fetches, so the optimum caches all it may. The CPU-Adam worker's timeline
``D_k = max(D_{k−1}, E_s + t_down) + P_c·r`` over the chunks in offload order is
``D_k ≥ D_{k−1} + P_c·r·off_c`` and ``D_k ≥ E_s + (t_down + P_c·r)·off_c``; for a
persistent chunk the second reads ``D_k ≥ E_s``, which is dominated (by the next
offloaded chunk's own bound, ``E`` growing along backward, or by ``T_bwd`` in the
final max), so no big-M is needed. Memory is linear per step already.

[Note: default solver]
``exhaustive`` stays the default (search.DEFAULT_SOLVER), ``--solver milp`` is opt-in.
Measured (BENCHMARKS.md, `python -m tools.bench milp`, 2-core CPU): on the plan library's
grid the MILP's plan is predicted faster in 37 of the 55 cells that fit, by 1.1% at
the median and 9.7% at most (5 cells above 3%), all of it by leaving the paper's
space; but (1) a few cells (gpt2-xl, gpt2-10b) run into the 10 s time limit where
the exhaustive search takes < 1 s, and a time-limited answer depends on the
machine's speed, so the library would no longer regenerate byte for byte
everywhere; (2) the gains are predictions in the GPU time model, which no GPU run
has validated yet, and the MILP leans on its finer details (which copies overlap
which compute) more than the four-count search does. Revisit with a GPU run of a
> 3% cell (mistral-7b on an H100, W=1: 9.7% predicted).

The MILP runs the exhaustive search as well, to name the best four-count plan
(``protrain explain`` shows the departures from it) and as the floor it never
returns worse than; it takes the better of the two by the search's own order.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time as _time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..hardware.spec import default_host_budget
from .cost import (
    ALPHA_GPU,
    LINK_DUPLEX,
    SWAP_OVERHEAD_US,
    Terms,
    block_policies,
    evaluate,
    host_bytes_per_chunk,
    host_need,
    min_buffers,
    strips_grid,
)
from .departures import Departure, departures_from, is_four_count
from .exhaustive import Choice, SearchResult, exhaustive, policy_pairs, space

MILP_TIME_LIMIT_S = 10.0
"""HiGHS wall-clock limit per solve. Past it without a solution, the exhaustive plan
is returned and the result says so (``status``, ``warnings``)."""

MILP_REL_GAP = 1e-4
"""HiGHS stops once its plan is proven within this fraction of the optimum (0.01%: far
below what the cost model can resolve). The tests use 0 (proven optimal)."""

MS = 1e-3
"""µs → ms, the program's time unit."""


# ------------------------------------------------------------------ a small LP builder


class Expr:
    """A linear expression ``Σ coef·x[idx] + const`` (indices may repeat: they add up)."""

    __slots__ = ("idx", "coef", "const")

    def __init__(self, idx=(), coef=(), const: float = 0.0):
        self.idx = np.asarray(idx, dtype=np.int64).ravel()
        self.coef = np.asarray(coef, dtype=np.float64).ravel()
        self.const = float(const)

    @staticmethod
    def dot(idx: np.ndarray, coef) -> Expr:
        coef = np.broadcast_to(np.asarray(coef, dtype=np.float64), np.shape(idx))
        keep = coef != 0
        return Expr(np.asarray(idx)[keep], coef[keep])

    def __add__(self, other) -> Expr:
        if isinstance(other, Expr):
            return Expr(
                np.concatenate([self.idx, other.idx]),
                np.concatenate([self.coef, other.coef]),
                self.const + other.const,
            )
        return Expr(self.idx, self.coef, self.const + float(other))

    __radd__ = __add__

    def __neg__(self) -> Expr:
        return Expr(self.idx, -self.coef, -self.const)

    def __sub__(self, other) -> Expr:
        return self + (-other)

    def __rsub__(self, other) -> Expr:
        return (-self) + other

    def __mul__(self, k: float) -> Expr:
        return Expr(self.idx, self.coef * k, self.const * k)

    __rmul__ = __mul__


def _sum(exprs) -> Expr:
    out = Expr()
    for e in exprs:
        out = out + e
    return out


@dataclass
class Program:
    """Variables (bounds, integrality, a label each) and rows ``lo ≤ expr ≤ hi``."""

    lb: list[float] = field(default_factory=list)
    ub: list[float] = field(default_factory=list)
    integer: list[int] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    rows: list[tuple[Expr, float, float, str]] = field(default_factory=list)

    def var(
        self, label: str, n: int = 1, lb: float = 0.0, ub: float = math.inf, integer: bool = False
    ) -> np.ndarray:
        first = len(self.lb)
        self.lb += [lb] * n
        self.ub += [ub] * n
        self.integer += [int(integer)] * n
        self.labels += [f"{label}[{i}]" for i in range(n)] if n > 1 else [label]
        return np.arange(first, first + n)

    def one(self, idx: int | np.integer, k: float = 1.0) -> Expr:
        return Expr([idx], [k])

    def le(self, e: Expr, rhs: float, label: str) -> None:
        self.rows.append((e, -math.inf, rhs - e.const, label))

    def ge(self, e: Expr, rhs: float, label: str) -> None:
        self.rows.append((e, rhs - e.const, math.inf, label))

    def eq(self, e: Expr, rhs: float, label: str) -> None:
        self.rows.append((e, rhs - e.const, rhs - e.const, label))

    def solve(self, objective: Expr, time_limit_s: float, rel_gap: float = MILP_REL_GAP):
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import csr_matrix

        n = len(self.lb)
        c = np.zeros(n)
        np.add.at(c, objective.idx, objective.coef)
        r = np.concatenate([np.full(len(e.idx), i) for i, (e, _, _, _) in enumerate(self.rows)])
        cols = np.concatenate([e.idx for e, _, _, _ in self.rows])
        vals = np.concatenate([e.coef for e, _, _, _ in self.rows])
        A = csr_matrix((vals, (r, cols)), shape=(len(self.rows), n))  # duplicates add up
        lo = np.array([x[1] for x in self.rows])
        hi = np.array([x[2] for x in self.rows])
        with _quiet_stdout():
            return milp(
                c,
                integrality=np.array(self.integer),
                bounds=Bounds(self.lb, self.ub),
                constraints=LinearConstraint(A, lo, hi),
                options={"time_limit": time_limit_s, "mip_rel_gap": rel_gap, "presolve": True},
            )


@contextlib.contextmanager
def _quiet_stdout():
    """Silence the process's C-level stdout while HiGHS runs: scipy's build prints a debug
    line from one code path (``HighsMipSolverData::transformNewIntegerFeasibleSolution
    tmpSolver.run();``) that would land in ``protrain plan``'s output. No-op when stdout
    has no file descriptor (pytest's capture)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


# ------------------------------------------------------------------ the formulation


@dataclass
class Handles:
    """Where the decisions live in the solution vector."""

    off: np.ndarray  # (C,) chunk offloaded
    n_buffer: int
    swap: np.ndarray  # (N,) block swapped
    ckpt: np.ndarray  # (N,) block checkpointed
    objective: Expr  # T_iter in ms


def formulate(
    t: Terms, budget_bytes: float, host_budget_bytes: float | None = None, paper_space: bool = False
) -> tuple[Program, Handles]:
    """The cost model of ``cost.evaluate`` as a MILP (module docstring; every row labelled).

    ``paper_space`` adds the constraints that hold the program to the exhaustive
    search's space: a prefix of persistent chunks with the search's buffer range,
    and a strip that is ``block_policies`` of one of its ``(n_swap, n_checkpoint)``
    pairs. Used to test the formulation against the search, configuration by
    configuration.
    """
    C, N, S = t.n_chunks, t.n_blocks, t.n_blocks + 2
    m = Program()
    # [Variable] off[c] ∈ {0,1}: chunk c is offloaded (0: persistent), any subset
    off = m.var("off", C, 0, 1, integer=True)
    # [Variable] cached[c] ∈ {0,1}: offloaded chunk c is still resident at forward→backward
    cached = m.var("cached", C, 0, 1, integer=True)
    # [Variable] n_buffer ∈ {0..C}: device buffers shared by the offloaded chunks
    nb = int(m.var("n_buffer", 1, 0, C, integer=True)[0])
    # [Variable] keep/swap/ckpt[b] ∈ {0,1}: the policy of block b (segment b+1)
    keep = m.var("keep", N, 0, 1, integer=True)
    swap = m.var("swap", N, 0, 1, integer=True)
    ckpt = m.var("ckpt", N, 0, 1, integer=True)
    for b in range(N):
        # [Constraint] one policy per block: keep + swap + ckpt = 1
        m.eq(m.one(keep[b]) + m.one(swap[b]) + m.one(ckpt[b]), 1, f"one policy, block {b}")

    def seg_swap(s: int, k: float = 1.0) -> Expr:  # swap of segment s (0 outside the blocks)
        return m.one(swap[s - 1], k) if 1 <= s <= N else Expr()

    def seg_ckpt(s: int, k: float = 1.0) -> Expr:
        return m.one(ckpt[s - 1], k) if 1 <= s <= N else Expr()

    def seg_keep(s: int, k: float = 1.0) -> Expr:
        return m.one(keep[s - 1], k) if 1 <= s <= N else Expr(const=k)

    n_off = Expr.dot(off, 1.0)
    # [Variable] q[k] ∈ {0,1}: exactly k chunks are persistent (one-hot). Redundant with
    # off[], but branching on the count first closes the gap far faster: every persistent
    # chunk costs the same device memory, so the count is what the budget decides.
    q = m.var("q", C + 1, 0, 1, integer=True)
    m.eq(Expr.dot(q, 1.0), 1, "one persistent count")
    # [Constraint] Σ_k k·q[k] = C − Σ off
    m.eq(Expr.dot(q, np.arange(C + 1, dtype=np.float64)) + n_off, C, "persistent count")
    use = [Expr.dot(off, t.uses[s]) for s in range(S)]  # offloaded chunks segment s uses
    for s in range(S):
        # [Constraint] the buffers hold every offloaded chunk segment s uses: use(s) ≤ n_buffer
        m.le(use[s] - m.one(nb), 0, f"buffers hold segment {s}")
    # [Constraint] no more buffers than offloaded chunks: n_buffer ≤ Σ off
    m.le(m.one(nb) - n_off, 0, "buffers ≤ offloaded chunks")
    for c in range(C):
        # [Constraint] an offloaded chunk needs a buffer: off[c] ≤ n_buffer
        m.le(m.one(off[c]) - m.one(nb), 0, f"a buffer for chunk {c}")
        # [Constraint] only an offloaded chunk can be cached: cached[c] ≤ off[c]
        m.le(m.one(cached[c]) - m.one(off[c]), 0, f"cached ⇒ offloaded, chunk {c}")
    # The cache holds the n_buffer offloaded chunks used last in forward (ties: higher id).
    # [Constraint] exactly n_buffer chunks are cached (n_buffer ≤ Σ off, so there are enough)
    m.eq(Expr.dot(cached, 1.0) - m.one(nb), 0, "n_buffer chunks cached")
    rank = sorted(range(C), key=lambda c: (-t.last_fwd_use[c], -c))
    for j, c in enumerate(rank):
        # [Constraint] cached[c] ⇒ fewer than n_buffer offloaded chunks rank before c:
        #              Σ_{i before c} off[i] + (j+1)·cached[c] − n_buffer ≤ j  (j: chunks before c)
        m.le(
            Expr.dot(off[rank[:j]], 1.0) + m.one(cached[c], j + 1) - m.one(nb),
            j,
            f"cache rank, chunk {c}",
        )

    # -- time (ms), paper Eq. 2 as cost.evaluate computes it
    t_up, t_down = t.t_up * MS, t.t_down * MS
    comp_f, comp_b = t.comp_fwd * MS, t.comp_bwd * MS
    out_ms = t.saved_tensor * t.swap_out_us_per_byte * MS  # (S,) a swapped block's swap-out
    in_ms = t.saved_tensor * t.swap_in_us_per_byte * MS  # (S,) and its swap-in
    u_f = [Expr.dot(off, t.up_fwd[s]) for s in range(S)]  # chunks uploaded for forward s
    later = t.up_bwd * (np.cumsum(t.up_bwd[::-1], axis=0)[::-1] > 1)
    # Chunks re-fetched for backward s: first backward uses of cached chunks are free.
    ref = [Expr.dot(off, t.up_bwd[s]) - Expr.dot(cached, t.up_bwd[s] - later[s]) for s in range(S)]
    spare = [m.one(nb) - use[s] for s in range(S)]  # buffers free while s holds its chunks
    grad_down = [Expr.dot(off, t.offload_at[s]) * t_down for s in range(S)]
    n_swaps = Expr.dot(swap, 1.0)
    # [Variable] Tb[s] ≥ 0: backward time of segment s (ms)
    Tb = m.var("Tb", S)
    if t.gpu:
        # [Variable] Tf[s] ≥ 0: forward time of segment s; af[s]: uploads for s+1 run ahead
        Tf = m.var("Tf", S)
        af = m.var("af", S)
        for s in range(S):
            U = u_f[s + 1] if s + 1 < S else Expr()
            late = (U - m.one(af[s])) * t_up  # uploads for s+1 that wait for s to end
            # [Constraint] af[s] ≤ uploads for s+1 and ≤ spare buffers at s (the min, linearised)
            m.le(m.one(af[s]) - U, 0, f"ahead ≤ uploads, forward {s}")
            m.le(m.one(af[s]) - spare[s], 0, f"ahead ≤ spare buffers, forward {s}")
            # [Constraint] Tf[s] ≥ compute + late uploads; ≥ all uploads; ≥ swap-out + late uploads
            m.ge(m.one(Tf[s]) - late, comp_f[s], f"Tf ≥ compute, forward {s}")
            m.ge(m.one(Tf[s]) - U * t_up, 0, f"Tf ≥ H2D lane, forward {s}")
            m.ge(m.one(Tf[s]) - seg_swap(s, out_ms[s]) - late, 0, f"Tf ≥ D2H lane, forward {s}")
            # [Constraint] Tf[s] ≥ (uploads ahead + swap-out) / LINK_DUPLEX + late uploads (both
            # ways)
            m.ge(
                m.one(Tf[s])
                - (m.one(af[s], t_up) + seg_swap(s, out_ms[s])) * (1 / LINK_DUPLEX)
                - late,
                0,
                f"Tf ≥ link both ways, forward {s}",
            )
        t_fwd = Expr.dot(Tf, 1.0) + u_f[0] * t_up + n_swaps * (SWAP_OVERHEAD_US * MS)
        # [Variable] ab[s]: chunks for backward s-1 that load ahead while s computes
        ab = m.var("ab", S)
        m.eq(m.one(ab[0]), 0, "nothing ahead of backward 0")
        for s in range(S):
            late = Expr()
            if s >= 1:
                R = ref[s - 1]
                late = (R - m.one(ab[s])) * t_up
                # [Constraint] ab[s] ≤ re-fetches of s-1 and ≤ spare buffers at s
                m.le(m.one(ab[s]) - R, 0, f"ahead ≤ re-fetches, backward {s}")
                m.le(m.one(ab[s]) - spare[s], 0, f"ahead ≤ spare buffers, backward {s}")
                # [Constraint] Tb[s] ≥ H2D lane: re-fetches of s-1 + swap-in of s-1 (shared link)
                m.ge(
                    m.one(Tb[s]) - R * t_up - seg_swap(s - 1, in_ms[s - 1]),
                    0,
                    f"Tb ≥ H2D lane, backward {s}",
                )
                # [Constraint] Tb[s] ≥ (re-fetches ahead + swap-in of s-1 + gradient offload) /
                # LINK_DUPLEX
                #              + late re-fetches (the link both ways)
                m.ge(
                    m.one(Tb[s])
                    - (m.one(ab[s], t_up) + seg_swap(s - 1, in_ms[s - 1]) + grad_down[s])
                    * (1 / LINK_DUPLEX)
                    - late,
                    0,
                    f"Tb ≥ link both ways, backward {s}",
                )
            # [Constraint] Tb[s] ≥ compute + recompute (checkpoint) + late re-fetches
            m.ge(
                m.one(Tb[s]) - seg_ckpt(s, comp_f[s]) - late,
                comp_b[s],
                f"Tb ≥ compute, backward {s}",
            )
            # [Constraint] Tb[s] ≥ gradient offload (D2H lane) + late re-fetches
            m.ge(m.one(Tb[s]) - grad_down[s] - late, 0, f"Tb ≥ D2H lane, backward {s}")
        start_b = ref[S - 1] * t_up  # the first backward segment's re-fetch is not hidden
    else:  # a cpu device copies synchronously: every term adds up
        t_fwd = (
            float(comp_f.sum()) + _sum(u_f) * t_up + _sum(seg_swap(s, out_ms[s]) for s in range(S))
        )
        for s in range(S):
            # [Constraint] Tb[s] = compute + recompute + re-fetch + swap-in + gradient offload
            m.eq(
                m.one(Tb[s])
                - seg_ckpt(s, comp_f[s])
                - ref[s] * t_up
                - seg_swap(s, in_ms[s])
                - grad_down[s],
                comp_b[s],
                f"Tb = sum, backward {s}",
            )
        start_b = Expr()
    t_bwd = Expr.dot(Tb, 1.0) + start_b
    # Backward runs segment S-1 first: segment s ends at E[s] = start + Σ_{s' ≥ s} Tb[s'].
    # [Variable] E[s]: when backward segment s ends (a chain keeps the rows sparse)
    E = m.var("E", S)
    for s in range(S):
        # [Constraint] E[s] = E[s+1] + Tb[s]  (E[S] = start_b)
        m.eq(
            m.one(E[s]) - m.one(Tb[s]) - (m.one(E[s + 1]) if s + 1 < S else start_b),
            0,
            f"end of backward {s}",
        )
    ends = [m.one(E[s]) for s in range(S)]
    params = t.chunk_params.astype(np.float64)
    n_params = float(params.sum())
    # [Overlapped reductions] cost.evaluate: persistent chunks' reductions (reduce_us each)
    # on the collective lane from the end of their first segment's backward; sharded, the
    # all-gather after the step (gather_us) stays after backward.
    reduce_us = t.reduce_us_per_chunk
    gather_us = t.allreduce_us_per_chunk - reduce_us
    t_gpu = (n_params * t.dev_adam_us_per_param + C * gather_us) * MS - Expr.dot(
        off, (params * t.dev_adam_us_per_param + gather_us) * MS
    )
    # [CPU Adam timeline] one worker, chunks in offload order (cost.evaluate's loop).
    events = [(s, c) for s in range(S - 1, -1, -1) for c in np.nonzero(t.offload_at[s])[0]]
    if reduce_us and events:
        # [Variable] R[k] ≥ 0: when the collective lane is done with the k-th chunk in
        # offload order (an offloaded chunk takes no time on it)
        R = m.var("R", len(events))
        r = reduce_us * MS
        for k, (s, c) in enumerate(events):
            prev = m.one(R[k - 1]) if k else Expr()
            # [Constraint] R[k] ≥ R[k-1] + r·(1 - off[c])  (the lane is busy until then)
            m.ge(
                m.one(R[k]) - prev + m.one(off[c], r), r, f"reduction after the previous, chunk {c}"
            )
            # [Constraint] R[k] ≥ E[s] + r·(1 - off[c])  (its gradients are complete; for an
            #              offloaded chunk R[k] ≥ E[s] ≤ T_bwd, which costs nothing below)
            m.ge(
                m.one(R[k]) - ends[s] + m.one(off[c], r),
                r,
                f"reduction after its backward, chunk {c}",
            )
        # [Variable] Tr ≥ 0: what is left of the reductions when backward ends
        Tr = int(m.var("Tr")[0])
        # [Constraint] Tr ≥ R[last] - T_bwd
        m.ge(m.one(Tr) - m.one(R[-1]) + t_bwd, 0, "reductions' tail after backward")
        t_gpu = t_gpu + m.one(Tr)
    # [Variable] Z ≥ max(T_bwd + T_gpu_optim, CPU worker done)
    Z = int(m.var("Z")[0])
    m.ge(m.one(Z) - t_bwd - t_gpu, 0, "Z ≥ T_bwd + T_gpu_optim")
    if t.cpu_adam == "after_backward":
        # Every CPU step waits for the end of backward and the last gradients' landing,
        # then the worker runs them back to back (cost.evaluate: max(T_bwd, landed) + T_cpu).
        # [Variable] L ≥ 0: when the CPU worker may start (a max, tight at the optimum)
        L = int(m.var("L")[0])
        # [Constraint] L ≥ E[0]  (backward has ended)
        m.ge(m.one(L) - ends[0], 0, "CPU Adam starts after backward")
        for s, c in events:
            # [Constraint] L ≥ E[s] + t_down·off[c]  (chunk c's gradients have landed; for a
            #              persistent chunk it reads L ≥ E[s], dominated by L ≥ E[0])
            m.ge(
                m.one(L) - ends[s] - m.one(off[c], t_down),
                0,
                f"CPU Adam after the landing of chunk {c}",
            )
        t_cpu = Expr.dot(off, params * t.cpu_adam_us_per_param * MS)
        if events:
            # [Constraint] Z ≥ L + T_cpu_optim·[anything offloaded]: the worker's run.
            # With nothing offloaded T_cpu_optim = 0 and L may sit at E[0] = T_bwd ≤ Z,
            # so the row costs nothing and needs no indicator.
            m.ge(m.one(Z) - m.one(L) - t_cpu, 0, "Z ≥ CPU Adam done")
    else:
        # [Variable] D[k] ≥ 0: when the CPU worker finishes the k-th chunk in offload order
        D = m.var("D", len(events))
        for k, (s, c) in enumerate(events):
            w = params[c] * t.cpu_adam_us_per_param * MS
            prev = m.one(D[k - 1]) if k else Expr()
            # [Constraint] D[k] ≥ D[k-1] + step(c)·off[c]  (the worker is busy until then)
            m.ge(
                m.one(D[k]) - prev - m.one(off[c], w), 0, f"CPU Adam after the previous, chunk {c}"
            )
            # [Constraint] D[k] ≥ E[s] + (t_down + step(c))·off[c]  (gradients must have landed)
            m.ge(
                m.one(D[k]) - ends[s] - m.one(off[c], t_down + w),
                0,
                f"CPU Adam after its offload, chunk {c}",
            )
        if events:
            m.ge(m.one(Z) - m.one(D[-1]), 0, "Z ≥ CPU Adam done")
    objective = t_fwd + m.one(Z)  # T_iter = T_fwd + Z

    # -- peak memory (fraction of the budget), paper Eqs. 8-11 per step (cost.memory_terms)
    a = (ALPHA_GPU if t.gpu else 1.0) / budget_bytes
    # [Variable] K = Σ off (the offloaded count, one variable so the memory rows stay sparse)
    K = int(m.var("n_off")[0])
    m.eq(m.one(K) - n_off, 0, "offloaded count")
    states = (C - m.one(K)) * float(t.persist_chunk_bytes)
    base = states + m.one(nb, float(t.chunk_bytes))  # + n_buffer device buffers
    # [Variable] H[s] ≥ 0: activations held after forward s, in budgets (a chain):
    # keep → saved, checkpoint → input, swap → none
    Hv = m.var("H", S)
    for s in range(S):
        step = seg_keep(s, float(t.saved[s])) + seg_ckpt(s, float(t.inputs[s]))
        # [Constraint] H[s] = H[s-1] + what segment s leaves behind
        m.eq(
            m.one(Hv[s]) - step * (1.0 / budget_bytes) - (m.one(Hv[s - 1]) if s else Expr()),
            0,
            f"held after forward {s}",
        )
    alpha = ALPHA_GPU if t.gpu else 1.0
    for s in range(S):
        fwd = base + (float(t.fwd_peak[s]) if t.gpu else 0.0)
        if t.gpu:
            # swapped activations still in flight to the host: block s's and block s-1's
            # (cost.memory_terms [Swap-out in flight])
            fwd = fwd + seg_swap(s, float(t.saved[s])) + seg_swap(s - 1, float(t.saved[s - 1]))
        # [Constraint] peak at forward step s ≤ budget
        m.le(fwd * a + m.one(Hv[s], alpha), 1.0, f"peak at forward {s} ≤ budget")
        back = (
            base
            + seg_swap(s, float(t.saved_tensor[s]))
            + seg_swap(s - 1, float(t.saved_tensor[s - 1]))
            + Expr.dot(off, t.grad_live[s]) * float(t.chunk_bytes)
            + float(t.shared_grads[s])
        )
        if t.gpu:
            back = back + seg_ckpt(s, float(t.saved[s])) + float(t.bwd_peak[s])
        # [Constraint] peak at backward step s ≤ budget
        m.le(back * a + m.one(Hv[s], alpha), 1.0, f"peak at backward {s} ≤ budget")
    if host_budget_bytes is not None and math.isfinite(host_budget_bytes):
        # + the CPU step's scratch when anything is offloaded, as the cost model charges it:
        # 1 - q[C] is 1 exactly when fewer than C chunks are persistent
        scratch = (1.0 - m.one(q[C])) * float(t.host_scratch_bytes)
        host = (
            Expr.dot(off, host_bytes_per_chunk(t))
            + scratch
            + _sum(seg_swap(s, float(t.saved_tensor[s])) for s in range(S))
        )
        # [Constraint] host bytes (offloaded chunk states + swapped activations) ≤ host budget
        m.le(
            host * (1.0 / max(host_budget_bytes, 1.0)),
            1.0 if host_budget_bytes > 0 else 0.0,
            "host ≤ host budget",
        )
    if paper_space:
        _restrict_to_paper_space(m, t, off, nb, swap, ckpt)
    return m, Handles(off, nb, swap, ckpt, objective)


def _restrict_to_paper_space(m: Program, t: Terms, off, nb: int, swap, ckpt) -> None:
    """Constraints holding the program to the exhaustive search's space (for tests)."""
    C, N = t.n_chunks, t.n_blocks
    # [Variable] z[p] ∈ {0,1}: n_persist = p (one-hot)
    z = m.var("z", C + 1, 0, 1, integer=True)
    m.eq(Expr.dot(z, 1.0), 1, "one n_persist")
    for c in range(C):
        # [Constraint] prefix: chunk c is offloaded iff n_persist ≤ c
        m.eq(m.one(off[c]) - Expr.dot(z[: c + 1], 1.0), 0, f"prefix, chunk {c}")
    lo, hi = np.full(C + 1, C), np.zeros(C + 1)
    for p, b in space(t):
        lo[p], hi[p] = min(lo[p], b), max(hi[p], b)
    # [Constraint] the search's buffer range for the chosen n_persist
    m.ge(m.one(nb) - Expr.dot(z, lo), 0, "n_buffer ≥ the search's least")
    m.le(m.one(nb) - Expr.dot(z, hi), 0, "n_buffer ≤ the search's most")
    pairs = policy_pairs(t)
    grid = strips_grid([block_policies(N, sw, ck) for sw, ck in pairs])
    # [Variable] y[g] ∈ {0,1}: the strip is the paper's layout of pair g (one-hot)
    y = m.var("y", len(pairs), 0, 1, integer=True)
    m.eq(Expr.dot(y, 1.0), 1, "one policy pair")
    for b in range(N):
        # [Constraint] block b's policy is the chosen pair's
        m.eq(m.one(swap[b]) - Expr.dot(y, grid.swap[:, b + 1]), 0, f"pattern swap, block {b}")
        m.eq(m.one(ckpt[b]) - Expr.dot(y, grid.ckpt[:, b + 1]), 0, f"pattern checkpoint, block {b}")


# ------------------------------------------------------------------ solving


STATUS = {0: "optimal", 1: "time limit", 2: "infeasible", 3: "unbounded", 4: "failed"}
"""scipy.optimize.milp's ``status`` codes, in words."""


@dataclass
class Solved:
    """One MILP run: its configuration, re-evaluated by the cost model, and how it ended."""

    choice: Choice | None
    status: str
    gap: float | None
    seconds: float
    objective_us: float | None
    """The program's objective at the returned (rounded) solution, µs: equals
    ``choice.time_us`` up to HiGHS's tolerances (the formulation is exact; tested)."""
    repairs: int = 0
    """Re-solves with a budget tightened by a tolerance slip (module docstring)."""


def to_choice(
    t: Terms, persistent: Sequence[int], n_buffer: int, policies: Sequence[str]
) -> Choice:
    """Any configuration as a ``Choice``, predicted by ``cost.evaluate``; ``persistent`` and
    ``policies`` are left None where the paper's prefix / layout says the same."""
    persistent = sorted(int(c) for c in persistent)
    n_swap, n_ckpt = policies.count("swap"), policies.count("checkpoint")
    time, peak, parts = evaluate(t, persistent, n_buffer, strips_grid([list(policies)]))
    host = float(host_need(parts)[0])
    prefix = persistent == list(range(len(persistent)))
    paper = list(policies) == block_policies(t.n_blocks, n_swap, n_ckpt)
    return Choice(
        len(persistent),
        n_buffer,
        n_swap,
        n_ckpt,
        float(time[0]),
        float(peak[0]),
        persistent=None if prefix else tuple(persistent),
        policies=None if paper else tuple(policies),
        host_bytes=host,
    )


def solve_program(
    t: Terms,
    budget_bytes: float,
    host_budget_bytes: float | None = None,
    *,
    paper_space: bool = False,
    time_limit_s: float = MILP_TIME_LIMIT_S,
    rel_gap: float = MILP_REL_GAP,
) -> Solved:
    """Formulate, solve, round, re-evaluate. If rounding within HiGHS's tolerances puts
    the configuration a hair over a budget, the budget is tightened by the slip (at
    least 1e-6 of it, 4× more each time) and the program solved again (at most three times).
    """
    start = _time.perf_counter()
    dev_cap = float(budget_bytes)
    host_cap = None if host_budget_bytes is None else float(host_budget_bytes)
    for repairs in range(4):
        m, h = formulate(t, dev_cap, host_cap, paper_space)
        left = max(0.05, time_limit_s - (_time.perf_counter() - start))
        res = m.solve(h.objective, left, rel_gap)
        status = STATUS.get(res.status, "failed")
        gap = None if getattr(res, "mip_gap", None) is None else float(res.mip_gap)
        if res.x is None:
            return Solved(None, status, gap, _time.perf_counter() - start, None, repairs)
        x = res.x
        off = x[h.off] > 0.5
        policies = [
            "swap" if s > 0.5 else "checkpoint" if k > 0.5 else "keep"
            for s, k in zip(x[h.swap], x[h.ckpt])
        ]
        nb = int(round(x[h.n_buffer]))
        choice = to_choice(t, np.nonzero(~off)[0], nb, policies)
        obj = float(np.dot(h.objective.coef, x[h.objective.idx]) + h.objective.const) / MS
        over_dev = choice.peak_bytes - budget_bytes
        over_host = 0.0 if host_budget_bytes is None else choice.host_bytes - host_budget_bytes
        if over_dev <= 0 and over_host <= 0:
            return Solved(choice, status, gap, _time.perf_counter() - start, obj, repairs)
        # Tighten by the slip, but at least by a step HiGHS can see: its feasibility
        # tolerance is relative (~1e-6 of the row's scale), so a 1-byte cut of a 30 MB
        # budget changes nothing; the step grows 4× per repair.
        step = 1e-6 * 4**repairs
        if over_dev > 0:
            dev_cap -= max(over_dev + 1.0, budget_bytes * step)
        if over_host > 0 and host_cap is not None:
            host_cap -= max(over_host + 1.0, host_budget_bytes * step)
    return Solved(None, "failed", None, _time.perf_counter() - start, None, repairs)


def solve(
    t: Terms,
    budget_bytes: int,
    host_budget_bytes: float | None = None,
    *,
    time_limit_s: float = MILP_TIME_LIMIT_S,
) -> SearchResult:
    """``SOLVERS["milp"]``: the MILP over the whole space, never worse than the exhaustive search.

    Runs ``exhaustive`` (the floor, the best four-count plan for ``explain``, the Pareto
    front) and the MILP, and returns the better configuration by the search's order
    (``Choice.key``: whole µs, then less memory, …). If HiGHS stops without a solution
    (time limit, numerical failure) the exhaustive plan is returned and ``warnings`` says so.
    """
    start = _time.perf_counter()
    base = exhaustive(t, budget_bytes, host_budget_bytes)
    ex_s = _time.perf_counter() - start
    solved = solve_program(t, budget_bytes, host_budget_bytes, time_limit_s=time_limit_s)
    warnings: list[str] = []
    # The plan schema has no status/gap fields yet (Provenance.search): they go in the
    # solver's name, without the wall time, which would break byte-identical replanning.
    gap = "" if solved.gap is None else f", gap {solved.gap:.2%}"
    solver = f"milp (HiGHS {solved.status}{gap})"
    if solved.choice is None and solved.status != "infeasible":
        solver = f"exhaustive (milp fallback: HiGHS {solved.status}, no solution)"
        warnings.append(
            f"the MILP found no plan ({solved.status} after {solved.seconds:.1f} s); "
            "this is the exhaustive search's plan"
        )
    elif solved.status == "infeasible" and base.best is not None:
        warnings.append(
            "HiGHS called the MILP infeasible where the exhaustive search found a plan "
            "(a tolerance at the budget's edge); this is the exhaustive search's plan"
        )
    if solved.repairs:
        warnings.append(
            f"the MILP's rounded solution slipped over a budget by a tolerance; "
            f"re-solved {solved.repairs} time(s) with the budget tightened by the slip"
        )
    found = [c for c in (base.best, solved.choice) if c is not None]
    best = (
        min(found, key=Choice.key) if found else None
    )  # a tie (same plan) keeps the four-count one
    if (
        solved.choice is not None
        and base.best is not None
        and solved.choice.key() > base.best.key()
    ):
        warnings.append(
            f"the MILP's plan ({solved.choice.time_us:.0f} µs) is not better than the "
            f"exhaustive search's ({base.best.time_us:.0f} µs); took the latter"
        )
    runners = base.runners_up
    if best is not None and base.best is not None and best is not base.best:
        runners = [base.best, *base.runners_up[:4]]  # the four-count plan explain compares against
    return SearchResult(
        best=best,
        front=base.front,
        runners_up=runners,
        space_size=base.space_size,
        evaluated=base.evaluated + (solved.choice is not None),
        seconds=_time.perf_counter() - start,
        min_peak_bytes=base.min_peak_bytes,
        solver=solver,
        min_host_bytes=base.min_host_bytes,
        status=solved.status,
        gap=solved.gap,
        warnings=warnings,
        baseline=base.best,
        solver_seconds={"exhaustive": ex_s, "milp": solved.seconds},
    )


# ------------------------------------------------------------------ explain: departures


def departures(
    t: Terms,
    chosen: Choice,
    baseline: Choice,
    budget_bytes: float,
    host_budget_bytes: float | None = None,
) -> list[Departure]:
    """Where ``chosen`` departs from the four-count ``baseline``, and what each departure
    buys: undo it alone in ``chosen`` and predict again (``report.Departure``). Undoing
    a placement departure may need more buffers; the note says so, and says when the
    undone plan would no longer fit."""
    N = t.n_blocks
    persistent, strip = chosen.persistent_ids(), chosen.strip(N)
    base_strip = baseline.strip(N)
    out = []
    for d in departures_from(
        t.n_chunks,
        persistent,
        chosen.n_buffer,
        strip,
        baseline.n_persist,
        baseline.n_buffer,
        base_strip,
    ):
        pers, nb, pol = set(persistent), chosen.n_buffer, list(strip)
        notes = []
        if d.kind == "chunks":
            span = range(d.first, d.last + 1)
            pers = pers | set(span) if d.four_count == "persistent" else pers - set(span)
        elif d.kind == "n_buffer":
            nb = baseline.n_buffer
        else:
            pol[d.first : d.last + 1] = base_strip[d.first : d.last + 1]
        n_off = t.n_chunks - len(pers)
        least = min_buffers(t, sorted(pers))
        fixed = min(max(nb, least), n_off) if n_off else 0
        if fixed != nb:
            notes.append(
                f"undoing it needs n_buffer {fixed}"
                if fixed > nb
                else f"undoing it leaves n_buffer {fixed}"
            )
        undone = to_choice(t, sorted(pers), fixed, pol)
        if undone.peak_bytes > budget_bytes:
            notes.append("undone alone, the plan would exceed the device budget")
        if host_budget_bytes is not None and undone.host_bytes > host_budget_bytes:
            notes.append("undone alone, the plan would exceed the host budget")
        out.append(
            Departure(
                d.kind,
                d.first,
                d.last,
                d.chosen,
                d.four_count,
                buys_us=undone.time_us - chosen.time_us,
                buys_bytes=undone.peak_bytes - chosen.peak_bytes,
                note="; ".join(notes),
            )
        )
    return out


def explain_departures(profile, plan) -> list[Departure]:
    """``departures`` for a plan file and the profile it was made from (``explain --profile``).

    The best four-count plan is the plan's first runner-up: the MILP solver records it
    there whenever its plan leaves the paper's space (``planning.make_plan``). A plan in
    the paper's space has no departures.
    """
    from .cost import make_terms

    runners = plan.provenance.search.runners_up
    if is_four_count(plan) or not runners:
        return []
    t = make_terms(
        profile,
        plan.chunks.chunk_numel,
        plan.training.world_size,
        plan.schedule.cpu_adam,
        plan.training.grad_accum,
        plan.placement.shard_persistent_states,
    )
    chosen = to_choice(
        t, plan.placement.persistent, plan.placement.n_buffer, [a.policy for a in plan.activations]
    )
    b = runners[0]
    baseline = Choice(
        b.n_persist,
        b.n_buffer,
        b.n_swap,
        b.n_checkpoint,
        float(b.iter_time_us),
        float(b.peak_memory_bytes),
    )
    budget = plan.hardware.budget_bytes or plan.request.budget_bytes or math.inf
    return departures(t, chosen, baseline, budget, default_host_budget(profile.hardware))
