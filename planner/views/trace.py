"""Traces of one training iteration, predicted and measured, and the predicted memory walk.

Three views of the same schedule, all in the Chrome trace-event format (JSON object
form: ``{"traceEvents": [...], "displayTimeUnit": "ms", "metadata": {...}}``), which
Perfetto (ui.perfetto.dev) and ``chrome://tracing`` open:

- ``predicted_trace(profile, plan)``: what the cost model (``cost.py``) believes one
  iteration looks like, lane by lane;
- ``record_trace(engine)``: what the executor actually did, from the events the
  engine emits to its listeners (``Engine.on_event``, executor/events.py);
- ``merge_traces(predicted, measured)``: both in one file, one process each, so the
  two timelines sit one above the other in the viewer.

Tracks (one ``tid`` each, named by ``thread_name`` metadata events):

==========  =========================================================================
iteration   the phases: forward, backward, optimizer
compute     ``forward <seg>``, ``recompute <block>``, ``backward <seg>``, ``adam (device)``
H2D         ``fetch cN``, ``prefetch cN``, ``swap_in <block>``
D2H         ``offload cN`` (gradients), ``swap_out <block>``
CPU Adam    ``cpu_adam cN``
collectives ``all_gather cN``, ``reduce_scatter cN``, ``all_reduce`` or (persistent states
            sharded) ``reduce_scatter+all_gather`` (world size > 1)
==========  =========================================================================

Event names use the plan's verbs (the plan's own verbs: fetch, prefetch, release, offload, swap_in),
so a name in a trace is a name in the plan file.

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

import numpy as np

from protrain.executor.events import Event
from protrain.plans import homes as H
from protrain.plans import plan as P
from protrain.plans import validation as V
from protrain.plans.errors import ConfigError

from ..profiling.profile import Profile

TRACKS = {"iteration": 0, "compute": 1, "H2D": 2, "D2H": 3, "CPU Adam": 4, "collectives": 5}
"""Track name → ``tid``. The same numbers in predicted and measured traces."""

PREDICTED_PID, MEASURED_PID = 1, 2


# --------------------------------------------------------------------------- format


def _doc(
    events: list[dict], pid: int, label: str, metadata: dict[str, Any], tracks: list[str]
) -> dict[str, Any]:
    """A trace document: ``events`` plus the process and thread names."""
    meta = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}}]
    meta += [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": TRACKS[t], "args": {"name": t}}
        for t in tracks
    ]
    # thread_sort_index keeps the lanes in TRACKS order instead of first-event order.
    meta += [
        {
            "name": "thread_sort_index",
            "ph": "M",
            "pid": pid,
            "tid": TRACKS[t],
            "args": {"sort_index": TRACKS[t]},
        }
        for t in tracks
    ]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms", "metadata": metadata}


def _x(
    name: str, track: str, ts_us: float, dur_us: float, pid: int, cat: str, **args: Any
) -> dict[str, Any]:
    """One complete (``ph: X``) event; times rounded to ns so files stay readable."""
    ev = {
        "name": name,
        "cat": cat,
        "ph": "X",
        "ts": round(ts_us, 3),
        "dur": round(max(dur_us, 0.0), 3),
        "pid": pid,
        "tid": TRACKS[track],
    }
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
        required = {
            "X": ("name", "ph", "ts", "dur", "pid", "tid"),
            "M": ("name", "ph", "pid", "tid", "args"),
        }.get(ph)
        if required is None:
            raise ValueError(
                f"unsupported phase {ph!r} (we write X and M events) - at `{where}.ph`"
            )
        for key in required:
            if key not in ev:
                raise ValueError(f"{ph} event lacks `{key}` - at `{where}`")
        if not isinstance(ev["name"], str):
            raise ValueError(f"name must be a string, got {ev['name']!r} - at `{where}.name`")
        for key in ("pid", "tid"):
            if not isinstance(ev[key], (int, str)) or isinstance(ev[key], bool):
                raise ValueError(
                    f"{key} must be an int or string, got {ev[key]!r} - at `{where}.{key}`"
                )
        if ph == "X":
            for key in ("ts", "dur"):
                if not number(ev[key]):
                    raise ValueError(
                        f"{key} must be a finite number (µs), got {ev[key]!r} - at `{where}.{key}`"
                    )
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
    from ..search.cost import make_terms

    if profile.model.fingerprint != plan.model.fingerprint:
        raise ConfigError(
            f"the profile is of {profile.model.name} but the plan is for {plan.model.name} "
            "(model fingerprints differ)",
            "pass the profile the plan was made from (`protrain plan --profile FILE`)",
        )
    t = make_terms(
        profile,
        plan.chunks.chunk_numel,
        plan.training.world_size,
        plan.schedule.cpu_adam,
        plan.training.grad_accum,
        plan.placement.shard_persistent_states,
        nvme=bool(plan.placement.nvme),
    )
    if t.n_chunks != len(plan.chunks.items):
        raise ConfigError(
            f"the profile lays {profile.model.name} out in {t.n_chunks} chunks of "
            f"{plan.chunks.chunk_numel} elements, the plan in {len(plan.chunks.items)}",
            "make the plan from this profile with `protrain plan --profile FILE`",
        )
    return t


# ------------------------------------------------------------------ predicted trace


class _Lanes:
    """When each lane is next free (µs). On a ``cpu`` device every copy runs on the main
    thread, synchronously, so compute, H2D, D2H and collectives share one clock; the CPU
    Adam worker is a thread of its own either way."""

    def __init__(self, sync: bool):
        self.sync = sync
        self.free = {name: 0.0 for name in TRACKS}

    def run(
        self, lane: str, at: float, dur: float, background: bool = False
    ) -> tuple[float, float]:
        """``background``: runs on a thread of its own on a ``cpu`` device too (an asynchronous
        collective: gloo's threads)."""
        key = "compute" if self.sync and lane != "CPU Adam" and not background else lane
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
      the worker is free (the cost model's [CPU Adam timeline]), and a chunk on disk
      (``placement.nvme``) adds its disk traffic to it; the device Adam of the persistent
      chunks (after their all-reduce) follows backward;
    - a homeless chunk's upload waits for its master to be rounded into a slot, and one
      that reads its master from disk for the read, on the main thread (``round``/``read``
      on the compute track: the cost model's conversion time, planner/search/host_tiers.py);
    - on a ``cpu`` device every copy is synchronous (one clock, see ``_Lanes``).

    Simplifications against ``cost.evaluate`` (why the totals differ a little): the
    cost model counts transfers as an upper bound of the schedule's and closes each
    segment at ``max(compute, uploads, swap-outs, offloads)``, where the trace lets a
    swap-out or offload run on past its segment's end as the executor does; the
    trace replays ``grad_accum`` micro-batches (CPU Adam after the last), the cost
    model multiplies one by ``grad_accum``; a device-homed chunk's gradients are
    reduced and stepped on the device here (no download, no CPU step), where the cost
    model charges their download as a host chunk's (cost.py [Device homes]).
    ``tests/test_trace.py`` pins the gap.
    """
    from ..search.cost import SWAP_OVERHEAD_US
    from ..search.host_tiers import fetch_reads_disk

    t = _terms_for(profile, plan)
    pid = PREDICTED_PID
    segs = P.segments(plan)
    index = {s: i for i, s in enumerate(segs)}
    policy = {a.block: a.policy for a in plan.activations}
    offloaded = set(plan.placement.offloaded)
    homed = set(plan.placement.device_homed)
    homeless, on_disk = set(plan.placement.homeless), set(plan.placement.nvme)
    W = t.world_size

    def host_work(c: int) -> tuple[str, float]:
        """What the main thread does before a chunk's upload (host_tiers.py: the conversion
        of a homeless chunk, the disk read of a master a fetch reads from disk), and how long."""
        reads = fetch_reads_disk(t, c in on_disk, c in homeless)
        us = (t.convert_us if c in homeless else 0.0) + (
            int(t.host_numel[c]) * t.disk_fetch_us_per_elem if reads else 0.0
        )
        return ("round" if c in homeless else "read"), us

    def cpu_step_us(c: int) -> float:
        """A chunk's CPU step: its AdamW, plus its disk traffic if on disk (cost.py)."""
        disk = int(t.host_numel[c]) * t.disk_step_us_per_elem if c in on_disk else 0.0
        return int(t.chunk_params[c]) * t.cpu_adam_us_per_param + disk

    # t_up / t_down include the collective under ZeRO-3 (cost.make_terms); split them.
    coll_us = t.allreduce_us_per_chunk / 2
    # Persistent chunks' reductions start in backward (cost.evaluate [Overlapped reductions]).
    reduce_us = t.reduce_us_per_chunk
    reduce_name = (
        "reduce_scatter" if t.shard_persistent else "all_reduce"
    )  # dist.py [Note: sharding]
    reduce_at: dict[str, list[int]] = {}
    for c in plan.placement.persistent if W > 1 else []:
        reduce_at.setdefault(segs[int(np.argmax(t.offload_at[:, c]))], []).append(c)
    up_us, down_us = t.t_up - coll_us, t.t_down - coll_us
    lanes = _Lanes(sync=not t.gpu)
    after_backward = (
        plan.schedule.cpu_adam == "after_backward"
    )  # CPU steps wait for the end of backward
    events: list[dict] = []

    ready: dict[int, float] = {}  # resident offloaded chunk → when its upload lands
    swapped_out: dict[str, float] = {}  # swapped block → when its activations reached the host
    swapped_in: dict[str, float] = {}  # swapped block → when they are back on the device
    grads_down: dict[int, float] = {}  # chunk → when its gradients reached the host

    def upload(c: int, at: float, verb: str) -> float:
        what, us = host_work(c)
        if us:
            r0, at = lanes.run("compute", at, us)
            events.append(_x(f"{what} c{c}", "compute", r0, at - r0, pid, "host", chunk=c))
        s, e = lanes.run("H2D", at, up_us)
        events.append(
            _x(f"{verb} c{c}", "H2D", s, e - s, pid, "h2d", chunk=c, bytes=t.chunk_bytes // W)
        )
        if W > 1:
            s, e = lanes.run("collectives", e, coll_us)
            events.append(
                _x(f"all_gather c{c}", "collectives", s, e - s, pid, "collective", chunk=c)
            )
        return e

    def offload(c: int, at: float) -> float:
        if W > 1:
            s, at = lanes.run("collectives", at, coll_us)
            events.append(
                _x(f"reduce_scatter c{c}", "collectives", s, at - s, pid, "collective", chunk=c)
            )
        s, e = lanes.run("D2H", at, down_us)
        events.append(
            _x(f"offload c{c}", "D2H", s, e - s, pid, "d2h", chunk=c, bytes=t.chunk_bytes // W)
        )
        return e

    # The schedule's own replay (plans/validation.py ``replay``): which chunks each step
    # uploads, in issue order (``fetch`` of chunks not resident, then ``prefetch``).
    replayed: dict[str, list] = {"forward": [], "backward": []}
    for phase, _, step, _, begin, _ in V.replay(plan.schedule):
        replayed[phase].append((step, [c for kind, c, _ in begin if kind == "chunks"]))

    def upload_begin(step: P.Step, begin: list[int]) -> None:
        for c in begin:
            ready[c] = upload(c, now, "prefetch" if c in step.prefetch else "fetch")

    now = 0.0
    k = plan.training.grad_accum
    for micro in range(k):
        last_micro = micro == k - 1
        # -- forward: one step per segment, <pre> … <post>
        fwd_start = now
        for step, begin in replayed["forward"]:
            s = index[step.segment]
            upload_begin(step, begin)
            at = max([now, *(ready[c] for c in step.fetch)])
            swap = step.segment in policy and H.POLICIES[policy[step.segment]].moves
            overhead = SWAP_OVERHEAD_US if (swap and t.gpu) else 0.0
            cs, ce = lanes.run("compute", at, float(t.comp_fwd[s]) + overhead)
            events.append(
                _x(
                    f"forward {step.segment}",
                    "compute",
                    cs,
                    ce - cs,
                    pid,
                    "compute",
                    segment=step.segment,
                    phase="forward",
                    micro_batch=micro,
                )
            )
            if swap:  # saved tensors go down as the block's forward saves them
                ss, se = lanes.run("D2H", cs, float(t.saved_tensor[s]) * t.swap_out_us_per_byte)
                events.append(
                    _x(
                        f"swap_out {step.segment}",
                        "D2H",
                        ss,
                        se - ss,
                        pid,
                        "d2h",
                        block=step.segment,
                        bytes=int(t.saved_tensor[s]),
                    )
                )
                swapped_out[step.segment] = se
            for c in step.release:
                ready.pop(c, None)
            now = ce if t.gpu else lanes.free["compute"]
        events.append(
            _x("forward", "iteration", fwd_start, now - fwd_start, pid, "phase", micro_batch=micro)
        )

        # -- backward: one step per segment, <post> … <pre>
        bwd_start = now
        for step, begin in replayed["backward"]:
            s = index[step.segment]
            for b in step.swap_in:
                ss, se = lanes.run(
                    "H2D",
                    max(now, swapped_out[b]),
                    float(t.saved_tensor[index[b]]) * t.swap_in_us_per_byte,
                )
                events.append(
                    _x(
                        f"swap_in {b}",
                        "H2D",
                        ss,
                        se - ss,
                        pid,
                        "h2d",
                        block=b,
                        bytes=int(t.saved_tensor[index[b]]),
                    )
                )
                swapped_in[b] = se
            upload_begin(step, begin)
            at = max([now, *(ready[c] for c in step.fetch), swapped_in.get(step.segment, 0.0)])
            if step.segment in policy and H.POLICIES[policy[step.segment]].recomputes:
                cs, ce = lanes.run("compute", at, float(t.comp_fwd[s]))
                events.append(
                    _x(
                        f"recompute {step.segment}",
                        "compute",
                        cs,
                        ce - cs,
                        pid,
                        "compute",
                        segment=step.segment,
                        phase="backward",
                        micro_batch=micro,
                    )
                )
                at = ce
            cs, ce = lanes.run("compute", at, float(t.comp_bwd[s]))
            events.append(
                _x(
                    f"backward {step.segment}",
                    "compute",
                    cs,
                    ce - cs,
                    pid,
                    "compute",
                    segment=step.segment,
                    phase="backward",
                    micro_batch=micro,
                )
            )
            for c in step.offload:
                if (
                    c in homed
                ):  # reduced, then stepped on compute at once (chunks.py [Note: device homes])
                    at = ce
                    if W > 1:
                        r0, at = lanes.run("collectives", ce, coll_us)
                        events.append(
                            _x(
                                f"reduce_scatter c{c}",
                                "collectives",
                                r0,
                                at - r0,
                                pid,
                                "collective",
                                chunk=c,
                            )
                        )
                    n = int(t.chunk_params[c])
                    a0, a1 = lanes.run("compute", at, n * t.homed_adam_us_per_param)
                    events.append(
                        _x(
                            f"adam (device) c{c}",
                            "compute",
                            a0,
                            a1 - a0,
                            pid,
                            "compute",
                            chunk=c,
                            params=n,
                        )
                    )
                    continue
                grads_down[c] = offload(c, ce)
                if last_micro and c in offloaded and not after_backward:
                    n = int(t.chunk_params[c])
                    a0, a1 = lanes.run("CPU Adam", grads_down[c], cpu_step_us(c))
                    events.append(
                        _x(
                            f"cpu_adam c{c}",
                            "CPU Adam",
                            a0,
                            a1 - a0,
                            pid,
                            "cpu_adam",
                            chunk=c,
                            params=n,
                        )
                    )
            for c in reduce_at.get(step.segment, []) if last_micro else []:
                r0, r1 = lanes.run("collectives", ce, reduce_us, background=True)
                events.append(
                    _x(
                        f"{reduce_name} c{c}",
                        "collectives",
                        r0,
                        r1 - r0,
                        pid,
                        "collective",
                        chunk=c,
                    )
                )
            for c in step.release:
                ready.pop(c, None)
            now = ce if t.gpu else lanes.free["compute"]
        events.append(
            _x("backward", "iteration", bwd_start, now - bwd_start, pid, "phase", micro_batch=micro)
        )

    # -- optimizer: persistent chunks' collectives under ZeRO-3, device Adam;
    # with cpu_adam "after_backward" the CPU steps too, once the last gradients landed
    opt_start = now
    if after_backward:
        start = max([now, *(grads_down[c] for c in offloaded if c in grads_down)])
        for step in plan.schedule.backward:
            for c in step.offload:
                n = int(t.chunk_params[c])
                a0, a1 = lanes.run("CPU Adam", start, cpu_step_us(c))
                events.append(
                    _x(
                        f"cpu_adam c{c}",
                        "CPU Adam",
                        a0,
                        a1 - a0,
                        pid,
                        "cpu_adam",
                        chunk=c,
                        params=n,
                    )
                )
    n_persist = len(plan.placement.persistent)
    if W > 1 and n_persist:
        now = max(now, lanes.free["collectives"])  # the engine waits for the reductions
    n_dev = int(sum(int(t.chunk_params[c]) for c in plan.placement.persistent))
    if n_dev:
        s, now = lanes.run("compute", now, n_dev * t.dev_adam_us_per_param)
        events.append(_x("adam (device)", "compute", s, now - s, pid, "compute", params=n_dev))
    if W > 1 and n_persist and t.shard_persistent:  # the updated shards to every rank
        s, now = lanes.run("collectives", now, n_persist * (t.allreduce_us_per_chunk - reduce_us))
        events.append(
            _x("all_gather", "collectives", s, now - s, pid, "collective", chunks=n_persist)
        )
    end = max(now, lanes.free["CPU Adam"])
    events.append(_x("optimizer", "iteration", opt_start, end - opt_start, pid, "phase"))

    tracks = ["iteration", "compute", "H2D", "D2H", "CPU Adam"] + (["collectives"] if W > 1 else [])
    label = f"predicted: {plan.model.name} on {plan.hardware.name or profile.hardware.name}"
    metadata = {
        "source": "predicted",
        "model": plan.model.name,
        "hardware": profile.hardware.name,
        "trace_iter_time_us": round(end, 3),
        "plan_iter_time_us": plan.prediction.iter_time_us,
        "profile_source": profile.source,
    }
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

    Listens through ``engine.on_event`` (executor/events.py, [Note: events]), the
    engine's one observation interface: segment begin/end (compute spans and the
    forward/backward phases), each copy's begin/end (H2D and D2H spans: fetch,
    prefetch, swap_in, offload, swap_out), the CPU AdamW worker's steps (timed in the
    worker thread, counted for the step that offloaded the chunk's gradients), the
    collectives (world size > 1) and step begin/end (iterations). ``uninstall()``
    removes the listener. Per event the cost is one timestamp (a CUDA timing event on
    a GPU) and one small record; nothing synchronizes until ``to_dict()``. A swap
    copies each saved storage on its own; ``to_dict()`` joins them into one span per
    block and step (args: ``tensors``, ``busy_us``).

    On CUDA a copy's span starts when its stream may begin it (the copy engine has
    made the stream wait for compute when it announces the copy) and ends when it
    completes, so it is the copy itself, not its queueing.
    """

    COPIES = {
        "fetch": "H2D",
        "prefetch": "H2D",
        "swap_in": "H2D",
        "offload": "D2H",
        "swap_out": "D2H",
    }
    COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce")

    def __init__(self, engine, max_steps: int | None = None):
        self.engine = engine
        self.max_steps = max_steps  # record the first steps only (None: all)
        self.clock: _Clock | None = None
        self.spans: list[_Span] = []  # appended from the main thread and the CPU Adam worker
        self.open: dict[tuple[str, str], Any] = {}  # (phase, segment) → begin stamp
        self.phase_open: dict[str, Any] = {}  # "forward"/"backward"/"optimizer" → begin stamp
        self.copy_open: dict[str, Any] = {}  # copy kind → begin stamp of the copy being issued
        self.step_index = 0
        self.step_start: Any = None  # stamp of the running step's begin
        self.cpu_step_of: dict[int, int] = {}  # chunk → step that offloaded its gradients
        self.cpu_open: dict[int, float] = {}  # chunk → CPU step begin (worker thread)
        self.remove: Callable[[], None] | None = None  # removes our listener

    # -- install / uninstall

    def install(self) -> MeasuredTrace:
        self.clock = _Clock(self.engine.device)
        self.remove = self.engine.on_event(self._on_event)
        return self

    def uninstall(self) -> None:
        if self.remove is not None:
            self.remove()
            self.remove = None

    def __enter__(self) -> MeasuredTrace:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    # -- recorders

    def _add(self, name: str, track: str, cat: str, start, end, **args: Any) -> None:
        args.setdefault("step", self.step_index)
        if self.max_steps is None or args["step"] < self.max_steps:
            self.spans.append(_Span(name, track, cat, start, end, args))

    def _on_event(self, ev: Event) -> None:
        kind = ev.kind
        if kind == "segment":
            self._segment(ev)
        elif kind in self.COPIES:
            self._copy(ev)
        elif kind == "cpu_step":  # on the CPU Adam worker thread: host time
            if ev.edge == "begin":
                self.cpu_open[ev.chunk] = self.clock.host()
            elif ev.chunk in self.cpu_open:  # (not one that began before we were installed)
                self._add(
                    f"cpu_adam c{ev.chunk}",
                    "CPU Adam",
                    "cpu_adam",
                    self.cpu_open.pop(ev.chunk),
                    self.clock.host(),
                    chunk=ev.chunk,
                    step=self.cpu_step_of.get(ev.chunk, self.step_index),
                )
        elif kind == "collective":
            op, _, what = ev.detail.partition(" of ")  # "all-gather of chunk 3"
            if op not in self.COLLECTIVES:
                return
            if ev.edge == "begin":
                self.copy_open[op] = self.clock.stream()
            else:
                end = self.clock.stream()
                self._add(
                    f"{op.replace('-', '_')} {what}".strip(),
                    "collectives",
                    "collective",
                    self.copy_open.pop(op, end),
                    end,
                )
        elif kind == "step":
            self._step(ev)

    def _segment(self, ev: Event) -> None:
        stamp = self.clock.stream()
        # evaluate replays the forward steps; shown as forward, as before.
        p = "forward" if ev.phase == "evaluate" else ev.phase
        segment = ev.segment
        if ev.edge == "begin":
            self.open[(p, segment)] = stamp
            first = (p == "forward" and segment == P.PRE) or (p == "backward" and segment == P.POST)
            if first:
                self.phase_open[p] = stamp
            return
        start = self.open.pop((p, segment), stamp)
        self._add(
            f"{p} {segment}",
            "compute",
            "compute",
            start,
            stamp,
            segment=segment,
            phase=p,
            step=self.step_index,
        )
        last = (p == "forward" and segment == P.POST) or (p == "backward" and segment == P.PRE)
        if last and p in self.phase_open:
            self._add(p, "iteration", "phase", self.phase_open.pop(p), stamp, step=self.step_index)
            if p == "backward":
                self.phase_open["optimizer"] = stamp

    def _copy(self, ev: Event) -> None:
        stamp = self.clock.stream(ev.stream)  # on the copy stream (CUDA), see the class doc
        if ev.edge == "begin":
            self.copy_open[ev.kind] = stamp
            return
        if ev.kind == "offload":
            self.cpu_step_of[ev.chunk] = (
                self.step_index
            )  # the worker may step it after the step ends
        label = f"{ev.kind} c{ev.chunk}" if ev.chunk is not None else f"{ev.kind} {ev.block}"
        track = self.COPIES[ev.kind]
        self._add(
            label,
            track,
            track.lower(),
            self.copy_open.pop(ev.kind, stamp),
            stamp,
            bytes=ev.nbytes,
            step=self.step_index,
        )

    def _step(self, ev: Event) -> None:
        stamp = self.clock.stream()
        if ev.edge == "begin":
            self.step_start = stamp
            return
        if "optimizer" in self.phase_open:
            self._add(
                "optimizer",
                "iteration",
                "phase",
                self.phase_open.pop("optimizer"),
                stamp,
                step=self.step_index,
            )
        self._add(
            f"step {self.step_index}",
            "iteration",
            "step",
            stamp if self.step_start is None else self.step_start,
            stamp,
            loss=round(ev.loss, 6),
        )
        self.step_index += 1

    # -- export

    def to_dict(self) -> dict[str, Any]:
        """The recorded spans as a Chrome trace (waits for the device and the CPU worker first)."""
        e = self.engine
        e.optim.wait_all()  # CPU Adam spans land when the worker finishes
        if self.clock is not None and self.clock.cuda:
            self.clock.torch.cuda.synchronize(e.device)
        resolved = sorted(
            (
                (self.clock.resolve(sp.start), self.clock.resolve(sp.end), sp)
                for sp in list(self.spans)
            ),
            key=lambda r: (r[0], TRACKS[r[2].track]),
        )
        events = []
        last_on: dict[str, dict] = {}  # track → its latest event (to coalesce swaps)
        for start, end, sp in resolved:
            prev = last_on.get(sp.track)
            # A swap moves each saved tensor separately; one span per block and step
            # (first copy's start to last copy's end) reads better next to the prediction.
            if (
                prev is not None
                and sp.name.startswith("swap_")
                and prev["name"] == sp.name
                and prev["args"].get("step") == sp.args.get("step")
            ):
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
        tracks = ["iteration", "compute", "H2D", "D2H", "CPU Adam"] + (
            ["collectives"] if world > 1 else []
        )
        metadata = {
            "source": "measured",
            "model": e.plan.model.name,
            "device": str(e.device),
            "steps": self.step_index,
            "plan_iter_time_us": e.plan.prediction.iter_time_us,
        }
        return _doc(
            events, MEASURED_PID, f"measured: {e.plan.model.name} on {e.device}", metadata, tracks
        )

    def save(self, path: str | Path) -> None:
        write_trace(self.to_dict(), path)


@contextlib.contextmanager
def record_trace(engine, max_steps: int | None = None) -> Iterator[MeasuredTrace]:
    """``with record_trace(engine) as rec: engine.step(...)`` then ``rec.save(path)``.

    ``max_steps``: keep the first steps only (a long run's trace stays small; the
    listener stays installed, at the cost of a clock read per event)."""
    rec = MeasuredTrace(engine, max_steps).install()
    try:
        yield rec
        engine.synchronize()  # the last step's CPU steps finish on the worker after step() returns
    finally:
        rec.uninstall()
