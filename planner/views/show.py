"""Human renderings of plans: ``protrain show`` and ``explain`` (``diff``: planner/views/diff.py).

Reads ``Plan`` Structs only; never imports torch, so it runs anywhere a plan file
is reviewed (a laptop, a CI job, a ``git diff`` text converter).
"""

from __future__ import annotations

from protrain.plans.homes import CHECKPOINT, POLICIES, SWAP
from protrain.plans.plan import Plan

from ..hardware.units import human_bytes, human_count
from ..search import memory_walk
from ..search.departures import Departure, departures_from, is_four_count
from ..search.policy_layout import block_policies  # noqa: F401  (explain rebuilds strips)


def policy_strip(plan: Plan) -> str:
    """One letter per block in execution order: ``S C C S C C K K``."""
    return " ".join(POLICIES[a.policy].letter for a in plan.activations)


def render_show(plan: Plan, source: str = "") -> str:
    m, t, h, pl = plan.model, plan.training, plan.hardware, plan.placement
    pred = plan.prediction
    lines = [
        f"plan {source}".rstrip(),
        f"  schema        v{plan.schema_version} (written by {plan.generator.name} "
        f"{plan.generator.version})",
        f"  model         {m.name}: {human_count(m.n_params)} parameters, {len(m.blocks)} blocks",
        f"  fingerprint   {m.fingerprint[:23]}…",
        f"  training      micro-batch {t.micro_batch} × seq {t.seq_len}, {t.compute_dtype} "
        f"compute, {t.master_dtype} master, world size {t.world_size}, grad accum {t.grad_accum}",
        f"  hardware      {h.name or '(not recorded)'}"
        + (
            f", {human_bytes(h.device_memory_bytes)} device, budget {human_bytes(h.budget_bytes)}"
            if h.device_memory_bytes
            else ""
        ),
        f"  chunks        {len(plan.chunks.items)} × {human_count(plan.chunks.chunk_numel)} "
        "elements",
        (
            f"  placement     {pl.n_persist} persistent {pl.persistent}, {len(pl.offloaded)} "
            f"offloaded, {pl.n_buffer} device buffers"
        )
        + (
            f"; persistent optimizer states sharded over {t.world_size} ranks"
            if pl.shard_persistent_states
            else ""
        )
        + (f"; {len(pl.homeless)} homeless (no home on the host)" if pl.homeless else "")
        + (
            f"; {len(pl.device_homed)} device-homed (master and moments on the device)"
            if pl.device_homed
            else ""
        )
        + (
            f"; {len(pl.nvme)} on disk (master and moments in a file: train with --nvme DIR)"
            if pl.nvme
            else ""
        ),
        f"  activations   {policy_strip(plan)}   (K keep, S swap, C checkpoint)",
        f"  cpu adam      {plan.schedule.cpu_adam.replace('_', ' ')}"
        + (
            f" (clipping to {plan.request.max_grad_norm:g} requested)"
            if plan.request.max_grad_norm
            else ""
        ),
        "  model states  (per rank: persistent chunks and offloaded buffers on the device, "
        "offloaded states on the host)",
    ]
    walk = memory_walk.walk(plan)  # per rank; the same figures the prediction holds
    for name, value in (
        ("states_bytes", walk.states_bytes),
        ("buffers_bytes", walk.buffers_bytes),
        ("host_bytes", walk.host_bytes),
    ):
        lines.append(f"    {name:<22} {human_bytes(value)}")
    if pred.iter_time_us or pred.peak_memory_bytes:
        lines.append(
            f"  predicted     {pred.iter_time_us / 1e6:.3f} s/iteration, "
            f"peak {human_bytes(pred.peak_memory_bytes)}"
        )
        for name, value in pred.breakdown.items():
            shown = (
                human_bytes(value)
                if name.endswith("_bytes")
                else (f"{value / 1e6:.3f} s" if name.endswith("_us") else str(value))
            )
            name = name.removesuffix(
                "_us"
            )  # shown in seconds: a name in µs would misread the value
            lines.append(f"    {name:<22} {shown}")
    else:
        lines.append("  predicted     (no prediction: plan made without a profile)")
    return "\n".join(lines)


def _cand(c) -> str:
    return (
        f"n_persist={c.n_persist:<3} n_buffer={c.n_buffer:<2} n_swap={c.n_swap:<3} "
        f"n_checkpoint={c.n_checkpoint:<3} {c.iter_time_us / 1e3:10.1f} ms  "
        f"{human_bytes(c.peak_memory_bytes):>11}"
    )


def render_explain(plan: Plan, source: str = "", departures: list[Departure] | None = None) -> str:
    """Why this plan: its configuration, what bounds each phase, where it departs from the
    best four-count plan (a MILP plan), runners-up, the Pareto front.

    ``departures``: what the cost model says each departure buys (``milp.explain_departures``,
    which needs the profile); without them the departures are listed without prices.
    """
    s = plan.provenance.search
    b = plan.prediction.breakdown
    lines = [
        f"explain {source}".rstrip(),
        f"  chosen      {_cand(s.chosen)}   ({s.solver}, "
        f"{s.evaluated} of {s.space_size} configurations evaluated)",
    ]
    if b:
        lines.append("  in plain words (the paper's terms in brackets)")
        lines += [f"    - {x}" for x in plain_decisions(plan)]
    lines += _render_departures(plan, departures)
    if b:
        t_fwd, t_bwd = b.get("t_fwd_us", 0), b.get("t_bwd_us", 0)
        t_cpu, t_gpu = b.get("t_cpu_optim_us", 0), b.get("t_gpu_optim_us", 0)
        if plan.schedule.cpu_adam == "after_backward":
            formula = (
                "T_iter = T_fwd + T_bwd + max(T_gpu_optim, T_cpu_optim)   "
                "(CPU Adam after backward: clipping or fp16)"
            )
            bound = "CPU Adam" if t_cpu > t_gpu else "device Adam"
        else:
            formula = "T_iter = T_fwd + max(T_bwd + T_gpu_optim, T_cpu_optim)   (paper Eq. 2)"
            bound = (
                "CPU Adam (offloaded chunks' update outlasts backward)"
                if t_cpu > t_bwd + t_gpu
                else "backward + device Adam"
            )
        lines += [
            f"  time        {formula}",
            f"              forward {t_fwd / 1e3:.1f} ms, backward {t_bwd / 1e3:.1f} ms, "
            f"device Adam {t_gpu / 1e3:.1f} ms, CPU Adam {t_cpu / 1e3:.1f} ms",
            f"              the max is bound by {bound}",
            f"  memory      persistent states {human_bytes(b.get('states_bytes', 0))} + buffers "
            f"{human_bytes(b.get('buffers_bytes', 0))} + activation walk "
            f"{human_bytes(b.get('activation_walk_bytes', 0))} → peak "
            f"{human_bytes(plan.prediction.peak_memory_bytes)} of budget "
            f"{human_bytes(plan.hardware.budget_bytes)}",
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


def _duration(us: float) -> str:
    return f"{us / 1e3:.1f} ms" if us < 1e6 else f"{us / 1e6:.2f} s"


def plain_decisions(plan: Plan) -> list[str]:
    """One sentence per decision of the plan in plain words, the paper's symbols after it:
    where the chunks live, what the blocks do with their activations, what sets the time."""
    b = plan.prediction.breakdown
    t = plan.training
    n = len(plan.chunks.items)
    n_persist, n_buffer = plan.placement.n_persist, plan.placement.n_buffer
    budget, peak = plan.hardware.budget_bytes, plan.prediction.peak_memory_bytes
    off = n - n_persist
    if off == 0:
        chunks = (
            f"All {n} chunk{'s' * (n != 1)} of parameters stay on the device with their "
            f"gradients and optimizer state ({human_bytes(b.get('states_bytes', 0))}), because "
            f"they fit the {human_bytes(budget)} budget next to the activations "
            f"[n_persist = {n}, n_buffer = 0]."
        )
    else:
        one_more = (
            plan.chunks.chunk_numel
            * memory_walk.element_bytes(t.compute_dtype, t.grad_accum).persistent
        )
        why = (
            f"keeping one more there would add about {human_bytes(one_more)} to the "
            f"{human_bytes(peak)} peak, over the {human_bytes(budget)} budget"
            if peak + one_more > budget
            else "keeping more there would not make an iteration faster under this budget"
        )
        disk = len(plan.placement.nvme)
        chunks = (
            f"{off} of {n} chunks of parameters live in host memory"
            + (f" ({disk} of them with their optimizer state on disk)" if disk else "")
            + f", where the CPU updates them, and visit the device {n_buffer} at a time; "
            f"{n_persist} {'stays' if n_persist == 1 else 'stay'} on the device, because {why} "
            f"[n_persist = {n_persist}, n_buffer = {n_buffer}]."
        )
    policies = [a.policy for a in plan.activations]
    n_blocks, n_swap, n_ckpt = (
        len(policies),
        policies.count(SWAP.name),
        policies.count(CHECKPOINT.name),
    )
    n_keep = n_blocks - n_swap - n_ckpt
    if n_swap == n_ckpt == 0:
        acts = (
            f"All {n_blocks} blocks keep their activations on the device for backward: there "
            "is room for them, so nothing is recomputed or copied [n_swap = 0, n_checkpoint = 0]."
        )
    else:

        def verb(k: int, one: str, many: str) -> str:
            return f"{k} {one if k == 1 else many}"

        parts = [
            verb(n_ckpt, "recomputes its", "recompute their") + " activations in backward"
            if n_ckpt
            else "",
            verb(n_swap, "copies its", "copy their") + " activations to host memory and back"
            if n_swap
            else "",
            verb(n_keep, "keeps its", "keep their") + " activations" if n_keep else "",
        ]
        acts = (
            f"Of {n_blocks} blocks, {', '.join(x for x in parts if x)}: device memory left for "
            "the model states, paid for in recomputation or copies "
            f"[n_checkpoint = {n_ckpt}, n_swap = {n_swap}]."
        )
    t_fwd, t_bwd = b.get("t_fwd_us", 0) / 1e3, b.get("t_bwd_us", 0) / 1e3
    t_cpu, t_gpu = b.get("t_cpu_optim_us", 0) / 1e3, b.get("t_gpu_optim_us", 0) / 1e3
    head = (
        f"An iteration is predicted to take {_duration(plan.prediction.iter_time_us)}: "
        f"forward {t_fwd:.1f} ms, backward {t_bwd:.1f} ms"
    )
    if off == 0 or t_cpu == 0:
        time = f"{head}, and the optimizer step on the device {t_gpu:.1f} ms [T_iter, Eq. 2]."
    elif plan.schedule.cpu_adam == "after_backward":
        time = (
            f"{head}; the CPU's update of the host chunks ({t_cpu:.1f} ms) waits until backward "
            "is done, because clipping or fp16 loss scaling needs every gradient first "
            "[cpu_adam = after_backward]."
        )
    elif t_cpu > t_bwd + t_gpu:
        time = (
            f"{head}; the CPU's update of the host chunks ({t_cpu:.1f} ms) runs during "
            "backward and outlasts it, so the CPU sets the pace [T_cpu_optim, Eq. 2]."
        )
    else:
        time = (
            f"{head}; the CPU's update of the host chunks ({t_cpu:.1f} ms) runs during "
            "backward and is hidden behind it [T_cpu_optim, Eq. 2]."
        )
    return [chunks, acts, time]


def _render_departures(plan: Plan, priced: list[Departure] | None) -> list[str]:
    """The MILP plan against the best four-count plan, which the search records as the
    first runner-up whenever its plan leaves the paper's space."""
    s = plan.provenance.search
    if is_four_count(plan) or not s.runners_up:
        return []
    base = s.runners_up[0]
    n_blocks = len(plan.activations)
    strip = [a.policy for a in plan.activations]
    deps = (
        priced
        if priced is not None
        else departures_from(
            len(plan.chunks.items),
            list(plan.placement.persistent),
            plan.placement.n_buffer,
            strip,
            base.n_persist,
            base.n_buffer,
            block_policies(n_blocks, base.n_swap, base.n_checkpoint),
        )
    )
    gain = base.iter_time_us - s.chosen.iter_time_us
    lines = [
        f"  four-count  {_cand(base)}   (the best plan of the paper's space: a persistent prefix, "
        "S C C … K K)",
        f"              this plan is {gain / 1e3:.1f} ms/iteration faster "
        f"({100 * gain / max(base.iter_time_us, 1):.2f}%), peak "
        f"{human_bytes(abs(s.chosen.peak_memory_bytes - base.peak_memory_bytes))} "
        f"{'more' if s.chosen.peak_memory_bytes >= base.peak_memory_bytes else 'less'}; "
        f"{len(deps)} departure{'s' * (len(deps) != 1)}"
        + (
            ", each priced by undoing it alone (time, peak it saves):"
            if priced is not None
            else " (pass --profile to price each):"
        ),
    ]
    blocks = plan.model.blocks
    for d in deps:
        price = ""
        if d.buys_us is not None:
            price = (
                f"   {d.buys_us / 1e3:+.1f} ms, {'+' if (d.buys_bytes or 0) >= 0 else '-'}"
                f"{human_bytes(abs(int(d.buys_bytes or 0)))}" + (f"  ({d.note})" if d.note else "")
            )
        lines.append(f"    {d.label(blocks)}{price}")
    return lines
