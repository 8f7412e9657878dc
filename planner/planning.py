"""Profile + budget → Plan: chunk size, search, emission with predictions and provenance.

This is the planner's pipeline end to end (``protrain plan`` and ``make_plan``);
each stage is its own module: ``cost`` (models), ``search`` (choice), ``emit``
(the file). Same profile and budget → same plan bytes.
"""

from __future__ import annotations

import hashlib

from protrain.executor import plan as P
from protrain.executor.errors import BudgetError

from .cost import (
    DTYPE_BYTES,
    block_policies,
    choose_chunk_numel,
    facts_from_profile,
    make_terms,
    min_buffers,
    predict,
)
from .emit import assemble
from .profile import Profile, dump_profile
from .report import human_bytes
from .search import SOLVERS, SearchResult


def profile_digest(profile: Profile) -> str:
    return "sha256:" + hashlib.sha256(dump_profile(profile)).hexdigest()


def make_plan(profile: Profile, budget_bytes: int, *, solver: str = "exhaustive",
              grad_accum: int = 1, world_size: int = 1) -> tuple[P.Plan, SearchResult]:
    """The fastest plan that fits ``budget_bytes`` per the cost model, and the search behind it.

    Raises ``BudgetError`` naming the smallest budget that would fit and the largest
    micro-batch that would fit this budget (activations scale with the batch).
    """
    facts = facts_from_profile(profile)
    chunk_numel, _ = choose_chunk_numel(facts)
    terms = make_terms(profile, chunk_numel, world_size)
    result = SOLVERS[solver](terms, budget_bytes)
    best = result.best
    if best is None:
        smallest = predict(terms, 0, max(1, min_buffers(terms, 0)), 0, terms.n_blocks)
        states = smallest.breakdown["states_bytes"] + smallest.breakdown["buffers_bytes"]
        walk = smallest.breakdown["activation_walk_bytes"]
        b = profile.training.micro_batch
        fit_b = int(b * (budget_bytes - states) / walk) if walk > 0 and budget_bytes > states else 0
        hint = (f"use --budget {human_bytes(int(result.min_peak_bytes * 1.01) + 1)} or more"
                + (f", or a micro-batch of {fit_b} (profile again with --batch {fit_b})" if 0 < fit_b < b else ""))
        raise BudgetError(
            f"no configuration of {profile.model.name} (micro-batch {b} × seq {profile.training.seq_len}) "
            f"fits {human_bytes(budget_bytes)}: the smallest predicted peak is "
            f"{human_bytes(int(result.min_peak_bytes))} (everything offloaded and checkpointed)",
            hint,
        )
    pred = predict(terms, best.n_persist, best.n_buffer, best.n_swap, best.n_checkpoint)
    spec = profile.hardware
    training = P.Training(micro_batch=profile.training.micro_batch, seq_len=profile.training.seq_len,
                          compute_dtype=profile.training.compute_dtype, master_dtype="float32",
                          world_size=world_size, grad_accum=grad_accum)
    plan = assemble(
        facts, training=training, chunk_numel=chunk_numel,
        persistent=list(range(best.n_persist)), n_buffer=best.n_buffer,
        policies=block_policies(terms.n_blocks, best.n_swap, best.n_checkpoint),
        request=P.Request(model=profile.model.name, hardware=spec.name, budget_bytes=budget_bytes,
                          micro_batch=training.micro_batch, seq_len=training.seq_len,
                          compute_dtype=training.compute_dtype, world_size=world_size,
                          grad_accum=grad_accum),
        hardware=P.Hardware(name=spec.name, device_memory_bytes=spec.device_memory_bytes,
                            budget_bytes=budget_bytes,
                            h2d_bytes_per_s=spec.link[-1].h2d_bytes_per_s,
                            d2h_bytes_per_s=spec.link[-1].d2h_bytes_per_s,
                            cpu_adam_params_per_s=spec.cpu_adam_params_per_s,
                            dev_adam_params_per_s=spec.dev_adam_params_per_s),
        prediction=P.Prediction(
            iter_time_us=round(pred.time_us * grad_accum),
            peak_memory_bytes=round(pred.peak_bytes),
            breakdown={k: round(v) for k, v in pred.breakdown.items()},
        ),
        provenance=P.Provenance(
            profile_digest=profile_digest(profile),
            search=P.Search(space_size=result.space_size, evaluated=result.evaluated,
                            time_us=0, solver=result.solver, chosen=candidate(best),
                            runners_up=[candidate(c) for c in result.runners_up],
                            front=[candidate(c) for c in thin(result.front, 24)]),
        ),
    )
    return plan, result


def candidate(c) -> P.Candidate:
    return P.Candidate(n_persist=c.n_persist, n_buffer=c.n_buffer, n_swap=c.n_swap,
                       n_checkpoint=c.n_checkpoint, iter_time_us=round(c.time_us),
                       peak_memory_bytes=round(c.peak_bytes))


def thin(points: list, k: int) -> list:
    """At most ``k`` points, evenly spaced, ends included."""
    if len(points) <= k:
        return points
    return [points[round(i * (len(points) - 1) / (k - 1))] for i in range(k)]


def parse_budget(text: str) -> int:
    """``20GiB``, ``24GB``, ``512MiB``, ``1.5e9`` → bytes. Raises ``ConfigError`` with the accepted forms."""
    from protrain.executor.errors import ConfigError

    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0 or not num:
        raise ConfigError(f"cannot read the budget {text!r}",
                          "write a positive number with an optional unit: 20GiB, 24GB, 512MiB, 1.5e9")
    return int(value * units[unit])


__all__ = ["make_plan", "parse_budget", "profile_digest", "DTYPE_BYTES"]
