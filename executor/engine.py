"""``wrap(model, plan) -> Engine``: the executor's one entry point.

Lifecycle, phase by phase:

1. **wrap** checks the plan against the live model (``check.py``: fingerprint,
   names, shapes, tied parameters) and refuses a plan for another model before
   anything changes. It then lays every parameter into the plan's chunks
   (``ChunkStore``: ``param.data`` and ``param.grad`` become views of flat chunk
   tensors), gives persistent chunks their device memory and offloaded chunks a
   host home, builds the optimizer (device AdamW for persistent chunks, a CPU
   AdamW worker for offloaded ones), installs the activation policies and the
   schedule's hooks.
2. **step(batch)** runs, for each of the plan's ``grad_accum`` micro-batches, a
   forward (block hooks replay the forward steps: fetch, prefetch, release) and a
   backward (boundary Functions replay the backward steps: swap-in, fetch,
   offload, release; offloaded chunks' CPU AdamW steps start as their gradients
   land), then finishes the update: device AdamW for persistent chunks, clipping
   and fp16 overflow handling when configured. It returns a ``StepResult``. Every chunk
   steps at the rate ``lr``, which ``set_lr`` changes between steps (a schedule).
3. **state_dict / load_state_dict** move model and optimizer state in plain
   PyTorch names and shapes, independent of the chunk layout, so a run can resume
   under another plan; **save / load** write and read them atomically as
   safetensors files with a JSON manifest (``checkpoint.py``).
4. **close** waits for pending CPU steps and removes every hook and wrapper.

The engine replays; it never decides. Everything it does at a block boundary is
written in the plan (an executor that decided on its own would run a plan nobody made).
"""

from __future__ import annotations

import inspect
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from protrain.plans import accounting
from protrain.plans.errors import (
    BudgetError,
    ConfigError,
    NonFiniteGradientError,
    NonFiniteLossError,
)
from protrain.plans.plan import POST, PRE, Plan, canonical
from protrain.plans.validation import validate

from .access import Access
from .activations import Activations
from .check import check
from .checkpoint import base_fingerprint, load, resolve, save
from .chunks import DTYPES, ChunkStore, Residency
from .dist import Comm
from .events import Listener
from .memory import Ledger, expected_states
from .optim import AdamWConfig, ChunkOptimizer, LossScaler, clip_coefficient
from .schedule import Boundary, Phase, Replayer, first_tensor
from .transfer import CopyEngine

Batch = tuple[torch.Tensor, ...]
"""A micro-batch: ``(idx, targets)`` or ``(idx, targets, position_ids)``, each int64 (micro_batch,
seq_len). See [Note: supervised tokens]."""

IGNORE = -100
"""A target that carries no loss (Hugging Face's label convention, cross_entropy's default)."""

# [Note: supervised tokens]
# ``targets[b, t]`` is the token the model should predict after ``idx[b, t]``, IGNORE where
# no loss is wanted (prompts, padding); ``position_ids``, when given, restart at 0 at each
# example packed into a row, and the model keeps attention within each example. A step's
# loss is the sum of its token losses over N, the number of supervised targets in the whole
# step (every micro-batch, every rank), as transformers' Trainer normalises with
# ``num_items_in_batch``. The model returns micro-batch i's mean over its n_i supervised
# targets, so the step's loss is sum_i mean_i * n_i / N, and micro-batch i's backward is
# weighted n_i * W / N (the ranks' gradients are averaged: a factor 1/W). When every token
# of the step is supervised (raw text) every weight is 1/k, and the engine keeps that
# arithmetic (``loss / k``, the mean of the means): equal in value, and in bits to what it
# always computed. A micro-batch with n_i = 0 still runs forward and backward (every block,
# as the schedule expects) with weight 0. N is known before the first backward: counted
# from the step's micro-batches, or, for an iterator drawn one micro-batch at a time,
# given by the caller (``step(..., num_items=...)``); without it an iterator must be raw
# text, every target supervised.


def _supervised(targets: torch.Tensor) -> int:
    """Targets that carry loss (``!= IGNORE``), counted on the host tensor before its device
    move, so counting syncs nothing."""
    return int((targets != IGNORE).sum())


def _size(n: float) -> str:
    """Bytes as a --budget value: ``1.5GiB`` or ``300MiB``."""
    return f"{n / (1 << 30):.1f}GiB" if n >= 1 << 30 else f"{max(n / (1 << 20), 0.1):.1f}MiB"


@dataclass(frozen=True)
class StepResult:
    loss: float
    """Mean loss over the step's micro-batches (unscaled)."""
    grad_norm: float | None
    """Global gradient L2 norm before clipping (None when neither clipping nor fp16 asked for
    it)."""
    peak_bytes: int
    """Peak device bytes during the step (allocator on CUDA, the ledger's count on CPU)."""
    skipped: bool = False
    """True when fp16 overflow skipped the update."""
    timings_s: dict[str, float] = field(default_factory=dict)
    """Wall seconds: forward, backward, optim (device steps and waiting for CPU steps), total."""
    reserved_peak_bytes: int = 0
    """CUDA: ``max_memory_reserved`` during the step (what a budget must cover); CPU: 0."""
    alloc_retries: int = 0
    """CUDA: allocator retries (cache flushes after a failed cudaMalloc) so far; CPU: 0."""


def wrap(
    model: nn.Module,
    plan: Plan,
    optimizer: AdamWConfig | None = None,
    device: str | torch.device | None = None,
    nvme_dir: str | os.PathLike | None = None,
) -> Engine:
    """Lay ``model`` out as ``plan`` says and return the Engine that trains it.

    ``model``'s parameters must hold real values (on the host or the device); the
    model's forward must take ``(idx, targets)`` and return the scalar loss.
    ``device`` defaults to CUDA when available, else CPU. ``nvme_dir``: where the
    plan's ``placement.nvme`` chunks keep their optimizer states (executor/nvme.py);
    needed exactly when the plan has some.
    """
    return Engine(model, plan, optimizer or AdamWConfig(), device, nvme_dir)


def agreement(plan: Plan, config: AdamWConfig) -> dict[str, object]:
    """What every rank's plan and optimizer must agree on (``Comm.agree``): the training shape
    and activation policies by name, then a digest of every binding section (the rest)."""
    return {
        "$.model.fingerprint": plan.model.fingerprint,
        **{
            f"$.training.{k}": getattr(plan.training, k)
            for k in ("micro_batch", "seq_len", "grad_accum", "compute_dtype")
        },
        "$.activations (the blocks' policies)": [a.policy for a in plan.activations],
        "$.schedule.cpu_adam": plan.schedule.cpu_adam,
        # (digested: dist.py)
        **{
            f"$.{s} (the plan's binding section)": canonical(getattr(plan, s))
            for s in ("chunks", "placement", "activations", "schedule")
        },
        # each setting under its own flag, so a disagreement names the one that differs
        **{
            f"{flag} (AdamW's {field})": repr(getattr(config, field)) for field, flag in OPTIM_FLAGS
        },
    }


OPTIM_FLAGS = (
    ("lr", "--lr"),
    ("betas", "--betas"),
    ("eps", "--eps"),
    ("weight_decay", "--weight-decay"),
    ("max_grad_norm", "--max-grad-norm"),
    ("loss_scale", "the fp16 loss scale"),
    ("scale_window", "the fp16 loss scale window"),
)
"""``AdamWConfig``'s fields and the ``protrain train`` flags that set them (``agreement``)."""


def _check_cpu_adam(plan: Plan, what: str, hint: str) -> None:
    """Refuse ``what``, which needs every gradient before any parameter changes, under a plan
    whose CPU-step schedule starts CPU steps in backward (optim.py [Note: when CPU steps can
    start]). (fp16 loss scaling needs the same; ``validate``, which wrap runs first, refuses
    such a plan.)"""
    if plan.schedule.cpu_adam != "after_backward":
        raise ConfigError(
            f"{what} needs every gradient before any parameter changes, but the plan overlaps "
            f"CPU AdamW steps with backward (schedule.cpu_adam = {plan.schedule.cpu_adam!r})",
            f"make the plan for clipping: `protrain plan … --max-grad-norm X` ({hint})",
        )


def _image(c, parts: list[torch.Tensor]) -> torch.Tensor:
    """A whole-chunk fp32 image (padding zero) of one tensor per parameter of chunk ``c``."""
    full = torch.zeros(c.numel, dtype=torch.float32)
    for (_p, off, n), t in zip(c.params, parts):
        full[off : off + n].copy_(t.reshape(-1))
    return full


class Engine:
    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        config: AdamWConfig,
        device: str | torch.device | None,
        nvme_dir: str | os.PathLike | None = None,
    ):
        validate(plan, "plan")  # a Plan built in memory has not been through load()
        check(plan, model)  # refuses before any state changes
        if config.max_grad_norm is not None:
            _check_cpu_adam(
                plan, "gradient clipping (max_grad_norm)", "fp16 plans do it themselves"
            )
        self.comm = Comm(plan.training.world_size)  # refuses a world-size mismatch
        dev = torch.device(
            device if device is not None else "cuda" if torch.cuda.is_available() else "cpu"
        )
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        # before any other collective: ranks with other plans would deadlock in them (dist.py
        # [Note: ranks agree])
        self.comm.agree(agreement(plan, config), dev)
        self.model, self.plan, self.device, self.config = model, plan, dev, config
        # The model's own parameter order: clipping reduces norms in this order, as
        # clip_grad_norm_(model.parameters()) does.
        self.param_order = list(model.parameters())
        # Whether packed micro-batches (with position_ids) can run: [Note: supervised tokens].
        self.takes_position_ids = "position_ids" in inspect.signature(model.forward).parameters
        self.names = {id(p): n for n, p in model.named_parameters()}
        # "" unless mostly frozen: checkpoints save the rest only
        self.base_fingerprint = base_fingerprint(model)
        for _, b in model.named_buffers():
            b.data = b.data.to(dev)
        self.ledger = Ledger(dev)
        self.copies = CopyEngine(dev)
        self.comm.runner = self.copies.collective  # see tools/emulation.py
        # The listeners of on_event, shared by every part of the engine (events.py).
        self.events = self.comm.events = self.copies.events
        self.store = self.optim = self.acts = self.replayer = self.access = None
        self.handles: list = []  # the root's hooks of [Note: split phases]
        try:
            self.store = ChunkStore(model, plan, self.copies, self.ledger, self.comm, nvme_dir)
            self.optim = ChunkOptimizer(self.store, config)
            # optim.py [Note: finite-state guard]
            self.optim.nonfinite_error = self._nonfinite_error
            self._expect_accounting(plan)
            self.scaler = LossScaler(plan.training.compute_dtype == "float16", config)
            self.acts = Activations(model, plan, self.store)
            self.replayer = Replayer(model, plan, self.acts, self._offload)
            self.acts.install()
            # before the replayer's guard: see [Note: split phases]
            self.handles = [
                model.register_forward_pre_hook(self._outside_forward, with_kwargs=True),
                model.register_forward_hook(self._outside_forward_done),
            ]
            self.replayer.install(model)
            # The model's own calls between steps: access.py [Note: the model between steps].
            self.access = Access(self, model)
            self.access.install()
        except BaseException:
            self._teardown()  # nothing pinned, no hook or worker left behind by a failed wrap
            raise
        # Per-step state, set in step().
        self._reducing: dict[int, tuple] = {}  # persistent chunk → (its reduction's output, work)
        # [Note: when CPU steps can start] in optim.py: the plan's schedule, which the
        # planner costed; clipping and fp16 need the after-backward one.
        self._defer_cpu_steps = plan.schedule.cpu_adam == "after_backward"
        self.steps_done = 0
        # The newest checkpoint saved or loaded here (all finite).
        self.last_checkpoint: str | None = None
        # True while step() runs: the rate may not change then (optim.py [Note: learning rate]).
        self._stepping = False
        # [Note: split phases]: micro-batches whose backward ran in this step (None between
        # steps); the open forward's activation counting, until its backward begins; the
        # step's gradient norm once computed (a 0-dim device tensor); what gives each step's
        # rate (an optimizer's param_groups[0]["lr"]), read at its first forward.
        self._micro: int | None = None
        self._pending = None
        self._norm: torch.Tensor | None = None
        self.rate_source: Callable[[], float] | None = None

    def follow_rate(self, source: Callable[[], float] | None) -> None:
        """Take each step's rate from ``source()`` at its first forward ([Note: split phases]):
        an optimizer's ``param_groups[0]["lr"]``, which a scheduler writes."""
        self.rate_source = source

    def _expect_accounting(self, plan: Plan) -> None:
        """What wrap allocated must be what ``accounting.py`` says, and so must every step
        boundary's model states (``Ledger.check``, called by the replayer)."""
        trainable = [c.trainable for c in self.store.chunks]
        # (state_events' first part: the events at wrap)
        host = sum(
            e.nbytes for e in accounting.state_events(plan, trainable)[0] if e.where == "host"
        )
        if self.ledger.host_bytes != host:
            raise AssertionError(
                f"host states: counted {self.ledger.host_bytes} B, accounting.py says {host} B"
            )
        self.ledger.expected = expected_states(plan, trainable)

    # -- observation

    def on_event(
        self, callback: Listener, *, count_activations: bool = False
    ) -> Callable[[], None]:
        """Call ``callback(event)`` for everything the engine does, as it does it, until the
        returned function is called: segments, copies, releases, optimizer steps, collectives
        (``executor/events.py`` [Note: events] lists each ``Event``). Some events come from
        the CPU AdamW worker thread, so ``callback`` must be thread-safe and short.

        ``count_activations``: count saved activations also on CUDA (always on CPU, for the
        ledger), and so receive the ``saved`` events (what the profiler measures). Counting
        adds a pack hook per saved tensor and stays on for the engine's life. Add listeners
        between steps.
        """
        if count_activations:
            self.acts.count = True
        return self.events.listen(callback)

    # -- the training step

    def _check_batch(self, batches: Sequence[Batch], count: bool = True, first: int = 0) -> None:
        if count and len(batches) != self.plan.training.grad_accum:
            raise self._count_error(len(batches))
        for i, mb in enumerate(batches, first):
            if not isinstance(mb, tuple | list) or len(mb) not in (2, 3):
                raise ConfigError(
                    f"micro-batch {i} is a {type(mb).__name__}"
                    + (f" of {len(mb)} tensors" if isinstance(mb, tuple | list) else ""),
                    "pass (idx, targets) or, for packed rows, (idx, targets, position_ids)",
                )
            if len(mb) == 3 and not self.takes_position_ids:
                raise ConfigError(
                    f"micro-batch {i} has position_ids (packed rows), but "
                    f"{type(self.model).__name__}.forward takes no position_ids: its examples "
                    "would attend to each other",
                    "give the model forward(idx, targets, position_ids=None) that restarts "
                    "positions and masks attention at each example, or pass (idx, targets) "
                    "pairs of unpacked rows",
                )
            for what, tensor in zip(("idx", "targets", "position_ids"), mb):
                self._check_shape(f"micro-batch {i}: {what} has shape", tuple(tensor.shape))

    def _count_error(self, n: int, after: str = "") -> ConfigError:
        """``n`` micro-batches where the plan accumulates another number per step."""
        k = self.plan.training.grad_accum
        return ConfigError(
            f"step() got {n} micro-batches; the plan accumulates {k} per step{after}",
            "pass one (idx, targets) pair per micro-batch",
        )

    def _check_shape(self, what: str, shape: tuple[int, ...] | None) -> None:
        """Refuse a tensor (``what`` has shape ``shape``) of another shape than the plan's."""
        t = self.plan.training
        if shape != (t.micro_batch, t.seq_len):
            raise ConfigError(
                f"{what} {shape}, but the plan was made for ({t.micro_batch}, "
                f"{t.seq_len}) (micro_batch, seq_len)",
                "batch the data as the plan says, or make a plan for this shape with "
                "`protrain plan`",
            )

    def _draws(
        self, batch: Batch | Sequence[Batch] | Iterator[Batch], num_items: int | None
    ) -> tuple[Iterator[tuple[Batch, int]], int]:
        """The step's micro-batches in order, each with its count of supervised targets, and this
        rank's count for the step ([Note: supervised tokens]): a sequence checked and counted
        whole before anything runs; an iterator drawn one micro-batch at a time (exactly
        ``grad_accum`` of them), each checked as it is drawn, so a step holds one micro-batch,
        not ``grad_accum`` of them."""
        if isinstance(batch, tuple) and isinstance(batch[0], torch.Tensor):
            batch = [batch]
        if isinstance(batch, Sequence):
            self._check_batch(batch)
            counts = [_supervised(mb[1]) for mb in batch]  # host tensors: no device sync
            if num_items is not None and num_items != sum(counts):
                raise ConfigError(
                    f"step() got num_items={num_items}, but its micro-batches hold {sum(counts)} "
                    "supervised targets (targets != -100)",
                    "leave num_items out for a list of micro-batches: the engine counts them",
                )
            return zip(batch, counts), sum(counts)
        t = self.plan.training
        local = t.grad_accum * t.micro_batch * t.seq_len if num_items is None else num_items
        return self._drawn_one_at_a_time(iter(batch), num_items), local

    def _drawn_one_at_a_time(
        self, it: Iterator[Batch], num_items: int | None
    ) -> Iterator[tuple[Batch, int]]:
        t = self.plan.training
        k, drawn = t.grad_accum, 0
        closed = "(the engine must be closed: the drawn ones have run)"
        for i in range(k):
            mb = next(it, None)
            if mb is None:
                raise self._count_error(i, f" {closed}")
            self._check_batch([mb], count=False, first=i)
            n = _supervised(mb[1])
            drawn += n
            # Before this micro-batch runs: only the last one's backward may start CPU steps.
            if num_items is None and n != t.micro_batch * t.seq_len:
                raise ConfigError(
                    f"micro-batch {i} has {n} supervised targets of {t.micro_batch * t.seq_len} "
                    "(the others are -100), and step() draws it from an iterator, so it cannot "
                    f"count the step's supervised targets before the first backward {closed}",
                    "give their number: step(it, num_items=N), N the targets != -100 in this "
                    "step's micro-batches on this rank (transformers' num_items_in_batch), or "
                    "pass a list of the step's micro-batches",
                )
            if num_items is not None and (drawn > num_items or i == k - 1 and drawn != num_items):
                raise ConfigError(
                    f"step(num_items={num_items}): its micro-batches 0 to {i} hold {drawn} "
                    f"supervised targets {closed}",
                    "count the targets != -100 of this step's micro-batches on this rank",
                )
            yield mb, n

    @property
    def lr(self) -> float:
        """The AdamW learning rate the next step uses (``AdamWConfig.lr`` until ``set_lr``)."""
        return self.optim.hyper["lr"]

    def set_lr(self, lr: float) -> None:
        """Use ``lr`` from the next step on, for every chunk, on the device and on the CPU
        worker alike (a schedule calls it before each step, as ``protrain train`` does). A step
        still finishing on the worker keeps its own rate: optim.py [Note: learning rate]."""
        if isinstance(lr, bool) or not isinstance(lr, int | float) or not 0 <= lr < math.inf:
            raise ConfigError(
                f"set_lr({lr!r}): a learning rate must be a finite number >= 0",
                "pass a float >= 0 such as 3e-4",
            )
        if self._stepping:
            raise ConfigError(
                "set_lr() was called while a step is running (from a listener or another thread); "
                "the step's chunks must all use one rate",
                "set the rate between steps: before calling step()",
            )
        self.optim.hyper["lr"] = float(lr)

    def step(
        self, batch: Batch | Sequence[Batch] | Iterator[Batch], num_items: int | None = None
    ) -> StepResult:
        """One optimizer step over the plan's ``grad_accum`` micro-batches, at rate ``lr``.

        ``batch``: an ``(idx, targets)`` pair or ``(idx, targets, position_ids)`` triple
        (when ``grad_accum`` is 1), a sequence of them (shapes checked against the plan
        before anything runs), or an iterator that yields them (drawn one at a time, as
        each is needed: ``protrain train`` passes its data stream so, and holds one
        micro-batch at a time). ``num_items``: the step's supervised targets (!= -100) on
        this rank, which an iterator with masked targets must give (transformers'
        ``num_items_in_batch``, per rank); see [Note: supervised tokens].
        """
        self._stepping = True
        try:
            return self._step(batch, num_items)
        finally:
            self._stepping = False

    def _step(self, batch, num_items: int | None) -> StepResult:
        draws, local = self._draws(batch, num_items)
        k, t = self.plan.training.grad_accum, self.plan.training
        total = self._count_all(local, f"step {self.steps_done + 1}")  # N
        # Raw text: today's arithmetic, loss / k ([Note: supervised tokens]).
        every = total == self.comm.world * k * t.micro_batch * t.seq_len
        self._begin_step()
        t0 = time.perf_counter()
        timings = {"forward": 0.0, "backward": 0.0, "optim": 0.0}
        losses = []
        for i, (mb, n) in enumerate(draws):
            # p: [] or [position_ids]; contiguous: a model's .view(-1) refuses the shift idiom's
            # strided slices (x[:, :-1], x[:, 1:])
            x, y, *p = (v.to(self.device, non_blocking=True).contiguous() for v in mb)
            ta = time.perf_counter()
            try:
                # The root's hooks run the plan's forward, and the loss's backward the plan's
                # backward, as for a caller that drives the model itself ([Note: split phases]).
                loss = self.model(x, y, position_ids=p[0]) if p else self.model(x, y)
                if not self.scaler.enabled and n:  # (n = 0: a mean over nothing, weighted 0)
                    self._check_finite(loss, i)
                tb = time.perf_counter()
                if every:
                    scaled = loss if k == 1 else loss / k
                else:  # n = 0: weight 0, and backward still runs every block, adding zeros
                    scaled = loss * (n * self.comm.world / total if n else 0.0)
                if self.scaler.enabled:
                    scaled = scaled * self.scaler.scale
                scaled.backward()
            except torch.OutOfMemoryError as e:
                raise self._oom_error(e) from None
            finally:
                self.replayer.phase = Phase.IDLE
            losses.append((loss.detach(), n))
            timings["forward"] += tb - ta
            timings["backward"] += time.perf_counter() - tb

        tc = time.perf_counter()
        grad_norm, skipped = self._end_step()
        timings["optim"] = time.perf_counter() - tc
        timings["total"] = time.perf_counter() - t0
        loss_value = self._mean_loss(losses, every, total, "the loss")
        reserved, retries = self.ledger.allocator_stats()
        self.events.emit("step", "end", loss=loss_value)
        return StepResult(
            loss=loss_value,
            grad_norm=grad_norm,
            peak_bytes=self.ledger.device_peak_bytes(),
            skipped=skipped,
            timings_s=timings,
            reserved_peak_bytes=reserved,
            alloc_retries=retries,
        )

    # -- the phases of a step
    # [Note: split phases]
    # A step is begin_step, then per micro-batch the plan's forward around the model's, the
    # plan's backward around the loss's, and end_step (the update). Both ``step`` and a
    # caller that drives the model itself (transformers' Trainer: ``loss = model(...)``,
    # ``loss.backward()``, ``optimizer.step()``) reach them from hooks: the root's forward
    # pre-hook begins the forward (and the step, at its first micro-batch) when grad is
    # enabled between micro-batches; its forward hook ends it and marks the output with a
    # ``Boundary`` whose backward, run when the output's gradient arrives, begins the plan's
    # backward and queues end_backward on autograd's engine (as FSDP2's root post-backward
    # callback), which runs when the whole backward has. ``step`` begins the step itself,
    # and ends it as ``finish_step`` does, after exactly ``grad_accum`` backwards. Only the
    # last micro-batch's backward may start CPU steps, and the rate (``rate_source``) is
    # read at the first forward, before any chunk can step.

    def _begin_step(self) -> None:
        self.replayer.check_trainable(self.names)
        self._refuse_poisoned(stepping=True)
        self.optim.step_no = self.steps_done + 1
        self.events.emit("step", "begin")
        self.ledger.reset_peak()
        self.store.begin_step()
        # (a forward left by a failed step is no longer open)
        self._micro, self._pending = 0, None

    def _end_backward(self) -> None:
        self.replayer.end(Phase.BACKWARD, PRE)
        self.replayer.finish_backward()
        self.replayer.phase = Phase.IDLE
        self._micro += 1

    def _end_step(self) -> tuple[float | None, bool]:
        grad_norm, skipped = self._finish_update()
        self._refuse_poisoned(stepping=True)  # a CPU step that already found one (others: next)
        self.steps_done += 1
        self._micro, self._norm = None, None
        return grad_norm, skipped

    def _outside_forward(self, module, args, kwargs) -> None:
        """The root's forward pre-hook: a grad-enabled call between steps begins a micro-batch
        ([Note: split phases]); any other call is the replayer's to judge."""
        if self.replayer.phase is not Phase.IDLE or not torch.is_grad_enabled():
            return
        t, micro = self.plan.training, self._micro or 0
        if self._pending is not None or micro == t.grad_accum:
            raise ConfigError(
                f"the model was called for micro-batch {micro + 1} while "
                + (
                    "the previous micro-batch's backward has not run"
                    if self._pending is not None
                    else f"{micro} micro-batches await optimizer.step() (the plan accumulates "
                    f"{t.grad_accum}: $.training.grad_accum)"
                ),
                "call loss.backward() after each forward and optimizer.step() after "
                f"{t.grad_accum} of them (gradient_accumulation_steps={t.grad_accum})",
            )
        shape = tuple(args[0].shape) if args and isinstance(args[0], torch.Tensor) else None
        self._check_shape(f"micro-batch {micro + 1}: the model was called with idx of shape", shape)
        if self._micro is None:
            self._begin_step()
            if self.rate_source is not None:
                self.set_lr(self.rate_source())
        self.replayer.phase = Phase.FORWARD
        self.replayer.begin(Phase.FORWARD, PRE)
        self._pending = self.acts.counting()
        self._pending.__enter__()

    def _outside_forward_done(self, module, args, output):
        """The root's forward hook: ends the micro-batch's forward and marks its output with the
        boundary that begins the plan's backward."""
        if self._pending is None or self.replayer.phase is not Phase.FORWARD:
            return None
        self._pending.__exit__(None, None, None)
        self.replayer.end(Phase.FORWARD, POST)
        self.replayer.phase = Phase.IDLE
        out, put = first_tensor(output)
        return put(Boundary.mark(self._launch_backward, out, self.replayer.anchor))

    def _launch_backward(self) -> None:
        self._pending = None
        self.replayer.phase = Phase.BACKWARD
        self.replayer.start_backward()
        self.replayer.begin(Phase.BACKWARD, POST)
        # runs once autograd has finished this whole backward (FSDP2's final callback)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the step's gradients before clipping (``clip_grad_norm_``'s
        value), once its ``grad_accum`` backwards ran; the step clips with
        ``AdamWConfig.max_grad_norm`` itself. Needs a plan whose CPU steps wait for backward."""
        self._refuse_early("grad_norm()")
        _check_cpu_adam(self.plan, "the gradient norm", "plan_for(..., max_grad_norm=X)")
        return self._global_norm()

    def _global_norm(self) -> torch.Tensor:
        if self._norm is None:  # (once per step: under ZeRO-3 a collective)
            self._land_reductions()
            self.optim.wait_all()  # the accumulators are complete once the worker landed them
            self._norm = self.optim.global_norm(self.param_order) * (1.0 / self.scaler.scale)
        return self._norm

    def finish_step(self) -> tuple[float | None, bool]:
        """End a step whose micro-batches ran through the model's own forward and the loss's
        backward ([Note: split phases]): the update, as ``step`` ends. Returns the gradient
        norm (None unless clipping or fp16 asked for it) and whether fp16 skipped it."""
        self._refuse_early("optimizer.step()")
        self._stepping = True
        try:
            return self._end_step()
        finally:
            self._stepping = False

    def _refuse_early(self, what: str) -> None:
        k, done = self.plan.training.grad_accum, self._micro or 0
        if done != k or self._pending is not None:
            raise ConfigError(
                f"{what} came after {done} backward passes, but the plan accumulates {k} "
                "micro-batches per step ($.training.grad_accum)",
                f"run {k} forwards and backwards per step (gradient_accumulation_steps={k}), or "
                f"make the plan for {done}: `protrain plan … --grad-accum {done}`",
            )

    def _count_all(self, local: int, what: str) -> int:
        """The sum over the ranks of their supervised targets ``local``, the same on every rank
        (one collective of one integer under ZeRO-3); refused when 0, before anything runs.

        Refused rather than skipped: a loss of 0/0 means data that trains nothing (as
        Trainer's, whose loss would be NaN), and a skipped step would still count as a
        step for the data position and the checkpoints."""
        total = local
        if self.comm.world > 1:
            mine = torch.tensor(local, dtype=torch.int64, device=self.device)
            total = int(self.comm.sum(mine, f"the supervised targets of {what}").item())
        if total == 0:
            raise ConfigError(
                f"{what} has no supervised target (every target is -100, in every micro-batch "
                "on every rank): its loss would be 0/0; nothing has run",
                "drop the examples that train no token (a prompt longer than --seq, or a chat "
                "template without {% generation %} under --loss-on assistant)",
            )
        return total

    def evaluate(self, batch: Batch) -> float:
        """The loss of one ``(idx, targets)`` batch (or ``(idx, targets, position_ids)``) of the
        plan's shape, without training: over the ranks, the sum of the token losses over the
        supervised targets ([Note: supervised tokens]).

        Runs the model in eval mode under ``torch.no_grad`` while the block hooks replay
        the plan's forward fetches, prefetches and releases; afterwards every offloaded
        chunk is released again, as between steps, and the model's train/eval modes are
        restored. No gradient, activation or optimizer state changes. Under ZeRO-3 every
        rank must call it (fetches all-gather). Any other call of the model's forward
        after ``wrap`` is refused: offloaded chunks hold no device memory between steps.
        """
        self._check_batch([batch], count=False)
        t, n = self.plan.training, _supervised(batch[1])
        total = self._count_all(n, "the evaluation batch")
        x, y, *p = (v.to(self.device, non_blocking=True).contiguous() for v in batch)
        modes = {m: m.training for m in self.model.modules()}
        self.model.eval()
        try:
            # The root's no-grad forward: the evaluate phase and the releases after it are the
            # access layer's (access.py [Note: the model between steps]).
            with torch.no_grad():
                loss = self.model(x, y, position_ids=p[0]) if p else self.model(x, y)
        except torch.OutOfMemoryError as e:
            raise self._oom_error(e, Phase.EVALUATE) from None
        finally:
            for m, training in modes.items():
                m.training = training
        # (one rank, or every target supervised: the mean over ranks, all weights equal)
        every = self.comm.world == 1 or total == self.comm.world * t.micro_batch * t.seq_len
        return self._mean_loss([(loss, n)], every, total, "the evaluation loss")

    def _mean_loss(
        self, losses: list[tuple[torch.Tensor, int]], every: bool, total: int, what: str
    ) -> float:
        """The global batch's loss from its micro-batches' ``(mean loss, supervised targets)``
        ([Note: supervised tokens]): with ``every`` target supervised the mean over micro-batches
        (of one: itself), then over ranks; else sum_i mean_i * n_i / N over the ranks'
        micro-batches (n_i = 0: a mean over nothing, weighted 0)."""
        if every:
            return self.comm.mean(torch.stack([loss for loss, _ in losses]).float().mean(), what)
        weighted = [loss.detach().float().nan_to_num() * n for loss, n in losses]
        return self.comm.sum(torch.stack(weighted).sum(), what).item() / total

    def _check_finite(self, loss: torch.Tensor, micro: int) -> None:
        """Stop before a NaN/inf loss reaches backward and the optimizer.

        Checked between forward and backward, so no parameter or moment has changed
        when it raises (the engine must then be closed). Costs one scalar
        device-to-host read per micro-batch. With fp16 loss scaling the step is
        skipped instead (the scaler sees the non-finite gradients).
        """
        value = loss.detach().float().item()
        if not abs(value) < float("inf"):  # NaN or ±inf
            ckpt = self.last_checkpoint
            newest = f" ({ckpt}, the newest this run saved or loaded)" if ckpt else ""
            raise NonFiniteLossError(
                f"the loss is {value} at step {self.steps_done + 1} (micro-batch {micro}, "
                f"{self.plan.training.compute_dtype}); stopped before the update, so the model and "
                "optimizer state are those of the previous step",
                f"resume from the last checkpoint{newest} with a lower learning rate (or gradient "
                "clipping), and check the data around this step",
            )

    def _nonfinite_error(
        self, cid: int, step: int, partial: bool, what: str = ""
    ) -> NonFiniteGradientError:
        """The error of optim.py's [Note: finite-state guard]: where, what state is left, and
        the last finite checkpoint to resume from. ``what``: the master or moment that became
        non-finite in the chunk's step ("": a gradient was, before it)."""
        names = [self.names[id(p)] for p, _, _ in self.store.chunks[cid].params]
        where = names[0] + (f" … {names[-1]}" if len(names) > 1 else "")
        state = (
            "stopped before any parameter changed, so the model and optimizer state are those of "
            f"step {step - 1}"
            if not partial
            else (
                "other chunks may have stepped already, so the state is partly updated and will "
                "not be saved or exported"
            )
        )
        ckpt = self.last_checkpoint
        cause = (
            f"Adam's {what} became NaN or infinite in the update at step {step}: chunk {cid} "
            f"({where}), {self.plan.training.compute_dtype}, with finite gradients (one above "
            "~1.8e19 has a square past float32's range)"
            if what
            else f"a gradient is NaN or infinite at step {step}: chunk {cid} ({where}), "
            f"{self.plan.training.compute_dtype}, with a finite loss"
        )
        if ckpt:
            last = f"the last finite checkpoint is {ckpt}"
            hint = (
                "resume from it with a lower learning rate or clipping: `protrain train … "
                f"--resume {ckpt} --lr X`"
            )
        else:
            last = "no checkpoint was saved or loaded in this run"
            hint = "train again with a lower learning rate or clipping: `protrain train … --lr X`"
        return NonFiniteGradientError(f"{cause}; {state}; {last}", hint, partial=partial)

    def _refuse_poisoned(self, *, stepping: bool = False) -> None:
        """Raise the guard's error again when a gradient was found non-finite: before any
        further step, and before a save or export of a partly updated state."""
        poisoned = self.optim.poisoned
        if poisoned is not None and (stepping or poisoned[2]):
            raise self._nonfinite_error(*poisoned)

    def _guard_after_backward(self, total: torch.Tensor) -> None:
        """Raise when a gradient is not finite, known from the global norm (``after_backward``: no
        chunk has stepped). The chunks are looked at one by one only when the norm is not finite;
        finite gradients whose squares overflowed step (clipped to zero). optim.py [Note:
        finite-state guard]."""
        if not self.optim.guarded or bool(torch.isfinite(total)):
            return
        try:
            for c in self.store.chunks:
                if c.trainable:  # (no chunk is device-homed: those plans step during backward)
                    self.optim.guard(
                        c.id, self.optim.step_no, self.optim.step_grads(c.id), partial=False
                    )
        except NonFiniteGradientError:
            self.optim.discard_home_grads()  # the homes' weights back, as for a skipped fp16 step
            raise

    def _oom_error(self, e: torch.OutOfMemoryError, phase: Phase | None = None) -> BudgetError:
        """What ran out, where (``phase``: the replayer's, unless given), against what the plan
        predicted, and the budget to plan with."""
        phase = (phase or self.replayer.phase).name.lower()
        segment = getattr(self.acts, "segment", None)  # the segment whose step began last
        predicted = self.plan.prediction.peak_memory_bytes
        peak = self.ledger.device_peak_bytes()  # CUDA: the allocator's peak allocated
        held = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else peak
        budget = self.plan.request.budget_bytes or max(predicted, held)
        return BudgetError(
            f"out of device memory in the {phase}"
            + (f" of {segment}" if segment else "")
            + f" at step {self.steps_done + 1}: the plan predicted a peak of {_size(predicted)}; "
            f"the allocator held {_size(held)} (peak allocated {_size(peak)}) when this failed: "
            f"{str(e).splitlines()[0][:160]}",
            "make a plan with a 10% margin: `protrain plan … --budget "
            f"{_size(int(budget * 0.9))}`, and check that no other process uses this device",
        )

    def _offload(self, cid: int) -> None:
        """Gradients of an offloaded chunk are complete: send them to the host, maybe step.
        Nothing here waits for the device; see [Note: gradient offload] in optim.py.
        A persistent chunk's (ZeRO-3): start their reduction ([Note: overlapped reductions])."""
        c, what = self.store.chunks[cid], f"gradients of chunk {cid}"
        # whether the micro-batch whose backward runs is the step's first, its last (CPU steps
        # may start)
        first, last = self._micro == 0, self._micro == self.plan.training.grad_accum - 1
        # sharded: this rank's slice ([Note: overlapped reductions])
        if c.persistent and last:
            self._reducing[cid] = (
                self.comm.start_reduce_scatter(c.dev_grad, c.shard, what)
                if c.sharded
                else (c.dev_grad, self.comm.all_reduce(c.dev_grad, what, async_op=True))
            )
        if c.persistent:
            return
        # A forward's in-place writes reach home and master before the step reads them (and not
        # after, from the release at this segment's end: chunks.py
        # [Note: in-place writes in forward]).
        if c.residency is Residency.RESIDENT:
            self.store.write_back(cid)
        if c.homed:  # steps now, on the device (chunks.py [Note: device homes]; grad_accum 1)
            self.optim.step_homed(cid)
            return
        with self.events.about("offload", chunk=cid):  # names the download (events.py)
            self.optim.offload_grad(cid, first_micro_batch=first, last_micro_batch=last)
        if last and not self._defer_cpu_steps:
            self.optim.submit_cpu_step(cid)

    def _land_reductions(self) -> None:
        """Wait for the persistent chunks' reductions and average them (below); before any
        norm is taken, as Trainer's ``clip_grad_norm_`` takes it before ``finish_step``."""
        # [Note: overlapped reductions]
        # Under ZeRO-3 each trainable persistent chunk's gradients were summed over the
        # ranks by a collective that backward started when they were complete (the
        # replayer's offload order, the same on every rank; executor/dist.py [Note:
        # sharding]): all of the buffer where the states are replicated, this rank's slice
        # where sharded. It ran beside the rest of backward; here it is waited on and
        # averaged. The sums are the collectives' own, as when they ran after backward.
        # The sharded slice is reduced in place on CUDA, into a buffer on gloo
        # (``Comm.start_reduce_scatter``).
        for cid, (out, work) in sorted(self._reducing.items()):
            self.comm.wait(work, f"the reduction of chunk {cid}'s gradients")
            c = self.store.chunks[cid]
            c.dev_grad[c.shard].copy_(out.div_(self.comm.world)) if c.sharded else out.div_(
                self.comm.world
            )
        self._reducing.clear()

    def _finish_update(self) -> tuple[float | None, bool]:
        self._land_reductions()  # [Note: overlapped reductions]
        inv_scale = 1.0 / self.scaler.scale
        coef = grad_norm = None
        if self._defer_cpu_steps:
            total = self._global_norm()
            grad_norm = total.item()
            if self.scaler.enabled and not torch.isfinite(total).item():
                self.scaler.update(overflow=True)
                self.optim.discard_home_grads()
                return grad_norm, True  # skip: no master changes; grads are zeroed next step
            self.scaler.update(overflow=False)
            self._guard_after_backward(total)
            if self.config.max_grad_norm is not None:
                coef = clip_coefficient(total, self.config.max_grad_norm)
            host_coef = None if coef is None else coef.item()  # the worker never reads the device
            for c in self.store.chunks:
                if not c.persistent:  # (checked: the guard above found every gradient finite)
                    self.optim.submit_cpu_step(c.id, host_coef, inv_scale, checked=True)
        else:
            self.optim.guard_persistent()
        for c in self.store.chunks:
            if c.persistent:
                self.events.emit("device_step", "begin", chunk=c.id)
                self.optim.step_device(c.id, coef, inv_scale)
                self.events.emit("device_step", "end", chunk=c.id)
        self.optim.guard_device_states()  # optim.py [Note: finite-state guard]
        return grad_norm, False

    # -- state in plain PyTorch names

    def state_dict(self, trainable_only: bool = False) -> dict[str, dict]:
        """``{"model": {name: fp32 tensor}, "optim": {name: {step, exp_avg, exp_avg_sq}}}``.

        Names and shapes are the model's own (tied aliases included), on the host,
        independent of the plan's chunk layout. As in ``torch.optim.AdamW``, a parameter
        that has never stepped (frozen, or never given a gradient) has no optimizer state.
        ``trainable_only``: leave the frozen parameters out (a LoRA run's adapter checkpoint).
        """
        self.optim.wait_all()
        self._refuse_poisoned()
        model, optim = {}, {}
        o = self.optim
        for c in self.store.chunks:
            # (the same chunks on every rank: no collective skipped alone)
            if trainable_only and not c.trainable:
                continue
            master = self._whole(c, o.master[c.id])
            moments = {
                k: self._whole(c, v[c.id])
                for k, v in (("exp_avg", o.exp_avg), ("exp_avg_sq", o.exp_avg_sq))
                if c.trainable
            }
            for i, (p, off, n) in enumerate(c.params):
                name = self.names[id(p)]
                if trainable_only and not p.requires_grad:
                    continue
                model[name] = master[off : off + n].view(p.shape).detach().float().cpu().clone()
                if o.counts[c.id][i]:  # (counts, not steps: the same on every rank under ZeRO-3)
                    optim[name] = {"step": torch.tensor(float(o.counts[c.id][i]))}
                    for k, v in moments.items():
                        optim[name][k] = v[off : off + n].view(p.shape).cpu().clone()
            if c.on_disk:  # one chunk's states in host memory at a time (nvme.py)
                self.store.disk.drop(o.master[c.id], o.exp_avg[c.id], o.exp_avg_sq[c.id])
        model.update({alias: model[name] for name, alias in self.plan.model.tied if name in model})
        return {"model": model, "optim": optim}

    def _whole(self, c, t: torch.Tensor) -> torch.Tensor:
        """A chunk-length tensor: ``t`` itself, or for a sharded chunk (``Chunk.sharded``)
        the all-gather of every rank's shard ``t``."""
        if not c.sharded:
            return t
        full = torch.empty(c.numel, dtype=t.dtype, device=self.device)
        full[c.shard].copy_(t)
        self.comm.all_gather(full, f"state of chunk {c.id}")
        return full.cpu()

    def load_state_dict(self, sd: dict[str, dict], steps_done: int | None = None) -> None:
        """Load what ``state_dict`` (of any plan for this model) returned; frozen parameters it
        lacks (``state_dict(trainable_only=True)``) keep their values. ``steps_done``: the steps
        the state has taken, where a caller keeps it beside the state (a Trainer checkpoint)."""
        self.optim.wait_all()
        if steps_done is not None:
            self.steps_done = int(steps_done)
        model, optim = dict(sd["model"]), sd.get("optim", {})
        missing = [
            self.names[id(p)]
            for c in self.store.chunks
            for p, _, _ in c.params
            if self.names[id(p)] not in model and p.requires_grad
        ]
        if missing:
            raise ConfigError(
                f"state dict lacks {len(missing)} parameters, e.g. {missing[:3]}",
                "load a state dict saved from this model",
            )
        dtype, o = DTYPES[self.plan.training.compute_dtype], self.optim
        # a parameter never stepped
        zero = dict.fromkeys(("step", "exp_avg", "exp_avg_sq"), torch.zeros(()))
        with torch.no_grad():
            for c in self.store.chunks:
                master = o.master[c.id]
                names = [self.names[id(p)] for p, _, _ in c.params]
                if not all(nm in model for nm in names):  # frozen ones left out: as they are
                    if not any(nm in model for nm in names):
                        continue
                    kept = self._whole(c, master).float().cpu()
                    for (_, off, n), nm in zip(c.params, names):
                        model.setdefault(nm, kept[off : off + n])
                # Whole-chunk fp32 images (padding zero), then this rank's part of them (c.own).
                values = _image(c, [model[nm] for nm in names])
                master.copy_(values[c.own])
                if optim and c.trainable:  # per parameter; one never stepped starts afresh
                    state = [optim.get(nm, zero) for nm in names]
                    for key, moment in (("exp_avg", o.exp_avg), ("exp_avg_sq", o.exp_avg_sq)):
                        parts = [s[key].expand(model[nm].shape) for s, nm in zip(state, names)]
                        moment[c.id].copy_(_image(c, parts)[c.own])
                    for i, s in enumerate(state):
                        o.steps[c.id][i].fill_(float(s["step"]))
                        o.counts[c.id][i] = int(float(s["step"]))
                # Compute-dtype copies follow the masters (a persistent chunk's whole values).
                target = c.dev if c.persistent else c.home  # None: homeless, the master alone
                if target is not None and target is not master:
                    target.copy_((values if c.persistent else master).to(dtype))
                if c.on_disk:  # one chunk's states in host memory at a time (nvme.py)
                    self.store.disk.drop(master, o.exp_avg[c.id], o.exp_avg_sq[c.id])

    # -- checkpoints (executor/checkpoint.py: atomic, safetensors + JSON manifest)

    def save(
        self,
        root,
        *,
        data: dict[str, int] | None = None,
        keep: int = 2,
        lr_schedule: dict[str, str | int | float] | None = None,
    ):
        """Checkpoint model, optimizer (``lr`` included), loss scaler, RNG, ``data`` (the
        caller's data position) and ``lr_schedule`` (the caller's schedule settings) under
        ``root``, atomically; every rank calls it. Returns the step directory."""
        path = save(self, root, data=data, keep=keep, lr_schedule=lr_schedule)
        self.last_checkpoint = str(path)
        return path

    def load(self, root):
        """Restore what ``save`` wrote (under this or another plan of the model), ``lr`` included;
        returns the manifest, whose ``data`` is the data position to resume from and
        ``lr_schedule`` the schedule settings saved with it."""
        manifest = load(self, root)
        self.last_checkpoint = str(resolve(root))
        return manifest

    def synchronize(self) -> None:
        """Wait until the last step's work is done: its CPU AdamW steps, which run on the worker
        past ``step``'s return (the next step's fetches wait for them). What a trace or a timer
        needs before reading the step as finished."""
        self.optim.wait_all()

    def close(self) -> None:
        """Wait for pending CPU steps and remove hooks and policy wrappers."""
        try:
            self.optim.wait_all()  # re-raises a CPU step's error; clean up regardless
        finally:
            self._teardown()

    def _teardown(self) -> None:
        """Undo what wrap did, as far as it got (also after a failed wrap)."""
        if self.optim is not None:
            self.optim.shutdown()
        for h in self.handles:
            h.remove()
        for part in (self.access, self.replayer, self.acts):  # (None: wrap did not get to it)
            if part is not None:
                part.uninstall()
        if self.store is not None:
            self.store.arena.close()  # unpins (CUDA); the homes stay valid as pageable memory
            if self.store.disk is not None:
                self.store.disk.close()  # out of memory; its space goes with the last view
        self.copies.close()
