"""The largest model of a family that one device can train (``protrain fit``).

For a family (``gpt2``, ``llama``) we lay its shapes out on a *ladder*: a list of
configurations ordered by parameter count that passes through the zoo's sizes and
interpolates between them (rules below). Bisection on the ladder finds the largest
rung whose analytic profile (``analytic.analytic_profile`` on a meta model) gets a
feasible plan from ``planning.make_plan`` at the world size asked (``N`` ranks,
ZeRO-3: ``make_plan(..., world_size=N)``) and whose host memory need fits the host;
then, at that size, bisection over the candidate micro-batches finds the largest
that still fits. A probe profiles one (size, micro-batch) pair (a 4-block model of its
shape, replicated to its depth: ``_profile``) and plans it, well under a second on a
2-core box; a family costs about 7 size probes, up to 3 more between rungs (below) and
2-3 micro-batch probes.

Ladders (the interpolation rules):

- **gpt2**: the width ``w`` steps by 64 from 768 to 2048, then by 128 to 12288
  (101 rungs, at most 16% apart in parameters above 1B). Depth is piecewise linear in ``w``
  through the zoo (768: 12 layers, 1024: 24, 1280: 36, 1600: 48), stays at 48 up to 4096
  (``gpt2-4b``, ``gpt2-10b``), and beyond grows with the width at gpt2-10b's aspect (48 layers
  per 4096 of width, rounded to an even count; 8192 → 96 layers, 78B). Head size
  64 below a width of 2048, 128 from there (as gpt2-4b and gpt2-10b). GPT-2's
  vocabulary (50257), tied head, learned positions for ``max(1024, seq_len)``.
- **llama**: anchors at public configurations, (layers, dim, ffn): TinyLlama-1.1B
  (22, 2048, 5632), LLaMA-2 7B (32, 4096, 11008), 13B (40, 5120, 13824),
  CodeLlama-34B (48, 8192, 22016), LLaMA-2 70B (80, 8192, 28672) and a LLaMA-3
  405B-shaped (126, 16384, 53248), with 8 rungs between neighbours (41 rungs, at
  most 34% apart, the coarsest beyond 70B): layers and dim
  interpolated linearly (dim rounded to 256), ffn linearly and rounded up to 256
  (the reference code's ``multiple_of``). Head size 128; full multi-head attention
  up to dim 5120 (as 7B and 13B), grouped-query attention above with dim rounded
  to 512 and ``gcd(n_head, 8)`` (4 or 8) key/value heads (8 for 34B and 70B). Vocabulary
  32000, untied head.

Fitting means: ``make_plan`` finds a configuration under the device budget (per
rank) whose host need fits the host budget per rank. The host budget is
``planning.host_budget_per_rank(SIZE, N)``: the machine's host RAM (``--host-memory
SIZE``, default ``N`` times the spec's ``host_memory_bytes``, one rank's share)
shared by the ``N`` ranks, each
rank's share less 10% (the OS) and 2 GiB (its process) — the rule of
``planning.default_host_budget``, which is this at one rank with the spec's RAM.
Host need = the plan's ``host_bytes`` (each offloaded chunk's shard of states on the
host, ``memory_walk.element_bytes``: 14 B per element in bf16 without gradient
accumulation, 12 for the chunks the search makes homeless to fit the host, none for
those it then homes on the device (12 B per element of their shard on the card), 16 in
fp32, 20 when accumulating, and the CPU step's scratch; the
executor's ledger is held to the same) plus ``host_swap_bytes`` (the swapped blocks'
activations). The search itself honours the host limit, so a slower plan keeping
more chunks on the device is chosen when the fastest one would not fit the host.
Before profiling a rung we drop it if even the best case leaves more to offload than
the host budget holds: every byte of the device budget holding persistent parameters
at their compute dtype alone (``element_bytes(...).compute``: a persistent chunk's
parameters are whole on every rank, whatever else of its states is sharded), or, if
that holds more, device-homed at ``HOMED_BYTES / N`` per parameter (their shard of
master and moments: chunks.py [Note: device homes]), the rest offloaded and sharded
over the ``N`` ranks. That needs only the parameter
count, and stays a lower bound whatever the state layout charges beyond it.

With ``--nvme`` (``nvme=True``) plans may keep offloaded chunks' master and moments on disk
where host memory binds (planner/search/host_tiers.py [NVMe tier]; the spec must carry the disk's
bandwidth, ``protrain hardware probe --nvme DIR``): the host floor above no longer applies
(every offloaded chunk may leave its 12 B per element on disk), so no rung is ruled out
without a probe,
and the report adds each winner's file size (``memory_walk.walk(plan).disk_bytes``), which
the disk must hold.

Between the largest fitting rung and the next one, deeper models of the fitting rung's
width (one layer more at a time, staying below the next rung's size) are bisected the
same way: the rungs are up to 16% apart, the answer then within one layer (~1.4% at
70 layers); depth alone keeps every term growing, so fitting stays monotone.

What binds: for the largest fitting size, the resource nearer its limit in the
winning plan (device peak over the device budget, host need over the host budget);
for the next size up, the resource its probe ran out of (``device memory``: no
configuration fits the device budget; ``host memory``: configurations fit the
device, none the host).

Bisection assumes "fits" is monotone along the ladder, which holds as long as a
bigger rung is bigger in every term (states, activations), as both ladders are by
construction (tested).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from protrain.plans import plan as P
from protrain.plans.errors import BudgetError, ConfigError, HostMemoryError, did_you_mean

from ..hardware.spec import HardwareSpec, dump_spec
from ..models.zoo import GPT2Config, LlamaConfig
from ..profiling.profile import Profile
from ..search import memory_walk

FAMILIES = ("gpt2", "llama")

MICRO_BATCHES = (1, 2, 4, 8, 16)
"""Micro-batch candidates tried at the largest fitting size."""


# ---------------------------------------------------------------------------- ladders


def _lerp(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear interpolation through ``points`` (x ascending), clamped at the ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def gpt2_ladder(seq_len: int = 1024) -> list[GPT2Config]:
    """GPT-2 shapes from gpt2 (124M) to a 12288-wide, 144-layer model (261B); module doc."""
    widths = [*range(768, 2048, 64), *range(2048, 12288 + 1, 128)]
    depth = [(768, 12), (1024, 24), (1280, 36), (1600, 48), (4096, 48)]
    out = []
    for w in widths:
        n_layer = round(_lerp(depth, w)) if w <= 4096 else 2 * round(48 * w / 4096 / 2)
        head = 64 if w < 2048 else 128
        out.append(
            GPT2Config(n_layer=n_layer, n_head=w // head, n_embd=w, block_size=max(1024, seq_len))
        )
    return out


LLAMA_ANCHORS = (  # (n_layer, dim, ffn_dim), public configurations; module doc
    (22, 2048, 5632),  # TinyLlama-1.1B
    (32, 4096, 11008),  # LLaMA-2 7B
    (40, 5120, 13824),  # LLaMA-2 13B
    (48, 8192, 22016),  # CodeLlama-34B
    (80, 8192, 28672),  # LLaMA-2 70B
    (126, 16384, 53248),  # LLaMA-3 405B's shape
)
LLAMA_STEPS = 8
"""Rungs from one anchor to the next."""


def llama_ladder(seq_len: int = 4096) -> list[LlamaConfig]:
    """LLaMA shapes from 1.1B to 405B-shaped, through the public configurations; module doc."""
    out = []
    for (l0, d0, f0), (l1, d1, f1) in zip(LLAMA_ANCHORS, LLAMA_ANCHORS[1:]):
        for j in range(LLAMA_STEPS):
            t = j / LLAMA_STEPS
            dim = 256 * round((d0 + t * (d1 - d0)) / 256)
            if dim > 5120:  # GQA: a multiple of 512, so that n_head has 4 or 8 kv groups
                dim = 512 * round((d0 + t * (d1 - d0)) / 512)
            ffn = 256 * math.ceil((f0 + t * (f1 - f0)) / 256)
            n_head = dim // 128
            n_kv = n_head if dim <= 5120 else math.gcd(n_head, 8)
            out.append(
                LlamaConfig(
                    n_layer=round(l0 + t * (l1 - l0)),
                    n_head=n_head,
                    n_kv_head=n_kv,
                    dim=dim,
                    ffn_dim=ffn,
                    max_seq_len=max(4096, seq_len),
                )
            )
    l1, d1, f1 = LLAMA_ANCHORS[-1]
    out.append(
        LlamaConfig(
            n_layer=l1,
            n_head=d1 // 128,
            n_kv_head=8,
            dim=d1,
            ffn_dim=f1,
            max_seq_len=max(4096, seq_len),
        )
    )
    return out


def ladder(family: str, seq_len: int) -> list[GPT2Config] | list[LlamaConfig]:
    if family == "gpt2":
        return gpt2_ladder(seq_len)
    if family == "llama":
        return llama_ladder(seq_len)
    raise ConfigError(
        f"unknown model family {family!r}{did_you_mean(family, FAMILIES)}; "
        f"choose one of {', '.join(FAMILIES)}",
        "pass family='gpt2' or 'llama'",
    )


def n_params(cfg: GPT2Config | LlamaConfig) -> int:
    """Parameter count of a configuration without building it (equals ``models.count_params``)."""
    if isinstance(cfg, GPT2Config):
        w = cfg.n_embd  # tied head; per block: qkv, proj, fc, proj (+biases), two LayerNorms
        return (cfg.vocab_size + cfg.block_size) * w + cfg.n_layer * (12 * w * w + 13 * w) + 2 * w
    d, hd = cfg.dim, cfg.dim // cfg.n_head
    attn = 2 * d * d + 2 * d * cfg.n_kv_head * hd  # q, o; k, v
    return 2 * cfg.vocab_size * d + cfg.n_layer * (attn + 3 * d * cfg.ffn_dim + 2 * d) + d


def describe(cfg: GPT2Config | LlamaConfig) -> str:
    """``48L × 1600 (25 heads)`` / ``80L × 8192, ffn 28672 (64 heads, 8 kv)``."""
    if isinstance(cfg, GPT2Config):
        return f"{cfg.n_layer}L × {cfg.n_embd} ({cfg.n_head} heads)"
    kv = "" if cfg.n_kv_head == cfg.n_head else f", {cfg.n_kv_head} kv"
    return f"{cfg.n_layer}L × {cfg.dim}, ffn {cfg.ffn_dim} ({cfg.n_head} heads{kv})"


# ---------------------------------------------------------------------------- probes


@dataclass(frozen=True)
class Probe:
    """One (size, micro-batch) the search tried."""

    config: GPT2Config | LlamaConfig
    n_params: int
    micro_batch: int
    fits: bool
    reason: str
    """Why not (``device memory: …`` / ``host memory: …``), or the predicted time when it fits."""
    seconds: float
    """Wall time of the probe (profile + plan)."""
    plan: P.Plan | None = None


@dataclass(frozen=True)
class FitResult:
    family: str
    hardware: str
    budget_bytes: int
    host_memory_bytes: int
    """The machine's host RAM, shared by ``world_size`` ranks."""
    seq_len: int
    compute_dtype: str
    config: GPT2Config | LlamaConfig
    """The largest fitting ladder rung."""
    n_params: int
    micro_batch: int
    """The largest fitting micro-batch at that size."""
    iter_time_us: int
    """Predicted iteration time at that micro-batch."""
    tokens_per_s: float
    """Tokens per second over all ranks (each rank runs ``micro_batch`` sequences)."""
    peak_bytes: int
    host_bytes: int
    """Host need per rank (the plan's host_bytes plus swapped activations)."""
    plan: P.Plan
    limit: str
    """What stops the next rung (its probe's reason), or ``end of the ladder``."""
    probes: list[Probe] = field(default_factory=list)
    seconds: float = 0.0
    world_size: int = 1
    host_budget_bytes: int = 0
    """Host bytes per rank a plan may use (``planning.host_budget_per_rank``)."""
    next_config: GPT2Config | LlamaConfig | None = None
    """The next rung up, which does not fit (None at the end of the ladder)."""
    nvme: bool = False
    """Plans were allowed to keep optimizer states on disk (``--nvme``)."""
    disk_bytes: int = 0
    """The winning plan's state file per rank (0: nothing on disk)."""

    @property
    def binds(self) -> str:
        """The resource nearer its limit in the winning plan, with both shares."""
        device = self.peak_bytes / self.budget_bytes
        host = self.host_bytes / max(self.host_budget_bytes, 1)
        if device >= host:
            return f"device memory ({device:.0%} of the budget; host {host:.0%})"
        return f"host memory ({host:.0%} of the host budget; device {device:.0%})"

    @property
    def next_binds(self) -> str:
        """What the next size up ran out of: ``device memory``, ``host memory`` or ``-``."""
        head = self.limit.split(":")[0]
        return head if head in ("device memory", "host memory") else "-"


_PROFILES: dict[tuple, Profile] = {}
"""(config, micro-batch, seq, dtype, spec digest) → analytic profile. Profiles do not depend
on the budget, so a second fit on the same card (another budget) reuses them."""
_MAX_CACHED = 48


def _keep(cache: dict, key, value) -> None:
    """``cache[key] = value``, first dropping the oldest entry once the cache holds
    ``_MAX_CACHED``."""
    if len(cache) >= _MAX_CACHED:
        cache.pop(next(iter(cache)))
    cache[key] = value


_SHALLOW: dict[tuple, tuple[Profile, list]] = {}
"""The same key, of a ``REPLICA_BLOCKS``-deep config → its profile and parameter signature
(``_profile``): the depths of one width (fit.py [Between rungs]) share it."""


def _profile(
    cfg, micro_batch: int, seq_len: int, dtype: str, spec: HardwareSpec, digest: str, lora=None
) -> Profile:
    """The analytic profile of ``cfg`` (with ``lora``'s adapters, its base frozen). A deep
    model's blocks are all alike, so its profile is a shallow model's (``REPLICA_BLOCKS``
    blocks) with the interior block repeated (``deepen.deepen``, equal field by field to
    profiling the deep model: tested, with adapters too), a fraction of the time; the deep
    model itself where ``deepen`` declines."""
    key = (cfg, micro_batch, seq_len, dtype, digest, lora)
    if key not in _PROFILES:
        from ..profiling.deepen import REPLICA_BLOCKS, deepen

        name = f"{'gpt2' if isinstance(cfg, GPT2Config) else 'llama'}-{n_params(cfg) / 1e9:.2f}b"
        profile = None
        if cfg.n_layer > REPLICA_BLOCKS:
            shallow = dataclasses.replace(cfg, n_layer=REPLICA_BLOCKS)
            skey = (shallow, micro_batch, seq_len, dtype, digest, lora)
            if skey not in _SHALLOW:
                _keep(
                    _SHALLOW,
                    skey,
                    _analytic(shallow, "shallow", micro_batch, seq_len, dtype, spec, lora),
                )
            deep = deepen(*_SHALLOW[skey], cfg.n_layer)
            if deep is not None:
                profile = msgspec.structs.replace(
                    deep[0], model=msgspec.structs.replace(deep[0].model, name=name)
                )
        if profile is None:
            profile = _analytic(cfg, name, micro_batch, seq_len, dtype, spec, lora)[0]
        _keep(_PROFILES, key, profile)
    return _PROFILES[key]


_MODELS: dict[tuple, tuple] = {}
"""(config, seq, LoRA) → its meta model, block paths and parameter trace (``_analytic``): a
width's micro-batches share them (analytic_profile changes neither)."""


def _analytic(
    cfg, name: str, micro_batch: int, seq_len: int, dtype: str, spec: HardwareSpec, lora=None
) -> tuple[Profile, list]:
    """``analytic.analytic_profile`` of ``cfg`` built on meta (with ``lora``'s adapters), and
    its parameter signature."""
    import torch

    from protrain.executor.check import model_signature

    from ..models.zoo import GPT2, Llama, block_paths
    from ..profiling.analytic import analytic_profile, parameter_trace
    from ..profiling.lazy_dynamo import defer_dynamo

    key = (cfg, min(seq_len, 8), lora)
    if key not in _MODELS:
        defer_dynamo()  # meta's Python kernels without importing torch._dynamo: 1.8 s of a fit here
        with torch.device("meta"):
            model = GPT2(cfg) if isinstance(cfg, GPT2Config) else Llama(cfg)
        if lora is not None:  # peft's adapters, the base frozen (planner/models/lora.py)
            from ..models.lora import inject

            model = inject(model, lora)
        blocks = block_paths(model)
        _keep(_MODELS, key, (model, blocks, parameter_trace(model, blocks, seq_len)))
    model, blocks, graph = _MODELS[key]
    return analytic_profile(
        model,
        name=name,
        blocks=blocks,
        micro_batch=micro_batch,
        seq_len=seq_len,
        compute_dtype=dtype,
        spec=spec,
        graph=graph,
    ), model_signature(model)


def host_need_bytes(plan: P.Plan) -> int:
    """Host memory the plan needs: offloaded chunks' states and the swapped activations."""
    b = plan.prediction.breakdown
    return int(b.get("host_bytes", 0)) + int(b.get("host_swap_bytes", 0))


def _host_floor_bytes(
    n: int,
    budget_bytes: int,
    dtype: str,
    world_size: int = 1,
    nvme: bool = False,
    lora: bool = False,
) -> int:
    """A lower bound of the host need per rank of any plan for ``n`` parameters: what is
    left to offload, sharded over ``world_size`` ranks, when the whole device budget holds
    persistent parameters at their compute dtype alone, or device-homed ones at their shard of
    master and moments (``memory_walk.HOMED_BYTES / world_size``), whichever holds more (module
    docstring). With a disk (``nvme``) none: every offloaded chunk's states may go there.
    ``lora``: the base is frozen, its offloaded chunks keep their values only (the compute
    dtype's bytes), whatever the device holds."""
    if nvme:
        return 0
    eb = memory_walk.element_bytes(dtype)
    if lora:
        return max(0, n - budget_bytes // eb.compute) * eb.compute // world_size
    host = eb.host - (eb.compute if dtype != "float32" else 0)  # 16-bit: homeless chunks (12 B)
    on_device = max(
        budget_bytes // eb.compute, budget_bytes * world_size // memory_walk.HOMED_BYTES
    )
    return max(0, n - on_device) * host // world_size


def _probe(
    cfg,
    micro_batch: int,
    *,
    seq_len: int,
    dtype: str,
    spec: HardwareSpec,
    digest: str,
    budget_bytes: int,
    host_budget_bytes: int,
    world_size: int = 1,
    nvme: bool = False,
    lora=None,
) -> Probe:
    from ..hardware.units import human_bytes
    from ..search.planning import make_plan

    t0 = time.perf_counter()
    n = n_params(cfg)
    host_budget = host_budget_bytes
    floor = _host_floor_bytes(n, budget_bytes, dtype, world_size, nvme, lora is not None)
    if floor > host_budget:
        return Probe(
            cfg,
            n,
            micro_batch,
            False,
            f"host memory: needs at least {human_bytes(floor)}, {human_bytes(host_budget)} usable",
            time.perf_counter() - t0,
        )
    profile = _profile(cfg, micro_batch, seq_len, dtype, spec, digest, lora)
    try:
        plan, _ = make_plan(
            profile, budget_bytes, host_budget_bytes=host_budget, world_size=world_size, nvme=nvme
        )
    except HostMemoryError as e:
        return Probe(
            cfg,
            n,
            micro_batch,
            False,
            f"host memory: needs {human_bytes(e.need)}, {human_bytes(e.available)} usable",
            time.perf_counter() - t0,
        )
    except BudgetError:
        return Probe(
            cfg,
            n,
            micro_batch,
            False,
            "device memory: no configuration fits the budget",
            time.perf_counter() - t0,
        )
    return Probe(
        cfg,
        n,
        micro_batch,
        True,
        f"{plan.prediction.iter_time_us / 1e3:.0f} ms/iter",
        time.perf_counter() - t0,
        plan,
    )


# ---------------------------------------------------------------------------- search


def largest_fitting(
    family: str,
    spec: HardwareSpec,
    *,
    budget_bytes: int | None = None,
    seq_len: int = 1024,
    micro_batches: Sequence[int] = MICRO_BATCHES,
    compute_dtype: str = "bfloat16",
    progress: Callable[[Probe], None] | None = None,
    host_memory_bytes: int | None = None,
    world_size: int = 1,
    nvme: bool = False,
    lora=None,
) -> FitResult:
    """The largest rung of ``family``'s ladder that trains on ``world_size`` ``spec``
    devices (ZeRO-3), and the largest of ``micro_batches`` at that size (see the module
    docstring).

    ``budget_bytes`` (per rank) defaults to the spec's usable memory; ``host_memory_bytes``
    (the machine's RAM, shared by the ranks) to ``world_size`` times the spec's
    ``host_memory_bytes`` (a spec's host RAM is one rank's share). Raises
    ``BudgetError`` when not even the smallest rung fits at the smallest micro-batch.
    ``nvme``: plans may put optimizer states on disk (module docstring). ``lora``: a
    ``lora.LoraSpec``: each rung LoRA-trained (its base frozen, values only).
    """
    from ..search.planning import host_budget_per_rank, require_disk

    t0 = time.perf_counter()
    configs = ladder(family, seq_len)
    budget = spec.usable_memory_bytes if budget_bytes is None else budget_bytes
    # A spec's host RAM is one rank's share (``HardwareSpec``), so N ranks' machine has N of them.
    host_memory = (
        spec.host_memory_bytes * world_size if host_memory_bytes is None else host_memory_bytes
    )
    host_budget = host_budget_per_rank(host_memory, world_size)
    if not micro_batches or min(micro_batches) < 1:
        raise ConfigError(
            f"micro-batches must be positive, got {list(micro_batches)}", "e.g. 1 2 4 8 16"
        )
    mbs = sorted(set(micro_batches))
    if nvme:
        require_disk(spec)
    digest = hashlib.sha256(dump_spec(spec)).hexdigest()
    probes: list[Probe] = []

    def probe(cfg: GPT2Config | LlamaConfig, mb: int) -> Probe:
        p = _probe(
            cfg,
            mb,
            seq_len=seq_len,
            dtype=compute_dtype,
            spec=spec,
            digest=digest,
            budget_bytes=budget,
            host_budget_bytes=host_budget,
            world_size=world_size,
            nvme=nvme,
            lora=lora,
        )
        probes.append(p)
        if progress is not None:
            progress(p)
        return p

    # Rungs whose host floor already exceeds the host cost nothing to rule out.
    hi = next(
        (
            i
            for i, c in enumerate(configs)
            if _host_floor_bytes(
                n_params(c), budget, compute_dtype, world_size, nvme, lora is not None
            )
            > host_budget
        ),
        len(configs),
    )
    lo, best, limit = -1, None, "end of the ladder"
    if hi < len(configs):
        limit = _probe(
            configs[hi],
            mbs[0],
            seq_len=seq_len,
            dtype=compute_dtype,
            spec=spec,
            digest=digest,
            budget_bytes=budget,
            host_budget_bytes=host_budget,
            world_size=world_size,
            nvme=nvme,
            lora=lora,
        ).reason
    # Invariant: rung lo fits (or lo = -1), rung hi does not (or hi = len).
    while hi - lo > 1:
        mid = (lo + hi) // 2
        p = probe(configs[mid], mbs[0])
        if p.fits:
            lo, best = mid, p
        else:
            hi, limit = mid, p.reason
    if best is None:
        from ..hardware.units import human_bytes

        raise BudgetError(
            f"not even the smallest {family} ({describe(configs[0])}, "
            f"{n_params(configs[0]) / 1e6:.0f}M parameters) fits {spec.name} with a "
            f"{human_bytes(budget)} budget at micro-batch {mbs[0]} × seq {seq_len}: {limit}",
            "raise --budget or --host-memory, or try a shorter sequence",
        )
    # [Between rungs] The rungs are up to 16% apart. Between the largest that fits and the
    # next, deeper models of its width (every term grows with depth: fitting stays
    # monotone) narrow the answer: bisection over the depths that stay below the next rung.
    config = configs[lo]
    next_config = configs[lo + 1] if lo + 1 < len(configs) else None
    if next_config is not None:
        deeper = [
            dataclasses.replace(config, n_layer=d)
            for d in range(config.n_layer + 1, 2 * config.n_layer)
        ]
        deeper = [c for c in deeper if n_params(c) < n_params(next_config)]
        d_lo, d_hi = -1, len(deeper)
        while d_hi - d_lo > 1:
            mid = (d_lo + d_hi) // 2
            p = probe(deeper[mid], mbs[0])
            if p.fits:
                d_lo, best, config = mid, p, deeper[mid]
            else:
                d_hi, limit = mid, p.reason
        if d_hi < len(deeper):
            next_config = deeper[d_hi]
    # Largest micro-batch at that size: mbs[0] fits; bisect over the rest.
    m_lo, m_hi = 0, len(mbs)
    while m_hi - m_lo > 1:
        mid = (m_lo + m_hi) // 2
        p = probe(config, mbs[mid])
        if p.fits:
            m_lo, best = mid, p
        else:
            m_hi = mid
    plan = best.plan
    assert plan is not None, f"{best=}"
    iter_us = plan.prediction.iter_time_us
    return FitResult(
        family=family,
        hardware=spec.name,
        budget_bytes=budget,
        host_memory_bytes=host_memory,
        seq_len=seq_len,
        compute_dtype=compute_dtype,
        config=config,
        n_params=best.n_params,
        micro_batch=best.micro_batch,
        iter_time_us=iter_us,
        tokens_per_s=world_size * best.micro_batch * seq_len / (iter_us / 1e6) if iter_us else 0.0,
        peak_bytes=plan.prediction.peak_memory_bytes,
        host_bytes=host_need_bytes(plan),
        plan=plan,
        limit=limit,
        probes=probes,
        seconds=time.perf_counter() - t0,
        world_size=world_size,
        host_budget_bytes=host_budget,
        next_config=next_config,
        nvme=nvme,
        disk_bytes=memory_walk.walk(plan).disk_bytes,
    )


# ---------------------------------------------------------------------------- table


def render_fit(results: Sequence[FitResult]) -> str:
    """The ``protrain fit`` table: one row per family, then what stops the next size."""
    from ..hardware.units import human_bytes

    if not results:
        return "no results"
    r0 = results[0]
    ranks = "one device" if r0.world_size == 1 else f"{r0.world_size} ranks (ZeRO-3)"
    lines = [
        (
            f"fit on {r0.hardware}: {human_bytes(r0.budget_bytes)} device budget per rank, "
            f"{human_bytes(r0.host_memory_bytes)} host RAM ({human_bytes(r0.host_budget_bytes)} "
            f"per rank usable), seq {r0.seq_len}, {r0.compute_dtype}, {ranks}"
        )
        + (", optimizer states may go to disk (--nvme)" if r0.nvme else "")
    ]
    head = ("family", "params", "shape", "micro-batch", "iter time", "tokens/s", "peak", "host") + (
        ("disk",) if r0.nvme else ()
    )
    rows = [head]
    for r in results:
        rows.append(
            (
                r.family,
                f"{r.n_params / 1e9:.2f}B",
                describe(r.config),
                str(r.micro_batch),
                f"{r.iter_time_us / 1e6:.2f} s",
                f"{r.tokens_per_s:,.0f}",
                human_bytes(r.peak_bytes),
                human_bytes(r.host_bytes),
            )
            + ((human_bytes(r.disk_bytes),) if r0.nvme else ())
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for k, row in enumerate(rows):
        lines.append(
            "  ".join(
                c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
            ).rstrip()
        )
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    for r in results:
        nxt = (
            f"next size ({n_params(r.next_config) / 1e9:.2f}B) stopped by {r.limit}"
            if r.next_config
            else f"next size: {r.limit}"
        )
        lines.append(
            f"{r.family}: binds {r.binds}; {nxt} ({len(r.probes)} probes, {r.seconds:.0f} s)"
        )
    return "\n".join(lines)


def run_fit(
    hardware: str,
    *,
    budget: str | None = None,
    seq_len: int = 1024,
    families: Sequence[str] = FAMILIES,
    micro_batches: Sequence[int] = MICRO_BATCHES,
    compute_dtype: str = "bfloat16",
    echo: Callable[[str], None] = print,
    host_memory: str | None = None,
    world_size: int = 1,
    nvme: bool = False,
    lora=None,
) -> list[FitResult]:
    """``protrain fit --hardware X [--budget SIZE] [--host-memory SIZE] [--world-size N] [--nvme]``:
    search every family, print the table."""
    from ..hardware.spec import find_spec
    from ..search.planning import parse_budget

    spec = find_spec(hardware)
    budget_bytes = parse_budget(budget) if budget else None
    host_bytes = parse_budget(host_memory) if host_memory else None
    results = []
    for family in families:
        on = spec.name if world_size == 1 else f"{world_size} x {spec.name}"
        echo(
            f"fit      {family}{f' ({lora.describe()})' if lora else ''}: bisecting the ladder on "
            f"{on} …"
        )

        def progress(p: Probe) -> None:
            echo(
                f"         {n_params(p.config) / 1e9:7.2f}B  {describe(p.config):<40} micro-batch "
                f"{p.micro_batch:<3} {'fits' if p.fits else 'no  '}  {p.reason}  ({p.seconds:.1f} "
                "s)"
            )

        results.append(
            largest_fitting(
                family,
                spec,
                budget_bytes=budget_bytes,
                seq_len=seq_len,
                micro_batches=micro_batches,
                compute_dtype=compute_dtype,
                progress=progress,
                host_memory_bytes=host_bytes,
                world_size=world_size,
                nvme=nvme,
                lora=lora,
            )
        )
    echo(render_fit(results))
    return results
