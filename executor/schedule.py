"""Replays the plan's per-segment events from forward hooks and backward boundaries.

[Note: segment boundaries]
The plan's segments are ``<pre>``, each block, ``<post>`` (``plan.py``). Their
starts and ends are caught as follows:

forward                                  backward
  begin <pre>     engine, before model()   begin <post>    engine, before .backward()
  end <pre>       block 0 pre-hook         end <post>      block N-1 pre-backward
  begin block i   block i pre-hook         begin block i   block i pre-backward
  end block i     block i post-hook        end block i     block i post-backward
  begin <post>    block N-1 post-hook      begin <pre>     block 0 post-backward
  end <post>      engine, after model()    end <pre>       engine, after .backward()

*Pre-backward* of block i is an identity autograd Function on the block's output:
its backward runs when the output's gradient is complete, i.e. just before the
block's own backward. *Post-backward* is the same Function on the block's input:
its backward runs once the gradient w.r.t. the input exists, i.e. after the
block's backward. A begin replays ``swap_in``, ``fetch`` (and waits for those
uploads), then ``prefetch``; an end replays ``offload`` and ``release`` — the
rules ``validation.simulate_residency`` checks, so a loaded plan cannot overflow its
buffers here.

The block's input is its hidden states: the first positional argument, or the
``hidden_states`` keyword (``block_input``); its output is a tensor or a tuple
whose first element is the hidden states (``first_tensor``). Hugging Face blocks
also take masks, position ids and RoPE ``(cos, sin)`` computed once in ``<pre>``;
those pass through without a boundary. They carry no gradient in the supported
models (a mask, or cos/sin computed under no_grad from a buffer), so the hidden
states remain the only path by which backward leaves a block.

[Note: gradient completion]
The plan offloads a chunk's gradients at the end of its last backward segment.
Autograd may still be accumulating one of the chunk's parameters at that moment
(an ``AccumulateGrad`` node can run after the node that consumed the boundary),
so an offload waits for a per-chunk countdown driven by
``register_post_accumulate_grad_hook``: when the plan's moment has come *and*
every trainable parameter of the chunk has its gradient, the offload happens.
Whatever is left when backward returns (parameters that got no gradient) is
offloaded then. Under ZeRO-3 a trainable persistent chunk takes the same path: its
moment is the end of the backward step of the first segment that uses it, and
its "offload" starts its gradient reduction across the ranks, asynchronously, so
it runs beside the rest of backward (engine.py [Note: overlapped reductions]).
The same hooks, on every trainable parameter (persistent chunks
too), record which parameters got a gradient (``Chunk.has_grad``): only those
step (optim.py [Note: which parameters step]). Frozen parameters get no hook.

[Note: boundaries on tensors without grad]
A boundary's backward runs only if its output requires grad. Block 0's input
does not when the embedding is frozen (and a frozen block may return hidden
states that do not). Such a boundary takes a second input, ``Replayer.anchor``, a
0-dim leaf that requires grad and never receives a gradient: the output then
requires grad and the block's backward boundaries fire as usual. The cost is the
backward of the ops between that boundary and the first trainable parameter,
which plain PyTorch would skip.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch
from torch import nn

from protrain.plans import accounting
from protrain.plans.errors import ConfigError
from protrain.plans.plan import POST, PRE, Plan, Step
from protrain.plans.validation import segment_chunks

from .activations import Activations


class Phase(enum.Enum):
    """What the engine is doing; hooks act only in the phase they belong to."""

    IDLE = "idle"
    """Between steps: offloaded chunks hold no device memory (access.py [Note: the model between
    steps] says what a call of the model does then)."""
    FORWARD = "forward"
    """Inside the model's forward: block hooks replay forward steps."""
    EVALUATE = "evaluate"
    """Inside a root's no-grad forward (``Engine.evaluate``'s, access.py): block hooks replay
    forward steps; no backward boundaries."""
    BACKWARD = "backward"
    """Inside ``.backward()``: boundary Functions replay backward steps."""


class Boundary(torch.autograd.Function):
    """Identity in forward; calls ``callback`` when its output's gradient arrives.
    See [Note: boundaries on tensors without grad] for the optional ``anchor`` input."""

    @staticmethod
    def forward(ctx, callback: Callable[[], None], x: torch.Tensor, *anchor) -> torch.Tensor:
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.callback()
        return None, grad, *(None for _ in ctx.needs_input_grad[2:])

    @staticmethod
    def mark(callback: Callable[[], None], x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """``apply``, with ``anchor`` as an extra input when ``x`` does not require grad."""
        return (
            Boundary.apply(callback, x) if x.requires_grad else Boundary.apply(callback, x, anchor)
        )


BLOCKS_FIX = "choose block paths whose modules map hidden states to hidden states (`--blocks`)"


def first_tensor(x) -> tuple[torch.Tensor, Callable]:
    """The tensor a block takes or returns (HF blocks return tuples), and how to put it back."""
    if isinstance(x, torch.Tensor):
        return x, lambda t: t
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor):
        return x[0], lambda t: type(x)((t, *x[1:]))
    raise ConfigError(
        f"a block took or returned {type(x).__name__}; blocks must take and return a tensor "
        "(or a tuple whose first element is the hidden states)",
        BLOCKS_FIX,
    )


HIDDEN_STATES = "hidden_states"
"""The keyword Hugging Face blocks take their input under when it is not passed positionally."""


def block_input(args: tuple, kwargs: dict) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple]]:
    """The hidden states a block is called with, and how to put a replacement back.

    The first positional argument (the zoo's blocks, HF blocks in transformers 4 and 5)
    or else the ``hidden_states`` keyword; the other arguments (masks, RoPE cos/sin,
    position ids) pass through untouched. ``put(t)`` returns ``(args, kwargs)``, the
    form a ``with_kwargs=True`` forward pre-hook returns.
    """
    if args:
        x, put = first_tensor(args)
        return x, lambda t: (put(t), kwargs)
    if isinstance(kwargs.get(HIDDEN_STATES), torch.Tensor):
        return kwargs[HIDDEN_STATES], lambda t: (args, {**kwargs, HIDDEN_STATES: t})
    raise ConfigError(
        f"a block was called with keywords {sorted(kwargs)} and no positional argument; blocks "
        f"must take the hidden states first or as {HIDDEN_STATES}=",
        BLOCKS_FIX,
    )


class Replayer:
    """Holds the schedule and the hooks; calls into the chunk store, activations and offload."""

    def __init__(
        self, model: nn.Module, plan: Plan, acts: Activations, offload: Callable[[int], None]
    ):
        self.store = store = acts.store  # the chunk store (activations.py holds the engine's)
        self.acts = acts
        self.events = store.copies.events  # the engine's listeners (events.py)
        self.offload = offload  # the engine's gradient offload (and CPU step) for one chunk
        self.phase = Phase.IDLE
        self.blocks = list(plan.model.blocks)
        self.steps: dict[tuple[Phase, str], Step] = {
            **{(Phase.FORWARD, s.segment): s for s in plan.schedule.forward},
            **{(Phase.BACKWARD, s.segment): s for s in plan.schedule.backward},
        }
        # Gradient countdown per offloaded chunk (trainable parameters only: a frozen one
        # never gets a gradient); see [Note: gradient completion].
        self.param_slot: dict[int, tuple[int, int]] = {}  # id(param) → (chunk id, index in params)
        self.n_params: dict[int, int] = {}
        # The chunks whose gradients are complete at the end of each backward step: the
        # plan's offloads and, under ZeRO-3, each trainable persistent chunk at the end of
        # the first segment (in forward order) that uses it, for its reduction.
        self.complete = {s.segment: list(s.offload) for s in plan.schedule.backward}
        first = {c: seg for seg, ids in reversed(segment_chunks(plan).items()) for c in ids}
        for c in store.chunks:
            trainable = [i for i, (p, _, _) in enumerate(c.params) if p.requires_grad]
            if not c.persistent or (store.comm.world > 1 and trainable):
                self.n_params[c.id] = len(trainable)
                if c.persistent:
                    self.complete[first.get(c.id, PRE)].append(c.id)
            self.param_slot.update({id(c.params[i][0]): (c.id, i) for i in trainable})
        # See [Note: boundaries on tensors without grad]. 0-dim, device, never gets a gradient.
        self.anchor = torch.zeros((), device=store.device, requires_grad=True)
        self.remaining: dict[int, int] = {}  # chunk → parameters still without gradient
        self.requested: set[int] = set()  # chunks whose plan-given offload moment has passed
        # The plan's offload order; offloads happen strictly in it, so every rank issues
        # its gradient collectives in the same order (executor/dist.py).
        self.offload_order = [c for s in plan.schedule.backward for c in self.complete[s.segment]]
        self.next_offload = 0  # index into offload_order
        self.handles: list = []
        # The CPU ledger counts the gradient autograd holds between two segments' backward
        # steps (a tied weight's; accounting.shared_grads): no hook sees that buffer.
        self.shared = accounting.shared_grads(
            plan,
            [c.trainable for c in store.chunks],
            {n for n, p in model.named_parameters() if not p.requires_grad},
        )

    def install(self, model: nn.Module) -> None:
        modules = dict(model.named_modules())
        for i, name in enumerate(self.blocks):
            m = modules[name]
            self.handles += [
                m.register_forward_pre_hook(self._hook(i, name, pre=True), with_kwargs=True),
                m.register_forward_hook(self._hook(i, name, pre=False)),
            ]
        for cid, i in self.param_slot.values():  # the trainable parameters
            p = self.store.chunks[cid].params[i][0]
            self.handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    def check_trainable(self, names: dict[int, str]) -> None:
        """Refuse a step after ``requires_grad`` changed since wrap: hooks, countdowns and the
        optimizer's state were set up for the parameters trainable then."""
        for c in self.store.chunks:
            for p, _, _ in c.params:
                if p.requires_grad != (id(p) in self.param_slot):
                    raise ConfigError(
                        f"parameter {names[id(p)]!r} was "
                        f"{'frozen' if p.requires_grad else 'trainable'} at wrap and is "
                        f"{'trainable' if p.requires_grad else 'frozen'} now",
                        "set requires_grad before wrap(model, plan); to change it, close the "
                        "engine, save its state_dict and wrap again",
                    )

    def uninstall(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # -- events

    def begin(self, phase: Phase, segment: str) -> None:
        step = self.steps[(phase, segment)]
        for b in step.swap_in:
            with self.events.about("swap_in", block=b):
                self.acts.swap_in(b)
        for c in step.fetch:
            with self.events.about("fetch", chunk=c):
                self.store.fetch(c)
        for c in step.fetch:
            self.store.wait(c)
            if phase is Phase.BACKWARD:
                self.store.open_grad(c)
        if phase is Phase.BACKWARD:
            self.store.ledger.alloc("shared_grads", self.shared[segment, 1])
        for c in step.prefetch:
            with self.events.about("prefetch", chunk=c):
                self.store.fetch(c)
        self.acts.segment = self.events.segment = segment
        # The span from here to ``end`` is the segment's compute (events.py [Note: events]).
        self.events.emit("segment", "begin", phase=self.phase.value, segment=segment)
        self._check(phase, segment, "begin")

    def end(self, phase: Phase, segment: str) -> None:
        step = self.steps[(phase, segment)]
        self.events.emit("segment", "end", phase=self.phase.value, segment=segment)
        if phase is Phase.BACKWARD:
            self.requested.update(self.complete[segment])
            self._drain()
            self.acts.end_backward(segment)
            self.store.ledger.free("shared_grads", self.shared[segment, -1])
        for c in step.release:
            self.store.release(c)
            self.events.emit("release", "mark", chunk=c)
        self._check(phase, segment, "end")

    def _check(self, phase: Phase, segment: str, when: str) -> None:
        """``Ledger.check``: the model states counted now are what accounting.py streams."""
        done = self.offload_order[: self.next_offload]
        deferred = sum(
            self.store.chunks[c].nbytes
            for c in self.requested.difference(done)
            if self.store.chunks[c].grad_live and not self.store.chunks[c].persistent
        )
        self.store.ledger.check(phase.value, segment, when, deferred)

    def start_backward(self) -> None:
        self.remaining = dict(self.n_params)
        self.requested.clear()
        self.next_offload = 0

    def finish_backward(self) -> None:
        """After ``.backward()`` returned: offload whatever the countdown still held back
        (parameters that got no gradient), in plan order."""
        self._drain(everything=True)

    def _drain(self, everything: bool = False) -> None:
        """Offload, in plan order, every chunk whose moment has come and whose gradients are
        complete (``everything``: every chunk not offloaded yet)."""
        order = self.offload_order
        while self.next_offload < len(order):
            c = order[self.next_offload]
            if not everything and (c not in self.requested or self.remaining[c] != 0):
                return
            self.offload(c)
            self.next_offload += 1

    def _grad_ready(self, p: nn.Parameter) -> None:
        cid, i = self.param_slot[id(p)]
        self.store.chunks[cid].has_grad.add(i)  # optim.py [Note: which parameters step]
        if cid not in self.remaining:
            return  # persistent, one rank
        self.remaining[cid] -= 1
        if self.remaining[cid] == 0 and cid in self.requested:
            self._drain()

    # -- hooks

    def _turn(self, phase: Phase, ended: str | None, begun: str | None) -> None:
        """End segment ``ended``, then begin ``begun`` (None: no such segment at this boundary).
        A backward boundary acts only inside ``.backward()``."""
        if phase is Phase.BACKWARD and self.phase is not Phase.BACKWARD:
            return
        if ended is not None:
            self.end(phase, ended)
        if begun is not None:
            self.begin(phase, begun)

    def _hook(self, i: int, name: str, pre: bool):
        """Block ``i``'s forward pre-hook (``pre``) or forward hook. A pre-hook ends the segment
        before the block's (``<pre>`` before block 0; a block's own end was its forward hook)
        and begins the block's, and marks its input with the post-backward boundary; a forward
        hook ends the block's segment, begins the one after (``<post>`` after the last block),
        and marks its output with the pre-backward boundary. Backward makes each turn in
        reverse: it ends what forward began and begins what forward ended."""
        other = (PRE if i == 0 else None) if pre else (POST if i == len(self.blocks) - 1 else None)
        turn = (other, name) if pre else (name, other)  # (ended, begun) in forward

        def hook(module, args, kwargs_or_output):
            if self.phase not in (Phase.FORWARD, Phase.EVALUATE):
                return None
            self._turn(Phase.FORWARD, *turn)
            if self.phase is Phase.EVALUATE:  # no backward: no boundary
                return None
            x, put = block_input(args, kwargs_or_output) if pre else first_tensor(kwargs_or_output)
            return put(
                Boundary.mark(lambda: self._turn(Phase.BACKWARD, *turn[::-1]), x, self.anchor)
            )

        return hook
