"""Traces of one training iteration, predicted and measured, and the predicted memory walk.

Three views of the same schedule, all in the Chrome trace-event format (JSON object
form: ``{"traceEvents": [...], "displayTimeUnit": "ms", "metadata": {...}}``), which
Perfetto (ui.perfetto.dev) and ``chrome://tracing`` open:

- ``predicted_trace(profile, plan)``: what the cost model (``cost.py``) believes one
  iteration looks like, lane by lane;
- ``record_trace(engine)``: what the executor actually did, from the replayer's
  segment observer and thin wrappers around the engine's copies and CPU Adam;
- ``merge_traces(predicted, measured)``: both in one file, one process each, so the
  two timelines sit one above the other in the viewer.

Tracks (one ``tid`` each, named by ``thread_name`` metadata events):

==========  =========================================================================
iteration   the phases: forward, backward, optimizer
compute     ``forward <seg>``, ``recompute <block>``, ``backward <seg>``, ``adam (device)``
H2D         ``fetch cN``, ``prefetch cN``, ``swap_in <block>``
D2H         ``offload cN`` (gradients), ``swap_out <block>``
CPU Adam    ``cpu_adam cN``
collectives ``all_gather cN``, ``reduce_scatter cN``, ``all_reduce`` (world size > 1)
==========  =========================================================================

Event names use the plan's verbs (shared/STYLE.md rule 7), so a name in a trace is a
name in the plan file.

The predicted memory walk and its plot are in ``memory_plot.py``.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protrain.executor import plan as P
from protrain.executor.errors import ConfigError

from .profile import Profile

TRACKS = {"iteration": 0, "compute": 1, "H2D": 2, "D2H": 3, "CPU Adam": 4, "collectives": 5}
"""Track name → ``tid``. The same numbers in predicted and measured traces."""

PREDICTED_PID, MEASURED_PID = 1, 2


# --------------------------------------------------------------------------- format


def _doc(events: list[dict], pid: int, label: str, metadata: dict[str, Any],
         tracks: list[str]) -> dict[str, Any]:
    """A trace document: ``events`` plus the process and thread names."""
    meta = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}}]
    meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": TRACKS[t], "args": {"name": t}}
             for t in tracks]
    # thread_sort_index keeps the lanes in TRACKS order instead of first-event order.
    meta += [{"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": TRACKS[t],
              "args": {"sort_index": TRACKS[t]}} for t in tracks]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms", "metadata": metadata}


def _x(name: str, track: str, ts_us: float, dur_us: float, pid: int, cat: str,
       **args: Any) -> dict[str, Any]:
    """One complete (``ph: X``) event; times rounded to ns so files stay readable."""
    ev = {"name": name, "cat": cat, "ph": "X", "ts": round(ts_us, 3),
          "dur": round(max(dur_us, 0.0), 3), "pid": pid, "tid": TRACKS[track]}
    if args:
        ev["args"] = args
    return ev


def validate_trace(doc: dict) -> None:
    """Raise ``ValueError`` naming the event and field when ``doc`` is not a valid trace.

    Checks the Chrome trace-event format's required fields for the two phases we
    write: complete events (``X``: name str, ph, ts number, dur number ≥ 0, pid, tid)
    and metadata events (``M``: name, ph, pid, tid, args).
    """
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError("a trace is a JSON object with a `traceEvents` list - at `$.traceEvents`")
    if "displayTimeUnit" in doc and doc["displayTimeUnit"] not in ("ms", "ns"):
        raise ValueError(f"displayTimeUnit must be 'ms' or 'ns', got {doc['displayTimeUnit']!r}")

    def number(v: object) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    for i, ev in enumerate(doc["traceEvents"]):
        where = f"$.traceEvents[{i}]"
        if not isinstance(ev, dict):
            raise ValueError(f"event is {type(ev).__name__}, not an object - at `{where}`")
        ph = ev.get("ph")
        required = {"X": ("name", "ph", "ts", "dur", "pid", "tid"),
                    "M": ("name", "ph", "pid", "tid", "args")}.get(ph)
        if required is None:
            raise ValueError(f"unsupported phase {ph!r} (we write X and M events) - at `{where}.ph`")
        for key in required:
            if key not in ev:
                raise ValueError(f"{ph} event lacks `{key}` - at `{where}`")
        if not isinstance(ev["name"], str):
            raise ValueError(f"name must be a string, got {ev['name']!r} - at `{where}.name`")
        for key in ("pid", "tid"):
            if not isinstance(ev[key], (int, str)) or isinstance(ev[key], bool):
                raise ValueError(f"{key} must be an int or string, got {ev[key]!r} - at `{where}.{key}`")
        if ph == "X":
            for key in ("ts", "dur"):
                if not number(ev[key]):
                    raise ValueError(f"{key} must be a finite number (µs), got {ev[key]!r} - at `{where}.{key}`")
            if ev["dur"] < 0:
                raise ValueError(f"dur must be >= 0, got {ev['dur']} - at `{where}.dur`")
        elif not isinstance(ev["args"], dict):
            raise ValueError(f"args must be an object - at `{where}.args`")


def write_trace(doc: dict, path: str | Path) -> None:
    """Validate and write a trace (open it at ui.perfetto.dev or chrome://tracing)."""
    validate_trace(doc)
    Path(path).write_text(json.dumps(doc, separators=(",", ":")) + "\n")


def merge_traces(predicted: dict, measured: dict) -> dict:
    """Both traces in one document, predicted as process 1 and measured as process 2."""
    events = []
    for doc, pid in ((predicted, PREDICTED_PID), (measured, MEASURED_PID)):
        events += [{**ev, "pid": pid} for ev in doc["traceEvents"]]
    meta = {"predicted": predicted.get("metadata", {}), "measured": measured.get("metadata", {})}
    return {"traceEvents": events, "displayTimeUnit": "ms", "metadata": meta}


# --------------------------------------------------------------------- shared terms


def _terms_for(profile: Profile, plan: P.Plan):
    """The cost model's terms for the plan's chunk layout; refuses a profile of another model."""
    from .cost import make_terms

    if profile.model.fingerprint != plan.model.fingerprint:
        raise ConfigError(
            f"the profile is of {profile.model.name} but the plan is for {plan.model.name} "
            "(model fingerprints differ)",
            "pass the profile the plan was made from (`protrain plan --profile FILE`)",
        )
    t = make_terms(profile, plan.chunks.chunk_numel, plan.training.world_size, plan.schedule.cpu_adam,
                   plan.training.grad_accum)
    if t.n_chunks != len(plan.chunks.items):
        raise ConfigError(
            f"the profile lays {profile.model.name} out in {t.n_chunks} chunks of "
            f"{plan.chunks.chunk_numel} elements, the plan in {len(plan.chunks.items)}",
            "make the plan from this profile with `protrain plan --profile FILE`",
        )
    return t


def _policy_masks(plan: P.Plan):
    """A one-row ``PolicyGrid`` holding the plan's own per-block policies."""
    import numpy as np

    from .cost import PolicyGrid

    S = len(plan.model.blocks) + 2
    swap, ckpt = np.zeros((1, S)), np.zeros((1, S))
    for b, a in enumerate(plan.activations):
        swap[0, b + 1] = a.policy == "swap"
        ckpt[0, b + 1] = a.policy == "checkpoint"
    return PolicyGrid(np.array([int(swap.sum())]), np.array([int(ckpt.sum())]), swap, ckpt)


# ------------------------------------------------------------------ predicted trace


class _Lanes:
    """When each lane is next free (µs). On a ``cpu`` device every copy runs on the main
    thread, synchronously, so compute, H2D, D2H and collectives share one clock; the CPU
    Adam worker is a thread of its own either way."""

    def __init__(self, sync: bool):
        self.sync = sync
        self.free = {name: 0.0 for name in TRACKS}

    def run(self, lane: str, at: float, dur: float) -> tuple[float, float]:
        key = "compute" if self.sync and lane != "CPU Adam" else lane
        start = max(at, self.free[key])
        self.free[key] = start + dur
        return start, start + dur


def predicted_trace(profile: Profile, plan: P.Plan) -> dict[str, Any]:
    """One iteration of ``plan`` as the cost model sees it, as a Chrome trace.

    Durations are the cost model's own terms (``cost.make_terms``): per-segment
    ``comp_fwd``/``comp_bwd``, ``t_up``/``t_down`` per chunk, the swap rates times
    ``saved_tensor_bytes``, the CPU and device Adam rates, the collective times. What
    moves when is the plan's schedule (``fetch``, ``prefetch``, ``swap_in``,
    ``offload``, ``release``), replayed with the executor's dependencies:

    - a segment's compute starts when the previous segment's compute has ended and
      its ``fetch`` chunks (and, in backward, its swapped activations) have landed;
    - uploads queue on the H2D lane in issue order (``swap_in``, ``fetch``,
      ``prefetch``), downloads on the D2H lane; a swap-out starts with its block's
      forward, a gradient offload at its segment's backward end; under ZeRO-3 a fetch
      is the shard's upload then an all-gather, an offload a reduce-scatter then the
      shard's download;
    - each offloaded chunk's CPU Adam step starts when its gradients have landed and
      the worker is free (the cost model's [CPU Adam timeline]); the device Adam of
      the persistent chunks (after their all-reduce) follows backward;
    - on a ``cpu`` device every copy is synchronous (one clock, see ``_Lanes``).

    Simplifications against ``cost.evaluate`` (why the totals differ a little): the
    cost model counts transfers as an upper bound of the schedule's and closes each
    segment at ``max(compute, uploads, swap-outs, offloads)``, where the trace lets a
    swap-out or offload run on past its segment's end as the executor does; the
    trace replays ``grad_accum`` micro-batches (CPU Adam after the last), the cost
    model multiplies one by ``grad_accum``. ``tests/test_trace.py`` pins the gap.
    """
    from .cost import SWAP_OVERHEAD_US

    t = _terms_for(profile, plan)
    pid = PREDICTED_PID
    segs = P.segments(plan)
    index = {s: i for i, s in enumerate(segs)}
    policy = {a.block: a.policy for a in plan.activations}
    offloaded = set(plan.placement.offloaded)
    W = t.world_size
    # t_up / t_down include the collective under ZeRO-3 (cost.make_terms); split them.
    coll_us = t.allreduce_us_per_chunk / 2
    up_us, down_us = t.t_up - coll_us, t.t_down - coll_us
    lanes = _Lanes(sync=not t.gpu)
    after_backward = plan.schedule.cpu_adam == "after_backward"  # CPU steps wait for the end of backward
    events: list[dict] = []

    ready: dict[int, float] = {}  # resident offloaded chunk → when its upload lands
    swapped_out: dict[str, float] = {}  # swapped block → when its activations reached the host
    swapped_in: dict[str, float] = {}  # swapped block → when they are back on the device
    grads_down: dict[int, float] = {}  # chunk → when its gradients reached the host

    def upload(c: int, at: float, verb: str) -> float:
        s, e = lanes.run("H2D", at, up_us)
        events.append(_x(f"{verb} c{c}", "H2D", s, e - s, pid, "h2d", chunk=c,
                         bytes=t.chunk_bytes // W))
        if W > 1:
            s, e = lanes.run("collectives", e, coll_us)
            events.append(_x(f"all_gather c{c}", "collectives", s, e - s, pid, "collective", chunk=c))
        return e

    def offload(c: int, at: float) -> float:
        if W > 1:
            s, at = lanes.run("collectives", at, coll_us)
            events.append(_x(f"reduce_scatter c{c}", "collectives", s, at - s, pid, "collective", chunk=c))
        s, e = lanes.run("D2H", at, down_us)
        events.append(_x(f"offload c{c}", "D2H", s, e - s, pid, "d2h", chunk=c, bytes=t.chunk_bytes // W))
        return e

    now = 0.0
    k = plan.training.grad_accum
    for micro in range(k):
        last_micro = micro == k - 1
        # -- forward: one step per segment, <pre> … <post>
        fwd_start = now
        for step in plan.schedule.forward:
            s = index[step.segment]
            for c in step.fetch:
                if c not in ready:
                    ready[c] = upload(c, now, "fetch")
            for c in step.prefetch:
                ready[c] = upload(c, now, "prefetch")
            at = max([now, *(ready[c] for c in step.fetch)])
            swap = policy.get(step.segment) == "swap"
            overhead = SWAP_OVERHEAD_US if (swap and t.gpu) else 0.0
            cs, ce = lanes.run("compute", at, float(t.comp_fwd[s]) + overhead)
            events.append(_x(f"forward {step.segment}", "compute", cs, ce - cs, pid, "compute",
                             segment=step.segment, phase="forward", micro_batch=micro))
            if swap:  # saved tensors go down as the block's forward saves them
                ss, se = lanes.run("D2H", cs, float(t.saved_tensor[s]) * t.swap_out_us_per_byte)
                events.append(_x(f"swap_out {step.segment}", "D2H", ss, se - ss, pid, "d2h",
                                 block=step.segment, bytes=int(t.saved_tensor[s])))
                swapped_out[step.segment] = se
            for c in step.release:
                ready.pop(c, None)
            now = ce if t.gpu else lanes.free["compute"]
        events.append(_x("forward", "iteration", fwd_start, now - fwd_start, pid, "phase", micro_batch=micro))

        # -- backward: one step per segment, <post> … <pre>
        bwd_start = now
        for step in plan.schedule.backward:
            s = index[step.segment]
            for b in step.swap_in:
                ss, se = lanes.run("H2D", max(now, swapped_out[b]),
                                   float(t.saved_tensor[index[b]]) * t.swap_in_us_per_byte)
                events.append(_x(f"swap_in {b}", "H2D", ss, se - ss, pid, "h2d", block=b,
                                 bytes=int(t.saved_tensor[index[b]])))
                swapped_in[b] = se
            for c in step.fetch:
                if c not in ready:
                    ready[c] = upload(c, now, "fetch")
            for c in step.prefetch:
                ready[c] = upload(c, now, "prefetch")
            at = max([now, *(ready[c] for c in step.fetch), swapped_in.get(step.segment, 0.0)])
            if policy.get(step.segment) == "checkpoint":
                cs, ce = lanes.run("compute", at, float(t.comp_fwd[s]))
                events.append(_x(f"recompute {step.segment}", "compute", cs, ce - cs, pid, "compute",
                                 segment=step.segment, phase="backward", micro_batch=micro))
                at = ce
            cs, ce = lanes.run("compute", at, float(t.comp_bwd[s]))
            events.append(_x(f"backward {step.segment}", "compute", cs, ce - cs, pid, "compute",
                             segment=step.segment, phase="backward", micro_batch=micro))
            for c in step.offload:
                grads_down[c] = offload(c, ce)
                if last_micro and c in offloaded and not after_backward:
                    n = int(t.chunk_params[c])
                    a0, a1 = lanes.run("CPU Adam", grads_down[c], n * t.cpu_adam_us_per_param)
                    events.append(_x(f"cpu_adam c{c}", "CPU Adam", a0, a1 - a0, pid, "cpu_adam",
                                     chunk=c, params=n))
            for c in step.release:
                ready.pop(c, None)
            now = ce if t.gpu else lanes.free["compute"]
        events.append(_x("backward", "iteration", bwd_start, now - bwd_start, pid, "phase", micro_batch=micro))

    # -- optimizer: persistent chunks' all-reduce (replicated under ZeRO-3), device Adam;
    # with cpu_adam "after_backward" the CPU steps too, once the last gradients landed
    opt_start = now
    if after_backward:
        start = max([now, *(grads_down[c] for c in offloaded if c in grads_down)])
        for step in plan.schedule.backward:
            for c in step.offload:
                n = int(t.chunk_params[c])
                a0, a1 = lanes.run("CPU Adam", start, n * t.cpu_adam_us_per_param)
                events.append(_x(f"cpu_adam c{c}", "CPU Adam", a0, a1 - a0, pid, "cpu_adam", chunk=c, params=n))
    n_persist = len(plan.placement.persistent)
    if W > 1 and n_persist:
        s, now = lanes.run("collectives", now, n_persist * t.allreduce_us_per_chunk)
        events.append(_x("all_reduce", "collectives", s, now - s, pid, "collective", chunks=n_persist))
    n_dev = int(sum(int(t.chunk_params[c]) for c in plan.placement.persistent))
    if n_dev:
        s, now = lanes.run("compute", now, n_dev * t.dev_adam_us_per_param)
        events.append(_x("adam (device)", "compute", s, now - s, pid, "compute", params=n_dev))
    end = max(now, lanes.free["CPU Adam"])
    events.append(_x("optimizer", "iteration", opt_start, end - opt_start, pid, "phase"))

    tracks = ["iteration", "compute", "H2D", "D2H", "CPU Adam"] + (["collectives"] if W > 1 else [])
    label = f"predicted: {plan.model.name} on {plan.hardware.name or profile.hardware.name}"
    metadata = {"source": "predicted", "model": plan.model.name, "hardware": profile.hardware.name,
                "trace_iter_time_us": round(end, 3),
                "plan_iter_time_us": plan.prediction.iter_time_us,
                "profile_source": profile.source}
    return _doc(events, pid, label, metadata, tracks)


def trace_span_us(doc: dict) -> float:
    """End of the last complete event minus the start of the first (µs)."""
    xs = [ev for ev in doc["traceEvents"] if ev.get("ph") == "X"]
    return max(ev["ts"] + ev["dur"] for ev in xs) - min(ev["ts"] for ev in xs) if xs else 0.0


# ------------------------------------------------------------------- measured trace


class _Clock:
    """Timestamps in µs since ``start``. On CUDA, work on streams is stamped with timing
    events (the host runs ahead of the device) and resolved after a synchronize,
    against an anchor event recorded on an idle device at host time ``start``; host
    work (the CPU Adam worker) is stamped with ``perf_counter`` on the same origin."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(device)
        self.start = time.perf_counter()
        self.anchor = None
        if self.cuda:
            self.anchor = torch.cuda.Event(enable_timing=True)
            self.anchor.record()

    def host(self) -> float:
        return (time.perf_counter() - self.start) * 1e6

    def stream(self, stream=None):
        """A stamp on ``stream`` (default: the current one): a float on CPU, an event on CUDA."""
        if not self.cuda:
            return self.host()
        ev = self.torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def resolve(self, stamp) -> float:
        if isinstance(stamp, float):
            return stamp
        return self.anchor.elapsed_time(stamp) * 1e3  # ms → µs


@dataclass
class _Span:
    name: str
    track: str
    cat: str
    start: Any  # float µs, or a CUDA event
    end: Any
    args: dict[str, Any]


class MeasuredTrace:
    """Records what an ``Engine`` does while installed; ``to_dict()`` is a Chrome trace.

    Installs ``engine.replayer.observer`` (segment begin/end) and wraps, as instance
    attributes only, ``replayer.begin`` and ``store.fetch`` (to know which chunk a copy
    is for and whether it is a fetch or a prefetch), the copy engine's ``upload`` /
    ``download`` (H2D and D2H spans: fetch, prefetch, swap_in, offload, swap_out),
    ``optim.offload_grad`` and ``acts.swap_in`` (which chunk or block),
    ``optim.submit_cpu_step`` and ``optim._cpu_step`` (CPU Adam, timed in the worker
    thread, counted for the step that submitted it), ``comm``'s collectives (world size
    > 1) and ``engine.step`` (iterations). ``uninstall()`` puts everything back. Per
    event the cost is two timestamps (two CUDA timing events on a GPU) and one small
    record; nothing synchronizes until ``to_dict()``. A swap copies each saved tensor
    on its own; ``to_dict()`` joins them into one span per block and step (args:
    ``tensors``, ``busy_us``).

    On CUDA a copy's span starts when its stream may begin it (we make the copy stream
    wait for compute, as the copy engine does, before stamping) and ends when it
    completes, so it is the copy itself, not its queueing.
    """

    def __init__(self, engine, max_steps: int | None = None):
        self.engine = engine
        self.max_steps = max_steps  # record the first steps only (None: all)
        self.clock: _Clock | None = None
        self.spans: list[_Span] = []  # appended from the main thread and the CPU Adam worker
        self.open: dict[tuple[str, str], Any] = {}  # (phase, segment) → begin stamp
        self.phase_open: dict[str, Any] = {}  # "forward"/"backward" → begin stamp
        self.step_index = 0
        self.cpu_step_of: dict[int, int] = {}  # chunk → step whose CPU Adam was submitted
        self.current: tuple[Any, str] | None = None  # (Phase, segment) being begun
        self.context: str = ""  # label of the copy about to be issued
        self.saved: dict[tuple[object, str], Any] = {}  # (object, attr) → what we replaced

    # -- install / uninstall

    def _patch(self, obj: object, attr: str, make: Callable[[Callable], Any]) -> None:
        self.saved[(obj, attr)] = obj.__dict__.get(attr, _MISSING)
        setattr(obj, attr, make(getattr(obj, attr)))

    def install(self) -> MeasuredTrace:
        e = self.engine
        self.clock = _Clock(e.device)
        previous = e.replayer.observer
        self.saved[(e.replayer, "observer")] = previous

        def observer(kind: str, phase, segment: str) -> None:
            self._observe(kind, phase, segment)
            if previous is not None:
                previous(kind, phase, segment)

        e.replayer.observer = observer
        self._patch(e.replayer, "begin", self._wrap_begin)
        self._patch(e.store, "fetch", self._wrap_fetch)
        self._patch(e.copies, "upload", self._wrap_copy("H2D"))
        self._patch(e.copies, "download", self._wrap_copy("D2H"))
        self._patch(e.optim, "offload_grad", self._wrap_offload)
        self._patch(e.optim, "submit_cpu_step", self._wrap_submit)
        self._patch(e.optim, "_cpu_step", self._wrap_cpu_step)
        self._patch(e.acts, "swap_in", self._wrap_swap_in)
        self._patch(e, "step", self._wrap_step)
        if e.comm.world > 1:
            for name in ("all_gather", "reduce_scatter", "all_reduce"):
                self._patch(e.comm, name, self._wrap_collective(name))
        return self

    def uninstall(self) -> None:
        for (obj, attr), old in self.saved.items():
            if attr == "observer":
                obj.observer = old
            elif old is _MISSING:
                obj.__dict__.pop(attr, None)  # the class's method shows through again
            else:
                setattr(obj, attr, old)
        self.saved.clear()

    def __enter__(self) -> MeasuredTrace:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    # -- recorders

    def _add(self, name: str, track: str, cat: str, start, end, **args: Any) -> None:
        args.setdefault("step", self.step_index)
        if self.max_steps is None or args["step"] < self.max_steps:
            self.spans.append(_Span(name, track, cat, start, end, args))

    def _observe(self, kind: str, phase, segment: str) -> None:
        stamp = self.clock.stream()
        p = phase.value
        if kind == "begin":
            self.open[(p, segment)] = stamp
            first = (p == "forward" and segment == P.PRE) or (p == "backward" and segment == P.POST)
            if first:
                self.phase_open[p] = stamp
            return
        start = self.open.pop((p, segment), stamp)
        self._add(f"{p} {segment}", "compute", "compute", start, stamp, segment=segment, phase=p,
                  step=self.step_index)
        last = (p == "forward" and segment == P.POST) or (p == "backward" and segment == P.PRE)
        if last and p in self.phase_open:
            self._add(p, "iteration", "phase", self.phase_open.pop(p), stamp, step=self.step_index)
            if p == "backward":
                self.phase_open["optimizer"] = stamp

    def _wrap_begin(self, original):
        def begin(phase, segment):
            self.current = (phase, segment)
            try:
                return original(phase, segment)
            finally:
                self.current = None

        return begin

    def _wrap_fetch(self, original):
        def fetch(cid: int):
            verb = "fetch"
            if self.current is not None:
                step = self.engine.replayer.steps[self.current]
                verb = "prefetch" if cid in step.prefetch and cid not in step.fetch else "fetch"
            self.context = f"{verb} c{cid}"
            try:
                return original(cid)
            finally:
                self.context = ""

        return fetch

    def _wrap_swap_in(self, original):
        def swap_in(block: str):
            self.context = f"swap_in {block}"
            try:
                return original(block)
            finally:
                self.context = ""

        return swap_in

    def _wrap_offload(self, original):
        def offload_grad(cid: int, *args, **kwargs):
            self.context = f"offload c{cid}"
            try:
                return original(cid, *args, **kwargs)
            finally:
                self.context = ""

        return offload_grad

    def _wrap_copy(self, track: str):
        def make(original):
            copies = self.engine.copies

            def copy(dst, src, name: str = "fetch" if track == "H2D" else "offload", *args, **kwargs):
                label = self.context or f"{name} {self.engine.acts.segment}"
                if name in ("swap_out", "swap_in") and not label.startswith(name):
                    label = f"{name} {self.engine.acts.segment}"
                stream = None
                if copies.cuda:  # stamp on the copy stream once it may start (see class doc)
                    import torch

                    stream = copies.h2d if track == "H2D" else copies.d2h
                    stream.wait_stream(torch.cuda.current_stream(copies.device))
                    after = kwargs.get("after")
                    if after is not None and after.event is not None:
                        stream.wait_event(after.event)
                start = self.clock.stream(stream)
                result = original(dst, src, name, *args, **kwargs)
                end = self.clock.stream(stream)
                nbytes = src.numel() * src.element_size()
                self._add(label, track, track.lower(), start, end, bytes=nbytes, step=self.step_index)
                return result

            return copy

        return make

    def _wrap_submit(self, original):
        def submit_cpu_step(cid: int, *args, **kwargs):
            self.cpu_step_of[cid] = self.step_index  # the worker may run it after the step ends
            return original(cid, *args, **kwargs)

        return submit_cpu_step

    def _wrap_cpu_step(self, original):
        def cpu_step(cid: int, *args, **kwargs):
            start = self.clock.host()
            result = original(cid, *args, **kwargs)
            self._add(f"cpu_adam c{cid}", "CPU Adam", "cpu_adam", start, self.clock.host(), chunk=cid,
                      step=self.cpu_step_of.get(cid, self.step_index))
            return result

        return cpu_step

    def _wrap_collective(self, name: str):
        def make(original):
            def collective(*args, **kwargs):
                start = self.clock.stream()
                result = original(*args, **kwargs)
                what = args[-1] if args and isinstance(args[-1], str) else ""
                self._add(f"{name} {what}".strip(), "collectives", "collective", start, self.clock.stream())
                return result

            return collective

        return make

    def _wrap_step(self, original):
        def step(*args, **kwargs):
            start = self.clock.stream()
            result = original(*args, **kwargs)
            end = self.clock.stream()
            if "optimizer" in self.phase_open:
                self._add("optimizer", "iteration", "phase", self.phase_open.pop("optimizer"), end,
                          step=self.step_index)
            self._add(f"step {self.step_index}", "iteration", "step", start, end,
                      loss=round(result.loss, 6))
            self.step_index += 1
            return result

        return step

    # -- export

    def to_dict(self) -> dict[str, Any]:
        """The recorded spans as a Chrome trace (waits for the device and the CPU worker first)."""
        e = self.engine
        e.optim.wait_all()  # CPU Adam spans land when the worker finishes
        if self.clock is not None and self.clock.cuda:
            self.clock.torch.cuda.synchronize(e.device)
        resolved = sorted(((self.clock.resolve(sp.start), self.clock.resolve(sp.end), sp)
                           for sp in list(self.spans)), key=lambda r: (r[0], TRACKS[r[2].track]))
        events = []
        last_on: dict[str, dict] = {}  # track → its latest event (to coalesce swaps)
        for start, end, sp in resolved:
            prev = last_on.get(sp.track)
            # A swap moves each saved tensor separately; one span per block and step
            # (first copy's start to last copy's end) reads better next to the prediction.
            if (prev is not None and sp.name.startswith("swap_") and prev["name"] == sp.name
                    and prev["args"].get("step") == sp.args.get("step")):
                a = prev["args"]
                a["bytes"] += sp.args["bytes"]
                a["tensors"] += 1
                a["busy_us"] = round(a["busy_us"] + end - start, 3)
                prev["dur"] = round(max(prev["ts"] + prev["dur"], end) - prev["ts"], 3)
                continue
            ev = _x(sp.name, sp.track, start, end - start, MEASURED_PID, sp.cat, **sp.args)
            if sp.name.startswith("swap_"):
                ev["args"].update(tensors=1, busy_us=ev["dur"])
            events.append(ev)
            last_on[sp.track] = ev
        world = e.plan.training.world_size
        tracks = ["iteration", "compute", "H2D", "D2H", "CPU Adam"] + (["collectives"] if world > 1 else [])
        metadata = {"source": "measured", "model": e.plan.model.name, "device": str(e.device),
                    "steps": self.step_index, "plan_iter_time_us": e.plan.prediction.iter_time_us}
        return _doc(events, MEASURED_PID, f"measured: {e.plan.model.name} on {e.device}", metadata, tracks)

    def save(self, path: str | Path) -> None:
        write_trace(self.to_dict(), path)


_MISSING = object()


@contextlib.contextmanager
def record_trace(engine, max_steps: int | None = None) -> Iterator[MeasuredTrace]:
    """``with record_trace(engine) as rec: engine.step(...)`` then ``rec.save(path)``.

    ``max_steps``: keep the first steps only (a long run's trace stays small; the
    wrappers stay installed, at the cost of a clock read per event)."""
    rec = MeasuredTrace(engine, max_steps).install()
    try:
        yield rec
    finally:
        rec.uninstall()
