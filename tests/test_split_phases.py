"""The engine's split phases ([Note: split phases] in executor/engine.py): the wrapped model's own
forward, the loss's ``backward()`` and ``Engine.finish_step`` train exactly as ``engine.step``
does, bit for bit, under persistent and offloaded plans with swap and checkpoint blocks; a step
with the wrong number of backwards, a forward before the previous backward, and a gradient norm
under an overlapped plan are refused by name."""

from __future__ import annotations

import pytest
import torch
from harness import make_model, make_plan

from protrain.executor import AdamWConfig, wrap
from protrain.planner.models.data import batches, load_tokens
from protrain.plans.errors import ConfigError

PLANS = {
    "persistent": dict(persistent="all", n_buffer=0, policies="keep"),
    "offloaded swap/checkpoint": dict(
        persistent=[0], n_buffer=2, policies="swap checkpoint keep swap"
    ),
}


def _train(plan, split: bool, config: AdamWConfig, steps: int = 3):
    model = make_model("gpt2-4")
    engine = wrap(model, plan, config, device="cpu")
    data, k = batches(load_tokens(), 4, 32, 0), plan.training.grad_accum
    torch.manual_seed(1234)
    losses, norms = [], []
    try:
        for _ in range(steps):
            mbs = [next(data) for _ in range(k)]
            if not split:
                res = engine.step(mbs)
                losses.append(res.loss)
                norms.append(res.grad_norm)
                continue
            micro = []
            for x, y in mbs:
                loss = model(x, y)
                (loss if k == 1 else loss / k).backward()
                micro.append(loss.detach())
            norms.append(engine.grad_norm().item() if config.max_grad_norm is not None else None)
            engine.finish_step()
            losses.append(torch.stack(micro).float().mean().item())
        return losses, norms, engine.state_dict()
    finally:
        engine.close()


@pytest.mark.parametrize("kind", PLANS)
@pytest.mark.parametrize("clip", [None, 0.5])
def test_split_phases_train_as_step(kind, clip):
    cpu_adam = "after_backward" if clip else None
    plan = make_plan("gpt2-4", grad_accum=2, cpu_adam=cpu_adam, **PLANS[kind])
    config = AdamWConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=clip)
    ref, ours = _train(plan, False, config), _train(plan, True, config)
    assert ours[0] == ref[0] and ours[1] == ref[1]
    for part in ("model", "optim"):
        torch.testing.assert_close(ours[2][part], ref[2][part], rtol=0, atol=0)


def test_split_phases_refusals():
    plan = make_plan("gpt2-4", grad_accum=2, **PLANS["offloaded swap/checkpoint"])
    model = make_model("gpt2-4")
    engine = wrap(model, plan, AdamWConfig(), device="cpu")
    data = batches(load_tokens(), 4, 32, 0)
    try:
        x, y = next(data)
        model(x, y).backward()
        with pytest.raises(ConfigError, match=r"after 1 backward passes.*grad_accum"):
            engine.finish_step()
        with pytest.raises(ConfigError, match="overlaps CPU AdamW steps"):
            model(x, y).backward()
            engine.grad_norm()
        with pytest.raises(ConfigError, match=r"micro-batch 3 while 2 micro-batches await"):
            model(x, y)
        engine.finish_step()
        model(x, y)
        with pytest.raises(ConfigError, match="previous micro-batch's backward has not run"):
            model(x, y)
        with pytest.raises(ConfigError, match=r"idx of shape \(4, 16\)"):
            engine._pending = None
            model(x[:, :16], y[:, :16])
    finally:
        engine._pending = None
        engine.close()
