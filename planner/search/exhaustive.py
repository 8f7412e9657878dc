"""Exact search over ``(n_persist, n_buffer, n_swap, n_checkpoint)`` (paper §3.3).

The space, for ``C`` chunks and ``N`` blocks:

- ``n_persist`` in ``0..C`` — the first chunks in execution order;
- ``n_buffer`` in ``need..C - n_persist``, where ``need`` is the most offloaded
  chunks one segment uses (fewer cannot run); every buffer more adds prefetch room
  and one more chunk still resident at the forward→backward turn (its first
  re-fetch is saved), up to every offloaded chunk (the paper's Table 4 reaches 46);
- ``n_swap`` in ``0..ceil(N / interval)``, where the swap interval is how many
  blocks' forward compute one block's swap-out needs to hide behind;
- ``n_checkpoint`` in ``0..N - n_swap``.

``n_persist`` is the outer loop in increasing-memory order: each step adds a
chunk's states on the device (more than the buffer it may free), so once no
configuration at some ``n_persist`` fits the budget, none at a larger one does
and the loop stops (the pruning). Inside, every ``(n_swap, n_checkpoint)`` pair
is evaluated at once by ``cost.evaluate`` (numpy over the grid), for ``n_buffer``
in ``need..need + DENSE_BUFFERS``.

[Buffers past the dense range] A configuration's peak grows with ``n_buffer`` (a
buffer more is a chunk more on the device) and its time never grows (more
prefetch room, more chunks cached); both are properties of ``cost.evaluate``,
tested. So past the dense range the memory bounds the range, not a constant: a
pair is evaluated at ``n_buffer + 1`` only if it fit at ``n_buffer``, and only
while it could still enter the search's best six (the winner and the runners-up),
judged by a lower bound of its key: its time with every offloaded chunk buffered
(one evaluation at ``C - n_persist``) and its peak at ``n_buffer``. Exact (tested
against brute force over the whole space); the Pareto front holds the
configurations evaluated.

Choice: the fastest feasible configuration; ties (times compared in whole µs)
break toward less memory, then fewer recomputed blocks, then lexicographically.
Feasible means the predicted device peak fits the budget and, when a host budget
is given, the predicted host bytes (offloaded chunk states + swapped activations,
``cost.evaluate``'s ``host_bytes`` + ``host_swap_bytes``) fit it too; where they
would not, ``cost.evaluate`` makes the fewest offloaded chunks homeless that make them
fit (12 B per element on the host instead of 14, a conversion per fetch charged in
the time: cost.py [Homeless chunks]), so a plan that fits only that way is chosen,
and a plan that fits anyway keeps every home. Where even every offloaded chunk homeless
would not fit the host, the fewest first offloaded chunks are homed on the device
instead (their master and moments on the device, nothing on the host: cost.py [Device
homes]), which the device peak then carries; a plan that may use a disk (``plan --nvme``)
puts them in a file on disk instead, per strip, where device homes do not fit or are not
faster (``_evaluate``: disk traffic against device memory, planner/search/host_tiers.py). The two
properties [Buffers past the dense range] rests on hold per tier, not for the tier picked
(the pick may change with the buffers), so the pruning keeps the disk tier's peak, never
above either tier's, and the faster tier's time (``_time_bound``). Pruning
looks at the device only: more persistent chunks need *less* host memory, so a
configuration refused for host memory does not stop the outer loop.

Solvers sit behind ``Solver``: ``exhaustive`` here, ``milp`` (``milp.py``) beyond
the paper's space (any persistent set, any policy strip).
"""

from __future__ import annotations

import heapq
import math
import statistics
import time as _time
from dataclasses import dataclass, field, replace
from operator import itemgetter
from typing import Protocol

import numpy as np

from .cost import (
    PolicyGrid,
    Terms,
    block_policies,
    evaluate,
    homeless_order,
    host_need,
    min_buffers,
    policy_grid,
)

DENSE_BUFFERS = 2
"""Buffers beyond ``need`` evaluated for every policy pair (prefetch room: most of
the value of buffers); more are searched only where they can win ([Buffers past
the dense range])."""

TOP = 6
"""The search keeps the best configuration and the next five (``runners_up``)."""


@dataclass(frozen=True, order=True)
class Choice:
    """A configuration and its prediction. The four counts say everything for the
    paper's space; a MILP plan outside it also carries its persistent chunk ids and
    its strip (the counts then summarise them)."""

    n_persist: int
    n_buffer: int
    n_swap: int
    n_checkpoint: int
    time_us: float = field(compare=False)
    peak_bytes: float = field(compare=False)
    persistent: tuple[int, ...] | None = field(default=None, compare=False)
    """Persistent chunk ids when they are not the first ``n_persist``; None: the prefix."""
    policies: tuple[str, ...] | None = field(default=None, compare=False)
    """The per-block strip when it is not ``block_policies`` of the counts; None: that layout."""
    host_bytes: float = field(default=0.0, compare=False)
    """Predicted host bytes per rank (offloaded chunk states + swapped activations)."""
    n_homeless: int = field(default=0, compare=False)
    """Offloaded chunks without a home on the host (``host_tiers.homeless_order``'s first ones)."""
    n_homed: int = field(default=0, compare=False)
    """Offloaded chunks homed on the device (the first offloaded ones in execution order;
    cost.py [Device homes])."""
    n_nvme: int = field(default=0, compare=False)
    """Offloaded chunks whose states are on disk (``host_tiers.homeless_order``'s first ones;
    planner/search/host_tiers.py [NVMe tier])."""

    def persistent_ids(self) -> list[int]:
        return list(self.persistent) if self.persistent is not None else list(range(self.n_persist))

    def _offloaded(self, n_chunks: int, trainable=None) -> np.ndarray:
        """(C,) the offloaded chunks that train (``cost.Terms.trainable``; None: all do): the
        only ones a host tier can take (a frozen chunk has no master to move)."""
        off = np.ones(n_chunks, dtype=np.int64)
        off[self.persistent_ids()] = 0
        return off if trainable is None else off * trainable

    def homeless_ids(self, n_chunks: int, trainable=None) -> list[int]:
        """The homeless chunk ids, ascending: the first ``n_homeless`` of
        ``host_tiers.homeless_order``."""
        return sorted(
            int(c) for c in homeless_order(self._offloaded(n_chunks, trainable))[: self.n_homeless]
        )

    def homed_ids(self, n_chunks: int, trainable=None) -> list[int]:
        """The device-homed chunk ids: the first ``n_homed`` offloaded ones (cost.py [Device
        homes])."""
        return [int(c) for c in np.nonzero(self._offloaded(n_chunks, trainable))[0][: self.n_homed]]

    def nvme_ids(self, n_chunks: int, trainable=None) -> list[int]:
        """The chunk ids on disk, ascending: the first ``n_nvme`` of
        ``host_tiers.homeless_order``."""
        return sorted(
            int(c) for c in homeless_order(self._offloaded(n_chunks, trainable))[: self.n_nvme]
        )

    def strip(self, n_blocks: int) -> list[str]:
        return (
            list(self.policies)
            if self.policies is not None
            else block_policies(n_blocks, self.n_swap, self.n_checkpoint)
        )

    @property
    def four_count(self) -> bool:
        """Whether the paper's space holds this configuration (prefix + ``S C C … K K``)."""
        return self.persistent is None and self.policies is None

    def key(self) -> tuple:
        """The search's order: whole µs, then less memory, fewer recomputed blocks, counts."""
        return (
            round(self.time_us),
            self.peak_bytes,
            self.n_checkpoint,
            self.n_persist,
            self.n_buffer,
            self.n_swap,
            self.n_checkpoint,
            tuple(self.persistent_ids()),
            tuple(self.policies or ()),
        )


@dataclass
class SearchResult:
    best: Choice | None
    front: list[Choice]
    """Pareto front of (predicted time, predicted peak) over every evaluated configuration."""
    runners_up: list[Choice]
    """The next-best feasible configurations, best first."""
    space_size: int
    evaluated: int
    seconds: float
    min_peak_bytes: float
    """The smallest predicted peak of any configuration (what the budget must at least be)."""
    solver: str = "exhaustive"
    min_host_bytes: float = math.inf
    """The smallest predicted host need of any configuration that fits the device budget
    (what the host budget must at least be; inf when none fits the device)."""
    status: str = "complete"
    """How the solver ended: ``complete`` (exhaustive), or HiGHS's ``optimal`` (within
    ``milp.MILP_REL_GAP``), ``time limit``, ``infeasible``, ``unbounded``, ``failed``."""
    gap: float | None = None
    """The MILP's relative optimality gap when it stopped (None: not a MILP)."""
    warnings: list[str] = field(default_factory=list)
    """Anything the caller should log: a fallback, a tolerance repair."""
    baseline: Choice | None = None
    """The best configuration of the paper's four-count space (set by the MILP solver)."""
    solver_seconds: dict[str, float] = field(default_factory=dict)
    """Wall seconds per solver run inside this search (the MILP solver runs both)."""


class Solver(Protocol):
    def __call__(
        self, terms: Terms, budget_bytes: int, host_budget_bytes: float | None = None
    ) -> SearchResult: ...


def swap_interval(t: Terms) -> int:
    """Blocks of forward compute one block's swap-out needs to hide behind (≥ 1).

    Median over blocks of ``swap-out time / forward time``, rounded up.
    """
    blocks = slice(1, len(t.comp_fwd) - 1)
    ratios = (t.saved_tensor[blocks] * t.swap_out_us_per_byte) / np.maximum(
        t.comp_fwd[blocks], 1e-9
    )
    # (statistics.median: np.median's value, the middle one or the mean of the two, without its
    # first call's 20-30 ms of set-up in every process)
    return max(1, math.ceil(statistics.median(ratios.tolist()))) if len(ratios) else 1


def policy_pairs(t: Terms) -> list[tuple[int, int]]:
    n = t.n_blocks
    max_swap = min(n, math.ceil(n / swap_interval(t)))
    return [(s, c) for s in range(max_swap + 1) for c in range(n - s + 1)]


def _needs(t: Terms) -> list[int]:
    """``min_buffers`` at every ``n_persist`` in ``0..C`` at once."""
    C = t.n_chunks
    off = (np.arange(C)[None, :] >= np.arange(C + 1)[:, None]).astype(
        np.int64
    )  # (C + 1, C): row p offload_mask(t, p)
    return (
        (t.uses @ off.T).max(axis=0) if len(t.uses) else np.zeros(C + 1, dtype=np.int64)
    ).tolist()


def space(t: Terms) -> list[tuple[int, int]]:
    """The ``(n_persist, n_buffer)`` pairs of the space, in increasing ``n_persist``."""
    return [
        (n_persist, nb)
        for n_persist, need in enumerate(_needs(t))
        for nb in range(need, max(need, t.n_chunks - n_persist) + 1)
    ]


def space_size(t: Terms) -> int:
    """``len(space(t))``, without listing the pairs."""
    return sum(
        max(need, t.n_chunks - n_persist) - need + 1 for n_persist, need in enumerate(_needs(t))
    )


def _subgrid(grid: PolicyGrid, idx: np.ndarray) -> PolicyGrid:
    """The pairs ``idx`` of ``grid`` (a smaller grid for ``cost.evaluate``), with the rows ``idx``
    of the grid's cached strip-only terms (each row is one strip's: the same values)."""
    return PolicyGrid(
        grid.n_swap[idx], grid.n_checkpoint[idx], grid.swap[idx], grid.ckpt[idx], parent=(grid, idx)
    )


def _homes_tier(t: Terms) -> Terms | None:
    """The terms with device homes in the disk's place, where a plan may use both
    (planner/search/host_tiers.py); None where there is no choice to weigh."""
    return replace(t, nvme_ok=False) if t.nvme_ok and t.homed_ok else None


def _evaluate(
    t: Terms, n_persist: int, n_buffer: int, grid: PolicyGrid, host_cap: float, budget_bytes: float
) -> tuple[np.ndarray, np.ndarray, dict]:
    """``cost.evaluate``; where the plan may use both a disk and device homes for what
    homeless chunks leave (planner/search/host_tiers.py), per strip the faster of the two that fits
    (device and host), else the disk's (it adds no device bytes): the disk costs its traffic
    in every step, the device homes device memory (and save CPU steps)."""
    disk = evaluate(t, n_persist, n_buffer, grid, host_cap)
    th = _homes_tier(t)
    if th is None or not (disk[2]["n_nvme"] > 0).any():
        return disk  # (no strip needs the third tier: device homes would be none either)
    homes = evaluate(th, n_persist, n_buffer, grid, host_cap)
    fits_d, fits_h = ((r[1] <= budget_bytes) & (host_need(r[2]) <= host_cap) for r in (disk, homes))
    use = fits_h & (~fits_d | (homes[0] < disk[0]))  # (G,) the device homes
    if not use.any():
        return disk

    def pick(a, b):
        return np.where(use, b, a)

    return (
        pick(disk[0], homes[0]),
        pick(disk[1], homes[1]),
        {k: pick(v, homes[2][k]) for k, v in disk[2].items()},
    )


def _time_bound(
    t: Terms, n_persist: int, n_buffer: int, grid: PolicyGrid, host_cap: float
) -> np.ndarray:
    """A lower bound of ``_evaluate``'s time at ``n_buffer`` or fewer buffers: with
    ``n_buffer`` (time never grows with buffers), the faster of the host tiers."""
    time, _, _ = evaluate(t, n_persist, n_buffer, grid, host_cap, time_only=True)
    th = _homes_tier(t)
    return (
        time
        if th is None
        else np.minimum(time, evaluate(th, n_persist, n_buffer, grid, host_cap, time_only=True)[0])
    )


class _Rows:
    """The configurations that fit, kept as the arrays each evaluation gave (stacked only for
    the few that can be among the best); ``smallest`` gives the best as tuples
    ``(time_us_int, peak, n_checkpoint, np, nb, sw, ck, time, host, homeless, homed, nvme)``,
    ordered as those tuples compare (``Choice.key``)."""

    def __init__(self):
        self.blocks: list[
            tuple
        ] = []  # (whole µs of each, js, n_persist, n_buffer, sw, ck, time, peak, host, parts)

    def add(self, js, n_persist, n_buffer, sw, ck, time, peak, host, parts) -> None:
        if not len(js):
            return
        self.blocks.append(
            (np.round(time[js]), js, n_persist, n_buffer, sw, ck, time, peak, host, parts)
        )

    @staticmethod
    def _stack(block, m) -> np.ndarray:
        """(12, k): the rows ``m`` (a mask or all) of one block, every value exact in float64."""
        first, js, n_persist, n_buffer, sw, ck, time, peak, host, parts = block
        js, ck = js[m], ck[m]
        k = len(js)
        return np.stack(
            [
                first[m],
                peak[js],
                ck,
                np.full(k, n_persist),
                np.full(k, n_buffer),
                sw[m],
                ck,
                time[js],
                host[js],
                parts["n_homeless"][js],
                parts["n_device_homed"][js],
                parts["n_nvme"][js],
            ]
        ).astype(np.float64)

    def smallest(self, n: int, since: int = 0) -> list[tuple]:
        """The ``n`` smallest rows (of the blocks added from ``since`` on), as tuples."""
        blocks = self.blocks[since:]
        if not blocks:
            return []
        if (
            sum(len(b[1]) for b in blocks) > n
        ):  # the n smallest all have a first key within the n smallest first keys
            bar = np.partition(np.concatenate([b[0] for b in blocks]), n - 1)[n - 1]
            a = np.concatenate([self._stack(b, b[0] <= bar) for b in blocks], axis=1)
        else:
            a = np.concatenate([self._stack(b, slice(None)) for b in blocks], axis=1)
        top = np.lexsort(a[::-1])[:n]  # last key first: lexsort sorts by its last row
        ints = (0, 2, 3, 4, 5, 6, 9, 10, 11)
        return [
            tuple(int(a[i, j]) if i in ints else float(a[i, j]) for i in range(12)) for j in top
        ]


def exhaustive(t: Terms, budget_bytes: int, host_budget_bytes: float | None = None) -> SearchResult:
    start = _time.perf_counter()
    pairs = policy_pairs(t)
    grid = policy_grid(t.n_blocks, pairs)
    host_cap = math.inf if host_budget_bytes is None else host_budget_bytes
    rows = _Rows()  # every configuration that fits, as arrays (Choice.key's order)
    all_points: list[tuple[float, float, tuple[int, int, int, int]]] = []
    pair_sw = np.array([sw for sw, _ in pairs], dtype=np.int64)
    pair_ck = np.array([ck for _, ck in pairs], dtype=np.int64)
    evaluated = 0
    min_peak = min_host = math.inf
    frontier: list[
        tuple[int, int, np.ndarray, np.ndarray]
    ] = []  # (np, nb, pairs that fit, their peaks)

    def record(n_persist: int, n_buffer: int, idx: np.ndarray, time, peak, parts, ok) -> None:
        """Keep the configurations that fit (``ok``) as rows, and each call's own Pareto points."""
        host = host_need(parts)
        js = np.nonzero(ok)[0]
        rows.add(
            js, n_persist, n_buffer, pair_sw[idx[js]], pair_ck[idx[js]], time, peak, host, parts
        )
        # Each call's own Pareto points, host-feasible only: in order of (peak, time), those
        # faster than every earlier one.
        order = np.lexsort((time, peak))
        feasible = host[order] <= host_cap
        times = time[order]
        before = np.minimum.accumulate(
            np.concatenate([[math.inf], np.where(feasible, times, math.inf)[:-1]])
        )
        for j in order[feasible & (times < before)]:
            all_points.append(
                (float(time[j]), float(peak[j]), (n_persist, n_buffer, *pairs[idx[j]]))
            )

    every = np.arange(len(pairs))
    current, fits_here = None, False
    for n_persist in range(t.n_chunks + 1):
        n_off = t.n_chunks - n_persist
        need = min_buffers(t, n_persist)
        top = max(need, min(need + DENSE_BUFFERS, n_off))
        if current is not None and not fits_here:
            break  # [Pruning] more persistent chunks only add device memory
        current, fits_here = n_persist, False
        for n_buffer in range(need, top + 1):
            time, peak, parts = _evaluate(t, n_persist, n_buffer, grid, host_cap, budget_bytes)
            host = host_need(parts)
            evaluated += len(pairs)
            # What a refusal reports: the device peak and host need without device homes
            # (cost.py [Device homes]), so "host memory" names the host when it binds.
            plain_peak = peak - parts["homed_peak_bytes"]
            min_peak = min(min_peak, float(plain_peak.min()))
            plain_ok = plain_peak <= budget_bytes
            if plain_ok.any():
                min_host = min(
                    min_host,
                    float((parts["unhomed_host_bytes"] + parts["host_swap_bytes"])[plain_ok].min()),
                )
            dev_ok = peak <= budget_bytes
            fits_here |= bool(
                plain_ok.any()
            )  # (device homes only add device bytes: dev_ok ⊆ plain_ok)
            ok = dev_ok & (host <= host_cap)
            record(n_persist, n_buffer, every, time, peak, parts, ok)
            if n_buffer == top and top < n_off and ok.any():
                frontier.append((n_persist, n_buffer, np.nonzero(ok)[0], plain_peak[ok]))

    # [Buffers past the dense range] (module docstring): grow n_buffer one at a time
    # for the pairs that still fit and could still enter the best TOP.
    best = rows.smallest(TOP)  # the best TOP rows so far

    def bar() -> tuple[float, float]:
        """What a key must not exceed (time in whole µs, then peak) to enter the best TOP."""
        return (best[-1][0], best[-1][1]) if len(best) == TOP else (math.inf, math.inf)

    for n_persist, n_buffer, idx, peak_at in frontier:
        n_off = t.n_chunks - n_persist
        bound = _time_bound(
            t, n_persist, n_off, _subgrid(grid, idx), host_cap
        )  # every chunk buffered
        evaluated += len(idx)
        lower = np.round(bound)  # whole µs (half to even, as round())
        while len(idx) and n_buffer < n_off:
            b0, b1 = bar()
            keep = (lower < b0) | ((lower == b0) & (peak_at <= b1))  # (lower, peak) <= (b0, b1)
            idx, lower = idx[keep], lower[keep]
            if not len(idx):
                break
            n_buffer += 1
            time, peak, parts = _evaluate(
                t, n_persist, n_buffer, _subgrid(grid, idx), host_cap, budget_bytes
            )
            host = host_need(parts)
            evaluated += len(idx)
            ok = (peak <= budget_bytes) & (host <= host_cap)
            n_blocks = len(rows.blocks)
            record(n_persist, n_buffer, idx, time, peak, parts, ok)
            best = heapq.nsmallest(TOP, best + rows.smallest(TOP, since=n_blocks))
            idx, lower, peak_at = (
                idx[ok],
                lower[ok],
                (peak - parts["homed_peak_bytes"])[ok],
            )  # (the disk tier's)

    choices = [
        Choice(
            r[3],
            r[4],
            r[5],
            r[6],
            r[7],
            r[1],
            host_bytes=r[8],
            n_homeless=r[9],
            n_homed=r[10],
            n_nvme=r[11],
        )
        for r in rows.smallest(TOP)
    ]
    front, best_t = [], math.inf
    for tm, pk, cfg in sorted(all_points, key=itemgetter(1, 0, 2)):  # (peak, time, counts)
        if tm < best_t:
            best_t = tm
            front.append(Choice(*cfg, tm, pk))
    return SearchResult(
        best=choices[0] if choices else None,
        front=front,
        runners_up=choices[1:],
        space_size=space_size(t) * len(pairs),
        evaluated=evaluated,
        seconds=_time.perf_counter() - start,
        min_peak_bytes=min_peak,
        min_host_bytes=min_host,
    )


DEFAULT_SOLVER = "exhaustive"
"""What ``make_plan`` and the plan library use; see milp.py [Note: default solver]."""
