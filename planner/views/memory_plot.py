"""The plan's predicted device memory (paper Eqs. 8-11), step by step, and its plot.

``memory_timeline`` / ``memory_walk`` give the walk's terms per forward and backward
step; its maximum is the plan's predicted peak. ``plot_memory`` draws it as stacked
bars with the budget line (matplotlib, the ``plot`` extra).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from protrain.plans import plan as P
from protrain.plans.errors import ConfigError
from protrain.plans.homes import POLICIES

from ..profiling.profile import Profile
from .trace import _terms_for

# ------------------------------------------------------------------- memory walk


@dataclass(frozen=True)
class MemoryStep:
    """One step of the memory walk, its terms in bytes (before ``alpha``)."""

    label: str
    """``forward <seg>`` or ``backward <seg>``."""
    states: float
    """Persistent chunks' parameters, gradients, masters and moments."""
    buffers: float
    """Device buffers of the offloaded chunks."""
    activations: float
    """Activations held (keep: saved, checkpoint: input, swap: nothing) up to this step."""
    swapping_out: float
    """Swapped blocks' activations still on the device while their D2H copy runs (forward, GPU
    only)."""
    swapped_in: float
    """Swapped blocks' activations back on the device (backward)."""
    grads: float
    """Gradient buffers of offloaded chunks alive at this backward step, and the gradients
    autograd holds for parameters two segments use (``accounting.shared_grads``)."""
    recompute: float
    """A checkpointed block's recomputed activations during its backward (GPU only)."""
    transient: float
    """The segment's transient peak above its start (GPU only)."""
    alpha: float
    """Fragmentation factor applied to the sum (``cost.ALPHA_GPU`` on GPU, 1 on CPU)."""

    @property
    def total_bytes(self) -> float:
        # Integers until the last multiplication, as memory_walk.walk sums them.
        walk = (
            self.activations
            + self.swapping_out
            + self.swapped_in
            + self.grads
            + self.recompute
            + self.transient
        )
        return (self.states + self.buffers + walk) * self.alpha


def memory_walk(profile: Profile, plan: P.Plan) -> list[MemoryStep]:
    """The plan's device memory step by step, term by term: forward steps ``<pre>`` …
    ``<post>``, then backward steps ``<post>`` … ``<pre>``.

    Read from ``plans/accounting.py``'s stream (each step at its high point), the
    model the cost model is tested equal to, so the largest ``total_bytes`` is the plan's
    predicted peak to the byte (tested).
    """
    from ..search import memory_walk
    from ..search.cost import segment_bytes

    _terms_for(profile, plan)  # refuses a profile of another model or layout
    w = memory_walk.walk(plan, segment_bytes(profile))
    return [
        MemoryStep(
            f"{phase} {seg}",
            w.states_bytes,
            w.buffers_bytes,
            k.get("activations", 0),
            k.get("swap_out", 0),
            k.get("swapped_in", 0),
            k.get("grads", 0) + k.get("shared_grads", 0),
            k.get("recompute", 0),
            k.get("transient", 0),
            w.alpha,
        )
        for phase, seg, k in memory_walk.step_highs(w.events)
    ]


def memory_timeline(profile: Profile, plan: P.Plan) -> list[tuple[str, int]]:
    """``(label, predicted bytes)`` per step of the walk; the maximum is the plan's peak."""
    return [(m.label, round(m.total_bytes)) for m in memory_walk(profile, plan)]


def require_matplotlib() -> None:
    """Refuse now, before anything is printed or written, when matplotlib is not installed."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(
            "plotting needs matplotlib, which is not installed",
            "install the plot extra: pip install -e '.[plot]'  (or: pip install matplotlib)",
        )


def plot_memory(profile: Profile, plan: P.Plan, path: str | Path) -> None:
    """Draw the walk as stacked terms per step, with the budget and the predicted peak.

    Needs matplotlib (the ``plot`` extra); imported here so nothing else pays for it.
    """
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    walk = memory_walk(profile, plan)
    gib = 2**30
    n = len(walk)
    xs = list(range(n))
    a = walk[0].alpha
    terms = [  # (label, per-step bytes, colour) bottom to top
        (
            "chunk states on the device (persistent, device-homed)",
            [m.states * a for m in walk],
            "#4c72b0",
        ),
        ("offloaded chunk buffers", [m.buffers * a for m in walk], "#64b5cd"),
        ("activations held", [m.activations * a for m in walk], "#55a868"),
        ("activations swapping out", [m.swapping_out * a for m in walk], "#a6d96a"),
        ("swapped-in activations", [m.swapped_in * a for m in walk], "#8fd175"),
        (
            "gradient buffers (offloaded chunks, tied weights)",
            [m.grads * a for m in walk],
            "#dd8452",
        ),
        ("recomputed activations", [m.recompute * a for m in walk], "#937860"),
        ("transient peak", [m.transient * a for m in walk], "#c44e52"),
    ]
    fig, ax = plt.subplots(figsize=(12, 5.5), dpi=110)
    bottom = [0.0] * n
    for label, ys, colour in terms:
        if not any(ys):
            continue
        ax.bar(
            xs,
            [y / gib for y in ys],
            bottom=[b / gib for b in bottom],
            width=1.0,
            color=colour,
            label=label,
            linewidth=0,
        )
        bottom = [b + y for b, y in zip(bottom, ys)]
    n_fwd = len(P.segments(plan))
    ax.axvspan(-0.5, n_fwd - 0.5, color="#000000", alpha=0.04, linewidth=0)
    ax.axvline(n_fwd - 0.5, color="#555555", linewidth=0.8)
    budget = plan.hardware.budget_bytes or plan.request.budget_bytes
    peak = max(range(n), key=lambda i: walk[i].total_bytes)
    peak_bytes = walk[peak].total_bytes
    top = max(peak_bytes, budget) / gib
    if budget:
        ax.axhline(budget / gib, color="#222222", linestyle="--", linewidth=1.2)
        ax.text(
            n - 0.5,
            budget / gib,
            f"budget {budget / gib:.2f} GiB",
            ha="right",
            va="bottom",
            fontsize=9,
        )
    right = peak < 0.7 * n  # put the note on the side with more room
    ax.annotate(
        f"predicted peak {peak_bytes / gib:.2f} GiB ({walk[peak].label})",
        (peak, peak_bytes / gib),
        xytext=(24 if right else -24, -16),
        textcoords="offset points",
        ha="left" if right else "right",
        va="top",
        fontsize=9,
        bbox=dict(boxstyle="round,pad=0.3", fc="white", ec="#c44e52", alpha=0.9),
        arrowprops=dict(arrowstyle="->", color="#c44e52", shrinkA=0, shrinkB=0),
    )
    for x, text in ((n_fwd / 2 - 0.5, "forward"), (n_fwd * 1.5 - 0.5, "backward")):
        ax.text(x, top * 1.12, text, ha="center", va="top", fontsize=10, color="#555555")
    ax.set_ylim(0, top * 1.16)
    ax.set_xlim(-0.5, n - 0.5)
    # About 16 tick labels: segment names, evenly thinned, always both ends of each
    # phase; a tick too close to one of those is dropped so labels never overlap.
    every = max(1, math.ceil(n / 16))
    ends = {0, n_fwd - 1, n - 1}  # not n_fwd: "bwd <post>" would sit on "fwd <post>"
    ticks = sorted(
        ends | {i for i in range(0, n, every) if min(abs(i - e) for e in ends) >= every / 2}
    )
    ax.set_xticks(ticks)
    ax.set_xticklabels(
        [_short_label(walk[i].label) for i in ticks], rotation=45, ha="right", fontsize=8
    )
    ax.set_ylabel("predicted device memory (GiB)")
    policies = [x.policy for x in plan.activations]
    ax.set_title(
        f"{plan.model.name} on {plan.hardware.name}: predicted device memory per schedule step\n"
        f"micro-batch {plan.training.micro_batch} × seq {plan.training.seq_len}, "
        f"{plan.training.compute_dtype}; {plan.placement.n_persist}/{len(plan.chunks.items)} "
        f"chunks persistent, {plan.placement.n_buffer} buffers; blocks: "
        f"{', '.join(f'{policies.count(p)} {p}' for p in POLICIES)}; "
        f"{plan.prediction.iter_time_us / 1e3:.0f} ms/iteration",
        fontsize=10,
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4, fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def _short_label(label: str) -> str:
    """``forward h.12`` → ``fwd 12``: block paths shortened to their index."""
    phase, seg = label.split(" ", 1)
    short = seg.rsplit(".", 1)[-1] if seg not in (P.PRE, P.POST) else seg
    return f"{'fwd' if phase == 'forward' else 'bwd'} {short}"
