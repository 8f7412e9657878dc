"""The model's execution graph: segments in execution order and the parameters each uses.

We trace one forward pass (on the ``meta`` device, so a 70B model costs nothing)
under a ``TorchFunctionMode`` that sees every torch function call. Any parameter
passed to any op is recorded as *used* by the segment running at that moment
(``<pre>``, a block, or ``<post>``). Catching ops rather than module calls matters
for tied weights and functional code: GPT-2's head uses the embedding matrix after
the last block, and a ``F.linear(x, self.wte.weight)`` head has no module to hook.

The result is a networkx DiGraph (segment nodes chained in execution order, edges
segment → parameter for each use) plus the flat views the layout and the schedule
need: parameters in first-use order and the parameters of each segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from protrain.executor.errors import ConfigError
from protrain.executor.plan import POST, PRE


@dataclass(frozen=True)
class ExecutionGraph:
    graph: nx.DiGraph
    """Nodes ``("segment", name)`` chained by ``next`` edges; ``("param", name)`` nodes; use edges."""
    segments: list[str]
    """``<pre>``, block paths in order, ``<post>``."""
    order: list[str]
    """Unique parameter names in first-use order; unused parameters last, in registration order."""
    uses: dict[str, list[str]]
    """Segment → parameters it uses, in first-use order (a tied parameter may appear in two)."""


class _UseRecorder(TorchFunctionMode):
    """Records, for every torch op, which parameters it reads and in which segment."""

    def __init__(self, names: dict[int, str]):
        super().__init__()
        self.names = names  # id(parameter) → canonical name
        self.segment = PRE
        self.uses: dict[str, list[str]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            name = self.names.get(id(t)) if isinstance(t, nn.Parameter) else None
            if name is not None:
                seen = self.uses.setdefault(self.segment, [])
                if name not in seen:
                    seen.append(name)
        return func(*args, **kwargs)


def trace(model: nn.Module, blocks: list[str], seq_len: int = 8) -> ExecutionGraph:
    """Run one forward on a meta copy of the inputs and record parameter uses per segment.

    ``model`` may live on any device; the inputs are placed on the device of its first
    parameter (``meta`` for a model built on meta). The model's forward must accept
    ``(idx, targets)`` LongTensors of shape (B, T) (the zoo and the HF adapters do).
    """
    names = {id(p): n for n, p in model.named_parameters()}
    if not names:
        raise ConfigError("the model has no parameters; there is nothing to plan")
    modules = dict(model.named_modules())
    recorder = _UseRecorder(names)
    handles = []
    last = len(blocks) - 1
    for i, b in enumerate(blocks):
        if b not in modules:
            raise ConfigError(f"block {b!r} is not a module of the model",
                              "check the block paths (`--blocks`)")

        def enter(_m, _a, b=b):
            recorder.segment = b

        def leave(_m, _a, _o, is_last=(i == last)):
            if is_last:
                recorder.segment = POST

        handles.append(modules[b].register_forward_pre_hook(enter))
        handles.append(modules[b].register_forward_hook(leave))
    device = next(model.parameters()).device
    idx = torch.zeros(1, seq_len, dtype=torch.long, device=device)  # (B, T)
    try:
        with torch.no_grad(), recorder:
            model(idx, idx)
    finally:
        for h in handles:
            h.remove()

    segments = [PRE, *blocks, POST]
    uses = {s: recorder.uses.get(s, []) for s in segments}
    order: list[str] = []
    for s in segments:
        order.extend(n for n in uses[s] if n not in order)
    order.extend(n for n in names.values() if n not in order)

    g = nx.DiGraph()
    for i, s in enumerate(segments):
        g.add_node(("segment", s), index=i)
        if i:
            g.add_edge(("segment", segments[i - 1]), ("segment", s), kind="next")
    for n, p in model.named_parameters():
        g.add_node(("param", n), numel=p.numel(), first_use=order.index(n))
    for s in segments:
        for n in uses[s]:
            g.add_edge(("segment", s), ("param", n), kind="uses")
    return ExecutionGraph(graph=g, segments=segments, order=order, uses=uses)
