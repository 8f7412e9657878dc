"""Does this model fine-tune on this card and this host? (``protrain fit --hf-config DIR``)

``fit.py`` answers "the largest model of a family that fits"; this module answers
the question for one given model, typically a Hugging Face config.json built on
``meta`` (nothing allocated, nothing downloaded). For each candidate micro-batch,
smallest first, it does what ``fit._probe`` does for a ladder rung: an analytic
profile of the model on the spec (``analytic.analytic_profile``), then
``planning.make_plan`` at the world size asked (ZeRO-3) under the device budget and
the host budget per rank (``--host-memory SIZE`` is the machine's RAM, shared by
the ranks as ``planning.host_budget_per_rank`` says). A micro-batch fits when ``make_plan`` returns
a plan; it does not when it raises ``BudgetError`` (no configuration under the device budget) or
``HostMemoryError`` (configurations fit the device, none the host: the search honours the host
limit, so a slower plan that keeps more on the device is chosen before this is said). Activations
grow with the micro-batch and nothing shrinks, so the first refusal ends the search. The answer is
the fitting micro-batch with the most tokens per second, and the resource that stopped the next one.

Mixture-of-experts models (``moe.py``): the report gives total and active
parameters; the plan's memory is charged for all of them (every expert has
weights, gradients and Adam states), its compute for the active ones (the
analytic profile runs each expert bank at balanced load: ``tokens x top_k /
n_experts`` rows per expert). What routing imbalance can add is bounded in
[Note: routing imbalance] in moe.py: at most 2x on the expert GEMMs, nothing while
each expert's rows stay above the roofline's ridge point; the report prints both
numbers for the chosen micro-batch.

A probe costs an analytic profile (about 1 s for Mixtral-8x7B at T=4096 on a
2-core box) plus a search, so a model is answered in seconds.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import nn

from protrain.plans import plan as P
from protrain.plans.errors import BudgetError, ConfigError, HostMemoryError

from ..hardware.spec import HardwareSpec
from ..models.moe import MoeLayout
from ..search import memory_walk
from .fit import MICRO_BATCHES, host_need_bytes


@dataclass(frozen=True)
class BatchProbe:
    """One micro-batch the search tried."""

    micro_batch: int
    fits: bool
    reason: str
    """Why not (``device memory: …`` / ``host memory: …``), or the predicted time when it fits."""
    seconds: float
    """Wall time of the probe (profile + plan)."""
    plan: P.Plan | None = None

    @property
    def tokens_per_s(self) -> float:
        if self.plan is None or not self.plan.prediction.iter_time_us:
            return 0.0
        t = self.plan.training  # every rank runs its own micro-batch
        return t.world_size * t.micro_batch * t.seq_len / (self.plan.prediction.iter_time_us / 1e6)


@dataclass(frozen=True)
class ModelFit:
    """The answer for one model on one card and host."""

    name: str
    hardware: str
    budget_bytes: int
    """Device memory a plan may use."""
    host_budget_bytes: int
    """Host memory a plan may use per rank (``--host-memory`` shared by the ranks, or the
    spec's RAM, each less the reserve: ``planning.host_budget_per_rank``)."""
    seq_len: int
    compute_dtype: str
    total_params: int
    """Every parameter (tied once): what memory is charged for."""
    active_params: int
    """Parameters one token's compute touches (== total for a dense model)."""
    moe: MoeLayout | None
    probes: list[BatchProbe] = field(default_factory=list)
    seconds: float = 0.0
    ridge_rows: float = 0.0
    """Rows per expert above which an expert GEMM is compute-bound on this spec (MoE only)."""
    world_size: int = 1
    """Ranks (ZeRO-3), one device each."""

    @property
    def best(self) -> BatchProbe | None:
        """The fitting micro-batch with the most tokens per second (ties: the smaller)."""
        fitting = [p for p in self.probes if p.fits]
        return max(fitting, key=lambda p: (p.tokens_per_s, -p.micro_batch)) if fitting else None

    @property
    def fits(self) -> bool:
        return self.best is not None

    @property
    def binds(self) -> str:
        """What stops a larger micro-batch (or the smallest one): the first refusal's reason."""
        refused = [p for p in self.probes if not p.fits]
        if refused:
            return refused[0].reason
        plan = self.probes[-1].plan
        assert plan is not None, f"{self.probes[-1]=}"
        device = plan.prediction.peak_memory_bytes / self.budget_bytes
        host = host_need_bytes(plan) / max(self.host_budget_bytes, 1)
        closest = (
            f"device memory at {device:.0%}" if device >= host else f"host memory at {host:.0%}"
        )
        return (
            f"nothing up to micro-batch {self.probes[-1].micro_batch}, the largest tried "
            f"(closest to its limit there: {closest})"
        )


def ridge_rows(spec: HardwareSpec, dtype_bytes: int) -> float:
    """Rows an expert GEMM needs to be compute-bound on ``spec``: rate x element bytes /
    (2 x bandwidth), from ``a L >= w`` in [Note: routing imbalance] (large in/out widths)."""
    rate = spec.matmul_flops_per_s if dtype_bytes == 2 else spec.matmul_fp32_flops_per_s
    return rate * dtype_bytes / (2 * spec.mem_bytes_per_s)


def fit_model(
    model: nn.Module,
    *,
    name: str,
    spec: HardwareSpec,
    seq_len: int,
    budget_bytes: int | None = None,
    host_budget_bytes: int | None = None,
    micro_batches: Sequence[int] = MICRO_BATCHES,
    compute_dtype: str = "bfloat16",
    blocks: list[str] | None = None,
    progress: Callable[[BatchProbe], None] | None = None,
    world_size: int = 1,
    nvme: bool = False,
) -> ModelFit:
    """Probe ``micro_batches`` (ascending, until one does not fit) for ``model`` (built on
    meta) on one ``spec`` device; see the module docstring.

    ``budget_bytes`` defaults to the spec's usable memory, ``host_budget_bytes`` to
    ``planning.default_host_budget(spec)``. ``nvme``: plans may keep optimizer states on
    disk (``make_plan(nvme=True)``; the spec must carry the disk's bandwidth).
    """
    from ..hardware.units import human_bytes
    from ..models.moe import detect
    from ..models.zoo import block_paths
    from ..profiling.analytic import DTYPES, analytic_profile
    from ..search.planning import default_host_budget, make_plan, require_disk

    t0 = time.perf_counter()
    if not micro_batches or min(micro_batches) < 1:
        raise ConfigError(
            f"micro-batches must be positive, got {list(micro_batches)}", "e.g. 1 2 4 8 16"
        )
    if nvme:
        require_disk(spec)
    budget = spec.usable_memory_bytes if budget_bytes is None else budget_bytes
    host_budget = default_host_budget(spec) if host_budget_bytes is None else host_budget_bytes
    blocks = block_paths(model) if blocks is None else blocks
    layout = detect(model)
    total = sum(p.numel() for p in model.parameters())
    probes: list[BatchProbe] = []
    for mb in sorted(set(micro_batches)):
        t1 = time.perf_counter()
        profile = analytic_profile(
            model,
            name=name,
            blocks=blocks,
            micro_batch=mb,
            seq_len=seq_len,
            compute_dtype=compute_dtype,
            spec=spec,
        )
        try:
            plan, _ = make_plan(
                profile, budget, host_budget_bytes=host_budget, world_size=world_size, nvme=nvme
            )
        except HostMemoryError as e:
            probe = BatchProbe(
                mb,
                False,
                f"host memory: needs {human_bytes(e.need)}, {human_bytes(e.available)} usable",
                time.perf_counter() - t1,
            )
        except BudgetError as e:
            # make_plan's message names the least peak any configuration reaches.
            least = re.search(r"smallest predicted peak is ([^(]+?) \(", str(e))
            need = f"needs {least.group(1)} at least, " if least else "no configuration fits the "
            probe = BatchProbe(
                mb,
                False,
                f"device memory: {need}{human_bytes(budget)} budget",
                time.perf_counter() - t1,
            )
        else:
            probe = BatchProbe(
                mb,
                True,
                f"{_time(plan.prediction.iter_time_us)}/iter",
                time.perf_counter() - t1,
                plan,
            )
        probes.append(probe)
        if progress is not None:
            progress(probe)
        if not probe.fits:
            break
    return ModelFit(
        name=name,
        hardware=spec.name,
        budget_bytes=budget,
        host_budget_bytes=host_budget,
        seq_len=seq_len,
        compute_dtype=compute_dtype,
        total_params=total,
        active_params=layout.active_params if layout else total,
        moe=layout,
        probes=probes,
        seconds=time.perf_counter() - t0,
        ridge_rows=ridge_rows(spec, DTYPES[compute_dtype].itemsize) if layout else 0.0,
        world_size=world_size,
    )


# ---------------------------------------------------------------------------- report


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 10**9 else f"{n / 1e6:.1f}M"


def _time(us: int) -> str:
    return f"{us / 1e6:.2f} s" if us >= 10**6 else f"{us / 1e3:.1f} ms"


def render_model_fit(r: ModelFit) -> str:
    """The ``protrain fit --hf-config`` report: sizes, one row per micro-batch, the verdict."""
    from ..hardware.units import human_bytes

    lines = [
        (
            f"fit {r.name} on {r.hardware}: {human_bytes(r.budget_bytes)} device budget, "
            f"{human_bytes(r.host_budget_bytes)} host budget per rank, seq {r.seq_len}, "
            f"{r.compute_dtype}, "
        )
        + ("one device" if r.world_size == 1 else f"{r.world_size} ranks (ZeRO-3)")
    ]
    if r.moe is None:
        lines.append(f"parameters: {_params(r.total_params)} (dense: all active)")
    else:
        m = r.moe
        shared = f" + {m.n_shared_experts} shared" if m.n_shared_experts else ""
        lines.append(
            f"parameters: {_params(r.total_params)} total, {_params(r.active_params)} active per "
            f"token (mixture of experts: top-{m.top_k} of {m.n_experts}{shared} in {len(m.banks)} "
            "blocks)"
        )
        lines.append("  memory is charged for all parameters, compute for the active ones")
    head = ("micro-batch", "fits", "iter time", "tokens/s", "device peak", "host need", "probe")
    rows = [head]
    for p in r.probes:
        if p.plan is not None:
            rows.append(
                (
                    str(p.micro_batch),
                    "yes",
                    _time(p.plan.prediction.iter_time_us),
                    f"{p.tokens_per_s:,.0f}",
                    human_bytes(p.plan.prediction.peak_memory_bytes),
                    human_bytes(host_need_bytes(p.plan)),
                    f"{p.seconds:.1f} s",
                )
            )
        else:
            rows.append((str(p.micro_batch), "no", p.reason, "", "", "", f"{p.seconds:.1f} s"))
    widths = [
        max(len(row[i]) for row in rows if row[1] != "no" or i != 2) for i in range(len(head))
    ]
    for k, row in enumerate(rows):
        if row[1] == "no":  # the reason spans the numeric columns
            lines.append(
                f"{row[0].rjust(widths[0])}  {row[1].ljust(widths[1])}  {row[2]}  ({row[6]})"
            )
        else:
            lines.append(
                "  ".join(
                    c.rjust(w) if i != 1 else c.ljust(w)
                    for i, (c, w) in enumerate(zip(row, widths))
                ).rstrip()
            )
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    best = r.best
    if best is None:
        lines.append(
            f"verdict: does not fit, even at micro-batch {r.probes[0].micro_batch}: {r.binds}"
        )
        return "\n".join(lines)
    plan = best.plan
    assert plan is not None, f"{best=}"
    peak, host = plan.prediction.peak_memory_bytes, host_need_bytes(plan)
    n_chunks, n_persist = len(plan.chunks.items), len(plan.placement.persistent)
    lines.append(
        f"verdict: fits at micro-batch {best.micro_batch} x seq {r.seq_len}: "
        f"{_time(plan.prediction.iter_time_us)}/iter, {best.tokens_per_s:,.0f} tokens/s; "
        f"device {human_bytes(peak)} of {human_bytes(r.budget_bytes)} "
        f"({peak / r.budget_bytes:.0%}), host {human_bytes(host)} of "
        f"{human_bytes(r.host_budget_bytes)} ({host / max(r.host_budget_bytes, 1):.0%}); "
        f"{n_persist} of {n_chunks} chunks stay on the device"
        + (
            f"; {len(plan.placement.nvme)} keep their optimizer states on disk "
            f"({human_bytes(memory_walk.walk(plan).disk_bytes)} per rank)"
            if plan.placement.nvme
            else ""
        )
    )
    lines.append(f"binds: {r.binds}")
    if r.moe is not None:
        m = r.moe
        mean = best.micro_batch * r.seq_len * m.top_k / m.n_experts
        lines.append(
            f"routing: charged at balanced load, {mean:,.0f} rows per expert; imbalance costs "
            f"nothing while every expert gets >= {r.ridge_rows:,.0f} rows, and at most doubles the "
            "expert GEMMs' time whatever the routing (moe.py, [Note: routing imbalance])"
        )
    return "\n".join(lines)


def run_model_fit(
    model_name: str,
    hardware: str,
    *,
    budget: str | None = None,
    host_memory: str | None = None,
    seq_len: int = 1024,
    micro_batches: Sequence[int] = MICRO_BATCHES,
    compute_dtype: str = "bfloat16",
    echo: Callable[[str], None] = print,
    world_size: int = 1,
    nvme: bool = False,
    lora=None,
) -> ModelFit:
    """``protrain fit --hf-config DIR --hardware X``: build ``model_name`` on meta, probe, print.

    Raises ``BudgetError`` (exit status 1) after the report when nothing fits, so that
    scripts can tell the two answers apart.
    """
    from ..hardware.spec import find_spec
    from ..search.planning import host_budget_per_rank, parse_budget

    spec = find_spec(hardware)
    budget_bytes = parse_budget(budget) if budget else None
    host_bytes = (
        host_budget_per_rank(parse_budget(host_memory), world_size) if host_memory else None
    )
    from ..models.lora import build_model
    from ..profiling.lazy_dynamo import defer_dynamo

    defer_dynamo()  # meta's Python kernels without importing torch._dynamo (lazy_dynamo.py)
    model = build_model(model_name, lora, device="meta")
    echo(
        f"fit      {model_name}{f' ({lora.describe()})' if lora else ''}: probing micro-batches on "
        f"{spec.name} …"
    )

    def progress(p: BatchProbe) -> None:
        echo(
            f"         micro-batch {p.micro_batch:<3} {'fits' if p.fits else 'no  '}  {p.reason}  "
            f"({p.seconds:.1f} s)"
        )

    result = fit_model(
        model,
        name=model_name,
        spec=spec,
        seq_len=seq_len,
        budget_bytes=budget_bytes,
        host_budget_bytes=host_bytes,
        micro_batches=micro_batches,
        compute_dtype=compute_dtype,
        progress=progress,
        world_size=world_size,
        nvme=nvme,
    )
    echo(render_model_fit(result))
    if not result.fits:
        resource = result.binds.split(":")[0]
        raise BudgetError(
            f"{model_name} does not fit {spec.name} at micro-batch {result.probes[0].micro_batch} "
            f"× seq {seq_len}: {result.binds}",
            "a larger --budget (a bigger card)"
            if resource == "device memory"
            else "more host memory (--host-memory), or a larger --budget to offload less",
        )
    return result
