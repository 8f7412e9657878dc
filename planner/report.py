"""Human renderings of plans: ``protrain show`` (and later ``diff`` and ``explain``).

Reads ``Plan`` Structs only; never imports torch, so it runs anywhere a plan file
is reviewed (a laptop, a CI job, a ``git diff`` text converter).
"""

from __future__ import annotations

from protrain.executor.plan import Plan

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
POLICY_LETTER = {"keep": "K", "swap": "S", "checkpoint": "C"}


def policy_strip(plan: Plan) -> str:
    """One letter per block in execution order: ``S C C S C C K K``."""
    return " ".join(POLICY_LETTER[a.policy] for a in plan.activations)


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def human_count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def model_state_bytes(plan: Plan) -> dict[str, int]:
    """Model-state bytes the plan places, by where they live (per rank).

    Device: each persistent chunk holds parameters and gradients in the compute
    dtype plus fp32 master weights and two Adam moments (12 bytes per element);
    each of the ``n_buffer`` buffers holds one offloaded chunk's parameters and
    gradients. Host: each offloaded chunk's compute-dtype home plus its fp32 master
    and moments.
    """
    t = plan.training
    cb = DTYPE_BYTES[t.compute_dtype]
    elems = plan.chunks.chunk_numel // t.world_size
    return {
        "dev_persistent_bytes": plan.placement.n_persist * elems * (2 * cb + 12),
        "dev_buffer_bytes": plan.placement.n_buffer * plan.chunks.chunk_numel * 2 * cb,
        "cpu_offloaded_bytes": len(plan.placement.offloaded) * elems * (cb + 12),
    }


def render_show(plan: Plan, source: str = "") -> str:
    m, t, h, pl = plan.model, plan.training, plan.hardware, plan.placement
    pred = plan.prediction
    lines = [
        f"plan {source}".rstrip(),
        f"  schema        v{plan.schema_version} (written by {plan.generator.name} {plan.generator.version})",
        f"  model         {m.name}: {human_count(m.n_params)} parameters, {len(m.blocks)} blocks",
        f"  fingerprint   {m.fingerprint[:23]}…",
        f"  training      micro-batch {t.micro_batch} × seq {t.seq_len}, {t.compute_dtype} compute, "
        f"{t.master_dtype} master, world size {t.world_size}, grad accum {t.grad_accum}",
        f"  hardware      {h.name or '(not recorded)'}"
        + (f", {human_bytes(h.device_memory_bytes)} device, budget {human_bytes(h.budget_bytes)}"
           if h.device_memory_bytes else ""),
        f"  chunks        {len(plan.chunks.items)} × {human_count(plan.chunks.chunk_numel)} elements",
        f"  placement     {pl.n_persist} persistent {pl.persistent}, {len(pl.offloaded)} offloaded, "
        f"{pl.n_buffer} device buffers",
        f"  activations   {policy_strip(plan)}   (K keep, S swap, C checkpoint)",
        "  model states",
    ]
    for name, value in model_state_bytes(plan).items():
        lines.append(f"    {name:<22} {human_bytes(value)}")
    if pred.iter_time_us or pred.peak_memory_bytes:
        lines.append(f"  predicted     {pred.iter_time_us / 1e6:.3f} s/iteration, "
                     f"peak {human_bytes(pred.peak_memory_bytes)}")
        for name, value in pred.breakdown.items():
            shown = human_bytes(value) if name.endswith("_bytes") else (
                f"{value / 1e6:.3f} s" if name.endswith("_us") else str(value))
            lines.append(f"    {name:<22} {shown}")
    else:
        lines.append("  predicted     (no prediction: plan made without a profile)")
    return "\n".join(lines)


def _cand(c) -> str:
    return (f"n_persist={c.n_persist:<3} n_buffer={c.n_buffer:<2} n_swap={c.n_swap:<3} "
            f"n_checkpoint={c.n_checkpoint:<3} {c.iter_time_us / 1e3:10.1f} ms  "
            f"{human_bytes(c.peak_memory_bytes):>11}")


def render_explain(plan: Plan, source: str = "") -> str:
    """Why this plan: its configuration, what bounds each phase, runners-up, the Pareto front."""
    s = plan.provenance.search
    b = plan.prediction.breakdown
    lines = [f"explain {source}".rstrip(), f"  chosen      {_cand(s.chosen)}   ({s.solver}, "
             f"{s.evaluated} of {s.space_size} configurations evaluated)"]
    if b:
        t_fwd, t_bwd = b.get("t_fwd_us", 0), b.get("t_bwd_us", 0)
        t_cpu, t_gpu = b.get("t_cpu_optim_us", 0), b.get("t_gpu_optim_us", 0)
        bound = "CPU Adam (offloaded chunks' update outlasts backward)" if t_cpu > t_bwd + t_gpu \
            else "backward + device Adam"
        lines += [
            "  time        T_iter = T_fwd + max(T_bwd + T_gpu_optim, T_cpu_optim)   (paper Eq. 2)",
            f"              forward {t_fwd / 1e3:.1f} ms, backward {t_bwd / 1e3:.1f} ms, "
            f"device Adam {t_gpu / 1e3:.1f} ms, CPU Adam {t_cpu / 1e3:.1f} ms",
            f"              the second term is bound by {bound}",
            f"  memory      persistent states {human_bytes(b.get('states_bytes', 0))} + buffers "
            f"{human_bytes(b.get('buffers_bytes', 0))} + activation walk "
            f"{human_bytes(b.get('activation_walk_bytes', 0))} → peak "
            f"{human_bytes(plan.prediction.peak_memory_bytes)} of budget {human_bytes(plan.hardware.budget_bytes)}",
            f"  activations {policy_strip(plan)}",
        ]
    else:
        lines.append("  (no prediction in this plan: it was not made by the search)")
    if s.runners_up:
        lines.append("  runners-up")
        lines += [f"    {_cand(c)}" for c in s.runners_up]
    if s.front:
        lines.append("  Pareto front (less memory ↔ less time)")
        lines += [f"    {_cand(c)}" for c in s.front]
    return "\n".join(lines)
