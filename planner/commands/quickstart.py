"""``protrain quickstart``: profile → plan → train a small model on the device at hand.

Every stage is the real one: the profiler measures the model on this device, the
search picks the fastest plan under a budget, the executor replays it. The
default budget is 60% of the predicted peak of the fastest plan the device's whole
usable memory allows (a figure of this machine's profile, so it moves with its
measured times), so the plan has to give up memory for time, offloading, swapping or
recomputing, and the run shows the planner at work; ``--budget`` sets it explicitly.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from protrain.plans import plan as P

from ..hardware.units import human_bytes
from ..profiling.profile import dump_profile
from ..search.planning import make_plan, parse_budget
from ..views.show import render_explain, render_show
from .profile_plan import build_profile
from .train import train

MICRO_BATCH, SEQ_LEN = 4, 64


def run(
    *,
    model_name: str,
    steps: int,
    data_path: str | None,
    out_dir: str,
    budget: str | None,
    seed: int,
    echo: Callable[[str], None] = print,
) -> list[float]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    echo(f"[1/3] profile {model_name} on {device}")
    profile = build_profile(
        model_name=model_name,
        batch=MICRO_BATCH,
        seq=SEQ_LEN,
        dtype=None,
        device=device,
        analytic=False,
        hardware=None,
        iterations=3,
        echo=echo,
    )
    profile_path = out / f"{model_name}.profile.json"
    profile_path.write_bytes(dump_profile(profile))
    echo(f"        wrote {profile_path}")

    if budget is None:
        roomy, _ = make_plan(profile, profile.hardware.usable_memory_bytes)
        budget_bytes = int(0.6 * roomy.prediction.peak_memory_bytes)
        echo(
            f"[2/3] plan    budget {human_bytes(budget_bytes)} (60% of "
            f"{human_bytes(roomy.prediction.peak_memory_bytes)}, the predicted peak of the fastest "
            "plan with all of the device's usable memory: it moves with this machine's measured "
            "times)"
        )
    else:
        budget_bytes = parse_budget(budget)
        echo(f"[2/3] plan    budget {human_bytes(budget_bytes)}")
    plan, _ = make_plan(profile, budget_bytes)
    plan_path = out / f"{model_name}.plan.json"
    plan_path.write_bytes(P.dump(plan))
    echo(f"        wrote {plan_path}")
    echo(render_show(plan, str(plan_path)))
    echo(render_explain(plan, str(plan_path)))

    echo(f"[3/3] train   {steps} steps with the executor replaying the plan")
    return train(
        str(plan_path),
        model_name,
        steps=steps,
        data_path=data_path,
        seed=seed,
        device=device,
        echo=echo,
        progress=False,
    )
