"""How a plan departs from the paper's space of four counts (a persistent prefix, the
``S C C … K K`` policy layout): the runs of chunks and blocks placed another way. The MILP
reports them (``milp.explain_departures``) and ``protrain explain`` prints them."""

from __future__ import annotations

from dataclasses import dataclass

from protrain.plans.homes import CHECKPOINT, SWAP
from protrain.plans.plan import Plan

from .policy_layout import block_policies


@dataclass(frozen=True)
class Departure:
    """One way a plan departs from the best four-count plan: a run of chunks placed the
    other way, a different buffer count, or a run of blocks with another policy.

    ``buys_us`` / ``buys_bytes``: what the cost model says the departure is worth,
    measured by undoing it alone in the plan: the predicted time (µs) and peak (bytes)
    undoing it would add, i.e. what the departure saves (negative: what it costs).
    None when not computed (``explain`` without the profile)."""

    kind: str  # "chunks" | "n_buffer" | "blocks"
    first: int
    last: int
    chosen: str  # "persistent" / "offloaded", a policy, or the buffer count
    four_count: str  # the same, in the best four-count plan
    buys_us: float | None = None
    buys_bytes: float | None = None
    note: str = ""

    def label(self, blocks: list[str]) -> str:
        if self.kind == "n_buffer":
            return f"n_buffer {self.chosen} (four-count plan: {self.four_count})"
        if self.kind == "chunks":
            span = (
                f"chunk {self.first}"
                if self.first == self.last
                else f"chunks {self.first}-{self.last}"
            )
            return f"{span} {self.chosen} (four-count plan: {self.four_count})"
        span = (
            f"block {blocks[self.first]}"
            if self.first == self.last
            else f"blocks {blocks[self.first]} … {blocks[self.last]} ({self.last - self.first + 1})"
        )
        return f"{span} {self.chosen} (four-count plan: {self.four_count})"


def departures_from(
    n_chunks: int,
    persistent: list[int],
    n_buffer: int,
    strip: list[str],
    base_n_persist: int,
    base_n_buffer: int,
    base_strip: list[str],
) -> list[Departure]:
    """The departures of (persistent, n_buffer, strip) from a four-count plan, grouped into
    runs of neighbouring chunks / blocks that changed the same way, in execution order."""
    out: list[Departure] = []
    chosen = set(persistent)

    def runs(pairs: list[tuple[str, str]], kind: str) -> None:
        i = 0
        while i < len(pairs):
            j = i
            while j + 1 < len(pairs) and pairs[j + 1] == pairs[i]:
                j += 1
            if pairs[i][0] != pairs[i][1]:
                out.append(Departure(kind, i, j, pairs[i][0], pairs[i][1]))
            i = j + 1

    place = [
        (
            "persistent" if c in chosen else "offloaded",
            "persistent" if c < base_n_persist else "offloaded",
        )
        for c in range(n_chunks)
    ]
    runs(place, "chunks")
    if n_buffer != base_n_buffer:
        out.append(Departure("n_buffer", 0, 0, str(n_buffer), str(base_n_buffer)))
    runs(list(zip(strip, base_strip)), "blocks")
    return out


def is_four_count(plan: Plan) -> bool:
    """Whether the plan lies in the paper's space: a persistent prefix and the ``S C C … K K``
    layout of its counts (``block_policies``)."""
    pl = plan.placement
    strip = [a.policy for a in plan.activations]
    return pl.persistent == list(range(pl.n_persist)) and strip == block_policies(
        len(strip), strip.count(SWAP.name), strip.count(CHECKPOINT.name)
    )
