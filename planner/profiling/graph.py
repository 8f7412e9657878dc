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

import contextlib
import copy
from dataclasses import dataclass

import networkx as nx
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from protrain.plans.errors import ConfigError, ProtrainError
from protrain.plans.plan import POST, PRE


@dataclass(frozen=True)
class ExecutionGraph:
    graph: nx.DiGraph
    """Nodes ``("segment", name)`` chained by ``next`` edges; ``("param", name)`` nodes; use
    edges."""
    segments: list[str]
    """``<pre>``, block paths in order, ``<post>``."""
    order: list[str]
    """Unique parameter names in first-use order (a block's unused parameters after its used
    ones)."""
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
    """Run one forward and record parameter uses per segment; leave ``model`` untouched.

    The forward runs on a ``meta`` copy of the model (``_meta_copy``: no values are
    copied, so it costs nothing even for a model that fills the device), so planning a
    live model changes none of its parameters, buffers (BatchNorm statistics,
    ``Embedding(max_norm=)`` renormalisation) or training flags. A model whose forward
    cannot run on ``meta`` (data-dependent control flow, tensors kept as plain
    attributes) is traced live instead, with its parameters, buffers and flags restored
    afterwards (which costs a copy of them). Either way the global RNG (CPU and CUDA) is restored.
    The forward must accept ``(idx, targets)`` LongTensors of shape (B, T) (the zoo and the HF
    adapters do).

    Attribution (see ``[Note: unused parameters]``): a parameter belongs to the segment
    whose ops use it; every parameter of a block's module subtree also belongs to that
    block, used by the trace or not; a parameter that nothing uses and that no block
    contains goes to ``<post>``. Each block must run exactly once per forward, in the
    listed order (``_check_calls``).
    """
    names = {id(p): n for n, p in model.named_parameters()}
    if not names:
        raise ConfigError("the model has no parameters; there is nothing to plan")
    modules = dict(model.named_modules())
    for b in blocks:
        if b not in modules:
            raise ConfigError(
                f"block {b!r} is not a module of the model", "check the block paths (`--blocks`)"
            )
    with _rng_preserved():
        try:
            shadow = _meta_copy(model)
        except Exception:  # noqa: BLE001 - an uncopyable model is traced live below
            shadow = None
        if shadow is not None:
            try:
                recorder, calls = _record(shadow, blocks, seq_len)
            except ProtrainError:
                raise
            except Exception:  # noqa: BLE001 - not meta-traceable: trace the live model
                if shadow is model:
                    raise  # already on meta: there is no live model to fall back to
                shadow = None
        if shadow is None:
            with _state_restored(model):
                recorder, calls = _record(model, blocks, seq_len)
    _check_calls(blocks, calls)

    segments = [PRE, *blocks, POST]
    uses = {s: list(recorder.uses.get(s, [])) for s in segments}
    # [Note: unused parameters] The executor makes a block's chunks resident when the
    # block runs, and the plan validator (``segment_chunks``) counts every parameter
    # under a block's module path as that block's, so a parameter the trace did not see
    # used (an MoE expert no token was routed to, a head only some inputs reach) is
    # still planned with its block. A top-level parameter nothing used goes to <post>:
    # its chunk is then fetched in <post>'s forward and backward like any other, so the
    # executor never offloads a gradient from a chunk it never fetched.
    used = {n for s in segments for n in uses[s]}
    for n in names.values():
        owner = next((b for b in blocks if n.startswith(b + ".")), None)
        if owner is not None and n not in uses[owner]:
            uses[owner].append(n)
        elif owner is None and n not in used:
            uses[POST].append(n)
    order: list[str] = []
    for s in segments:
        order.extend(n for n in uses[s] if n not in order)

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


def _record(model: nn.Module, blocks: list[str], seq_len: int) -> tuple[_UseRecorder, list[str]]:
    """One ``no_grad`` forward of ``model`` under the recorder; the blocks' calls in order."""
    names = {id(p): n for n, p in model.named_parameters()}
    modules = dict(model.named_modules())
    recorder = _UseRecorder(names)
    calls: list[str] = []
    handles = []
    last = blocks[-1]
    for b in blocks:

        def enter(_m, _a, b=b):
            calls.append(b)
            recorder.segment = b

        def leave(_m, _a, _o, b=b):
            if b == last:
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
    return recorder, calls


def _check_calls(blocks: list[str], calls: list[str]) -> None:
    """Refuse a forward that does not run each block once, in the listed order.

    A plan has one forward step per block: a block called twice (weight sharing by
    re-calling a module) would need its chunks twice and its activations saved twice,
    which the schedule cannot say; a block never called, or called out of order, would
    have its chunks fetched at the wrong time.
    """
    seen: dict[str, int] = {}
    for b in calls:
        seen[b] = seen.get(b, 0) + 1
    twice = [b for b in blocks if seen.get(b, 0) > 1]
    if twice:
        raise ConfigError(
            f"block {twice[0]!r} is called {seen[twice[0]]} times in one forward; a plan runs each "
            "block once (its chunks and activations are scheduled per call)",
            "give each call a module of its own, or wrap the repeated calls in one module and "
            "list that as the block (`--blocks`, or the model's protrain_blocks())",
        )
    never = [b for b in blocks if b not in seen]
    if never:
        raise ConfigError(
            f"block {never[0]!r} is never called in the forward",
            "list only the blocks the forward runs (`--blocks`)",
        )
    if calls != list(blocks):
        raise ConfigError(
            f"the forward runs the blocks in the order {', '.join(calls)}, not in the listed order "
            f"{', '.join(blocks)}",
            "list the blocks in the order the forward runs them (`--blocks`)",
        )


def _meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are ``meta`` tensors (no values
    copied; tied parameters stay tied); ``model`` itself when it is already on meta."""
    tensors = list(model.parameters()) + list(model.buffers())
    if all(t.device.type == "meta" for t in tensors):
        return model
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(
            torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
        )
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


@contextlib.contextmanager
def _rng_preserved():
    """Restore the CPU and (initialised) CUDA generators: tracing draws dropout masks."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        yield


@contextlib.contextmanager
def _state_restored(model: nn.Module):
    """Trace a live model without changing it: every parameter and buffer gets its value
    back (all of them: BatchNorm's kernel updates its running statistics without moving
    their version counters), and every module its training flag."""
    tensors = [*model.parameters(), *model.buffers()]
    before = [t.detach().clone() for t in tensors]
    flags = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, value in zip(tensors, before):
                t.copy_(value)
        for m, flag in flags:
            m.training = flag
