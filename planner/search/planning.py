"""Profile + budget → Plan: chunk size, search, emission with predictions and provenance.

This is the planner's pipeline end to end (``protrain plan`` and ``make_plan``);
each stage is its own module: ``cost`` (models), ``search`` (choice), ``emit``
(the file). Same profile and budget → same plan bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

from protrain.plans import plan as P
from protrain.plans.errors import BudgetError, ConfigError, HostMemoryError

from ..hardware.spec import (  # noqa: F401  (re-exported: the host budget)
    HOST_RESERVE_BYTES,
    HOST_RESERVE_FRACTION,
    HardwareSpec,
    default_host_budget,
    host_budget_per_rank,
)
from ..hardware.units import human_bytes
from ..profiling.profile import Profile, dump_profile
from .cost import (
    DTYPE_BYTES,
    Terms,
    chunk_candidates,
    facts_from_profile,
    make_terms,
    min_buffers,
    predict,
    predict_plan,
)
from .emit import assemble, cpu_adam_schedule
from .exhaustive import DEFAULT_SOLVER, SearchResult, Solver, exhaustive


def _milp(terms, budget_bytes: int, host_budget_bytes: float | None = None) -> SearchResult:
    """The MILP solver (milp.py), imported on first use (scipy.optimize.milp)."""
    from .milp import solve

    if (
        terms.trainable is not None
    ):  # the MILP charges every chunk as trainable: the exhaustive search's plan
        result = exhaustive(terms, budget_bytes, host_budget_bytes)
        return dataclasses.replace(
            result,
            warnings=[
                *result.warnings,
                "the MILP solver does not model frozen "
                "parameters (LoRA) yet: this is the exhaustive search's plan",
            ],
        )
    return solve(terms, budget_bytes, host_budget_bytes)


SOLVERS: dict[str, Solver] = {"exhaustive": exhaustive, "milp": _milp}
"""The searches ``make_plan`` can run, by name (``--solver``)."""


def profile_digest(profile: Profile) -> str:
    return "sha256:" + hashlib.sha256(dump_profile(profile)).hexdigest()


def require_disk(spec) -> None:
    """Refuse ``--nvme`` with a spec whose disk was not measured (the cost model charges the
    disk's traffic at its bandwidth: planner/search/host_tiers.py [NVMe tier])."""
    if not (spec.disk_read_bytes_per_s and spec.disk_write_bytes_per_s):
        raise ConfigError(
            f"--nvme: the hardware spec {spec.name!r} has no disk bandwidth measured "
            "(disk_read_bytes_per_s / disk_write_bytes_per_s are 0)",
            "measure the disk the states will go to with `protrain hardware probe --nvme DIR -o "
            "SPEC`, then `protrain plan --hardware SPEC --nvme …` (or `protrain fit --hardware "
            "SPEC --nvme`)",
        )


def make_plan(
    profile: Profile,
    budget_bytes: int,
    *,
    solver: str = DEFAULT_SOLVER,
    grad_accum: int = 1,
    world_size: int = 1,
    host_budget_bytes: int | None = None,
    max_grad_norm: float | None = None,
    nvme: bool = False,
) -> tuple[P.Plan, SearchResult]:
    """The fastest plan that fits ``budget_bytes`` of device memory and ``host_budget_bytes``
    of host memory per rank (default: ``default_host_budget`` of the profile's hardware)
    per the cost model, and the search behind it, over the chunk sizes of
    ``layout.chunk_candidates`` (``search_chunk_sizes``). ``solver``: a key of
    ``search.SOLVERS``; a solver other than ``exhaustive`` runs at the size the
    exhaustive search chose.
    ``max_grad_norm``: the training will clip gradients, so the plan's CPU AdamW steps
    run after backward (``emit.cpu_adam_schedule``) and are predicted that way.
    ``nvme``: chunks' optimizer states may go to a disk where host memory binds
    (planner/search/host_tiers.py [NVMe tier]); the spec must carry the disk's measured bandwidth.

    Raises ``BudgetError`` naming the smallest budget that would fit and the largest
    micro-batch that would fit this budget (activations scale with the batch), or, when
    configurations fit the device but none the host, the host memory needed and available.
    """

    if solver not in SOLVERS:
        raise ConfigError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    if max_grad_norm is not None and not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
        raise ConfigError(
            f"--max-grad-norm must be a positive number, got {max_grad_norm}",
            "pass the global gradient norm to clip to, e.g. --max-grad-norm 1.0",
        )
    cpu_adam = cpu_adam_schedule(profile.training.compute_dtype, max_grad_norm)
    spec = profile.hardware
    if nvme:
        require_disk(spec)
    host_budget = (
        default_host_budget(profile.hardware) if host_budget_bytes is None else host_budget_bytes
    )
    facts = facts_from_profile(profile)
    chunk_numel, terms, result = search_chunk_sizes(
        profile, facts, budget_bytes, host_budget, world_size, cpu_adam, grad_accum, nvme
    )
    if solver != "exhaustive":  # another solver refines the configuration at that size
        result = SOLVERS[solver](terms, budget_bytes, host_budget)
    best = result.best
    if best is None and result.min_host_bytes < float("inf"):
        raise host_error(
            profile, result, budget_bytes, host_budget, world_size, host_budget_bytes is None
        )
    if best is None:
        smallest = predict(terms, 0, max(1, min_buffers(terms, 0)), 0, terms.n_blocks)
        states = smallest.breakdown["states_bytes"] + smallest.breakdown["buffers_bytes"]
        walk = smallest.breakdown["activation_walk_bytes"]
        b = profile.training.micro_batch
        fit_b = int(b * (budget_bytes - states) / walk) if walk > 0 and budget_bytes > states else 0
        hint = f"use --budget {human_bytes(int(result.min_peak_bytes * 1.01) + 1)} or more" + (
            f", or a micro-batch of {fit_b} (profile again with --batch {fit_b})"
            if 0 < fit_b < b
            else ""
        )
        raise BudgetError(
            f"no configuration of {profile.model.name} (micro-batch {b} × seq "
            f"{profile.training.seq_len}) fits {human_bytes(budget_bytes)}: the smallest predicted "
            f"peak is {human_bytes(int(result.min_peak_bytes))} (everything offloaded and "
            "checkpointed)",
            hint,
        )
    persistent, policies = best.persistent_ids(), best.strip(terms.n_blocks)
    homeless = best.homeless_ids(terms.n_chunks, terms.trainable)  # [Homeless chunks] in cost.py
    homed = best.homed_ids(terms.n_chunks, terms.trainable)  # [Device homes] in host_tiers.py
    on_disk = best.nvme_ids(terms.n_chunks, terms.trainable)  # [NVMe tier] in host_tiers.py
    pred = predict_plan(terms, persistent, best.n_buffer, policies, homeless, homed, on_disk)
    training = P.Training(
        micro_batch=profile.training.micro_batch,
        seq_len=profile.training.seq_len,
        compute_dtype=profile.training.compute_dtype,
        master_dtype="float32",
        world_size=world_size,
        grad_accum=grad_accum,
    )
    plan = assemble(
        facts,
        training=training,
        chunk_numel=chunk_numel,
        persistent=persistent,
        n_buffer=best.n_buffer,
        policies=policies,
        cpu_adam=cpu_adam,
        shard_persistent_states=terms.shard_persistent,
        homeless=homeless,
        device_homed=homed,
        nvme=on_disk,
        request=P.Request(
            model=profile.model.name,
            hardware=spec.name,
            budget_bytes=budget_bytes,
            micro_batch=training.micro_batch,
            seq_len=training.seq_len,
            compute_dtype=training.compute_dtype,
            world_size=world_size,
            grad_accum=grad_accum,
            max_grad_norm=max_grad_norm,
        ),
        hardware=P.Hardware(
            name=spec.name,
            device_memory_bytes=spec.device_memory_bytes,
            budget_bytes=budget_bytes,
            h2d_bytes_per_s=spec.link[-1].h2d_bytes_per_s,
            d2h_bytes_per_s=spec.link[-1].d2h_bytes_per_s,
            cpu_adam_params_per_s=spec.cpu_adam_params_per_s,
            dev_adam_params_per_s=spec.dev_adam_params_per_s,
        ),
        prediction=P.Prediction(
            iter_time_us=round(pred.time_us * grad_accum),
            peak_memory_bytes=round(pred.peak_bytes),
            # (without the search's own figures of what device homes moved: cost.py [Device homes])
            breakdown={
                k: round(v)
                for k, v in pred.breakdown.items()
                if k not in ("homed_peak_bytes", "unhomed_host_bytes")
            },
        ),
        provenance=P.Provenance(
            profile_digest=profile_digest(profile),
            search=P.Search(
                space_size=result.space_size,
                evaluated=result.evaluated,
                time_us=0,
                solver=result.solver,
                chosen=candidate(best),
                runners_up=[candidate(c) for c in result.runners_up],
                front=[candidate(c) for c in thin(result.front, 24)],
            ),
        ),
    )
    return plan, result


def search_chunk_sizes(
    profile: Profile,
    facts,
    budget_bytes: int,
    host_budget: int,
    world_size: int,
    cpu_adam: str,
    grad_accum: int,
    nvme: bool = False,
) -> tuple[int, Terms, SearchResult]:
    """Run the exhaustive search at every size of ``layout.chunk_candidates`` and keep the
    best plan by the search's own order (``Choice.key``; ties to the smaller chunk).

    When nothing fits at any size, the size whose search came closest: the least host
    need among configurations that fit the device if any does (a host refusal), else
    the least device peak. The returned result counts the space and the evaluations of
    every size searched."""
    sizes, _ = chunk_candidates(facts)
    runs = []
    for size in sizes:
        # Persistent chunks' optimizer states are sharded whenever there are ranks to shard
        # over: less device memory and device Adam time for the same traffic (make_terms).
        terms = make_terms(
            profile,
            size,
            world_size,
            cpu_adam,
            grad_accum,
            shard_persistent=world_size > 1,
            nvme=nvme,
            facts=facts,
        )
        runs.append((size, terms, SOLVERS["exhaustive"](terms, budget_bytes, host_budget)))
    fitting = [r for r in runs if r[2].best is not None]
    if fitting:
        chosen = min(
            fitting, key=lambda r: r[2].best.key()
        )  # min keeps the first (smaller) on ties
    else:
        chosen = min(runs, key=lambda r: (r[2].min_host_bytes, r[2].min_peak_bytes))
    size, terms, result = chosen
    result.space_size = sum(r[2].space_size for r in runs)
    result.evaluated = sum(r[2].evaluated for r in runs)
    return size, terms, result


def host_error(
    profile: Profile,
    result: SearchResult,
    budget_bytes: int,
    host_budget: int,
    world_size: int,
    default: bool,
) -> HostMemoryError:
    """Configurations fit the device but none the host: say how much host memory the least
    hungry one needs, how much there is, and the ways out."""
    spec = profile.hardware
    need = int(result.min_host_bytes)
    per_rank = " per rank" if world_size > 1 else ""
    avail = (
        (
            f"{human_bytes(host_budget)} available ({human_bytes(spec.host_memory_bytes)} host RAM "
            f"of {spec.name} less the {HOST_RESERVE_FRACTION:.0%} + "
            f"{human_bytes(HOST_RESERVE_BYTES)} reserve)"
        )
        if default
        else f"{human_bytes(host_budget)} available (the host budget given)"
    )
    more_ranks = -(-need * world_size // max(host_budget, 1))  # chunk states shard over ranks
    return HostMemoryError(
        f"host memory: no configuration of {profile.model.name} within the "
        f"{human_bytes(budget_bytes)} device budget fits the host: the least host memory any needs "
        f"is {human_bytes(need)}{per_rank} (offloaded chunk states + swapped activations), {avail}",
        "keep more chunks persistent with a larger --budget (a bigger card), swap fewer blocks, "
        "shard the offloaded states over more ranks (about --world-size "
        f"{max(more_ranks, world_size + 1)}), or use a machine with more RAM (--host-memory)",
        need=need,
        available=host_budget,
    )


def candidate(c) -> P.Candidate:
    return P.Candidate(
        n_persist=c.n_persist,
        n_buffer=c.n_buffer,
        n_swap=c.n_swap,
        n_checkpoint=c.n_checkpoint,
        iter_time_us=round(c.time_us),
        peak_memory_bytes=round(c.peak_bytes),
    )


def thin(points: list, k: int) -> list:
    """At most ``k`` points, evenly spaced, ends included."""
    if len(points) <= k:
        return points
    return [points[round(i * (len(points) - 1) / (k - 1))] for i in range(k)]


def parse_budget(text: str) -> int:
    """``20GiB``, ``24GB``, ``512MiB``, ``1.5e9`` → bytes. Raises ``ConfigError`` with the
    accepted forms."""
    units = {
        "": 1,
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0 or not num:
        raise ConfigError(
            f"cannot read the budget {text!r}",
            "write a positive number with an optional unit: 20GiB, 24GB, 512MiB, 1.5e9",
        )
    return int(value * units[unit])


__all__ = [
    "make_plan",
    "parse_budget",
    "profile_digest",
    "default_host_budget",
    "host_budget_per_rank",
    "DTYPE_BYTES",
]
