"""Stream ordering on an adversarial CPU: parity under the asynchronous emulation, and delays.

Under ``tools/emulation.py`` every host↔device copy (and the ZeRO-3 all-gather
queued behind it) completes later, on a worker thread, after a random delay; its
destination reads NaN until then; freeing memory an unfinished copy uses raises.
A missing wait, record or release guard therefore fails these tests on a CPU box,
as it would corrupt data on a GPU ([Note: asynchronous CPU emulation]).

- fp32: losses, parameters and AdamW moments equal plain PyTorch, bit for bit;
- 16-bit and grad accumulation: the asynchronous run equals the synchronous run of
  the same plan bit for bit (same arithmetic, only the copies' timing differs);
- world size 2: the same, over gloo, in subprocesses (tests/test_dist.py's workers).

Listeners that sleep (``harness.sleeper`` on ``Engine.on_event``) still slow the CPU
AdamW worker, whose waits (fetch after the step, home written after the last upload)
the emulation does not time.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from harness import assert_same_state, lockstep, make_model, make_plan, sleeper
from test_parity import MATRIX, _plan  # the same policy matrix, here under the emulation

from protrain.executor import AdamWConfig, wrap
from protrain.planner.models.data import batches, load_tokens
from tools.emulation import AsyncHazard, emulate

SEEDS = (1, 2, 3)


def train(
    model: str, plan, steps: int, seed: int | None, config: AdamWConfig | None = None, on_event=None
):
    """(losses, state_dict) of the engine alone; emulated asynchronous when ``seed`` is set."""
    config = config or AdamWConfig(lr=2e-3, weight_decay=0.1)
    k = plan.training.grad_accum
    data = batches(load_tokens(), plan.training.micro_batch, plan.training.seq_len, 0)
    torch.manual_seed(1234)
    if seed is None:
        engine = wrap(make_model(model), plan, config, device="cpu")
        if on_event is not None:
            engine.on_event(on_event)
        losses = [engine.step([next(data) for _ in range(k)]).loss for _ in range(steps)]
        sd = engine.state_dict()
        engine.close()
        return losses, sd
    with emulate(seed) as emu:
        engine = wrap(make_model(model), plan, config, device="cpu")
        losses = [engine.step([next(data) for _ in range(k)]).loss for _ in range(steps)]
        sd = engine.state_dict()
        engine.close()
    assert not emu.errors, emu.errors
    return losses, sd


def assert_same_sd(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys() and a["optim"].keys() == b["optim"].keys()
    for name in b["model"]:
        torch.testing.assert_close(a["model"][name], b["model"][name], rtol=0, atol=0, msg=name)
    for name in b["optim"]:
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                a["optim"][name][key], b["optim"][name][key], rtol=0, atol=0, msg=f"{name} {key}"
            )


# -- the asynchronous parity matrix


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", list(MATRIX))
def test_async_matrix_fp32_is_exact(case, seed):
    """Every policy, fp32, against plain PyTorch; the model alternates with the seed."""
    model = ("gpt2-4", "llama-4")[(seed + list(MATRIX).index(case)) % 2]
    with emulate(seed) as emu:
        run = lockstep(model, _plan(model, case), steps=4)
        run.engine.close()
    assert not emu.errors, emu.errors
    assert run.losses == run.ref_losses
    assert_same_state(run)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "dtype,grad_accum", [("bfloat16", 1), ("bfloat16", 2), ("float32", 3), ("float16", 2)]
)
@pytest.mark.parametrize("case", ["mixed", "interleaved", "interleaved-2"])
def test_async_matrix_equals_sync(case, dtype, grad_accum, seed):
    """16-bit compute and gradient accumulation: the asynchronous run equals the synchronous one."""
    model = ("gpt2-4", "llama-4")[(seed + len(case)) % 2]
    plan = _plan(model, case, compute_dtype=dtype, grad_accum=grad_accum)
    sync = train(model, plan, 3, None)
    emulated = train(model, plan, 3, seed)
    assert emulated[0] == sync[0]
    assert_same_sd(emulated[1], sync[1])


@pytest.mark.parametrize("seed,land_delay_s", [(1, 0.0), (2, 0.0), (3, 0.0), (4, 0.1)])
def test_async_clipping_is_exact(seed, land_delay_s):
    """Clipping defers the CPU steps; their gradients must have landed (and been accumulated:
    grad_accum 2; with a slow worker in the last case) before the norm is taken."""
    config = AdamWConfig(lr=2e-3, weight_decay=0.1, max_grad_norm=0.05)
    with emulate(seed) as emu:
        run = lockstep(
            "llama-4",
            _plan("llama-4", "interleaved", cpu_adam="after_backward", grad_accum=2),
            steps=4 if not land_delay_s else 2,
            config=config,
            on_event=sleeper(before_grad_land=land_delay_s),
        )
        run.engine.close()
    assert not emu.errors, emu.errors
    assert run.losses == run.ref_losses
    assert_same_state(run)


@pytest.mark.parametrize("emulated", [False, True])
@pytest.mark.parametrize("which", ["before_copy", "before_cpu_adam", "before_weights_return"])
@pytest.mark.parametrize("model,case", [("gpt2-4", "offloaded-buf2"), ("llama-4", "interleaved")])
def test_parity_with_delays(which, emulated, model, case):
    """A slow CPU worker: the next forward's fetch must wait for the chunk's step. With
    synchronous copies the upload reads home at once, so a missing wait reads stale weights."""
    slow = sleeper(**{which: 0.002 if which == "before_copy" else 0.02})
    with emulate(7) if emulated else contextlib.nullcontext():
        run = lockstep(model, _plan(model, case), steps=3, on_event=slow)
        run.engine.close()
    assert run.losses == run.ref_losses


def test_staging_is_reused_only_after_the_worker_landed_it():
    """bf16 with gradient accumulation: micro-batch 2's gradient download reuses the staging
    buffer micro-batch 1's gradient is still being accumulated from, on a slow worker."""
    plan = _plan("llama-4", "offloaded-buf2", compute_dtype="bfloat16", grad_accum=2)
    expected = train("llama-4", plan, 2, None)
    got = train("llama-4", plan, 2, None, on_event=sleeper(before_grad_land=0.03))
    assert got[0] == expected[0]
    assert_same_sd(got[1], expected[1])


# -- guards that only a specific situation reaches


def test_a_forgotten_wait_reads_poison():
    """The emulation's premise: a consumer that does not wait on a copy reads NaN."""
    from protrain.executor.transfer import CopyEngine

    with emulate(1, min_delay_s=0.05, max_delay_s=0.05, tail_p=0.0) as emu:
        copies = CopyEngine(torch.device("cpu"))
        src, dst = torch.ones(8), torch.zeros(8)
        handle = copies.upload(dst, src)
        assert torch.isnan(dst).all()  # issued, not landed
        handle.wait()
        assert torch.equal(dst, src)
        with pytest.raises(AsyncHazard, match="in flight"):
            copies.upload(dst, src)
            copies.resize(dst, 0, "dst")  # freed under a copy that was never waited on
    assert not emu.errors


def test_cpu_step_writes_home_only_after_the_last_upload_read_it():
    """A prefetch still reading home when the chunk's CPU step runs must see the old weights."""
    # grad_accum 2: the accumulator layout, whose gradients the test can set by hand
    plan = make_plan(
        "gpt2-4", persistent=[], n_buffer=2, policies="keep", compute_dtype="bfloat16", grad_accum=2
    )
    with emulate(3, min_delay_s=0.05, max_delay_s=0.05, tail_p=0.0):
        engine = wrap(make_model("gpt2-4"), plan, AdamWConfig(lr=0.1), device="cpu")
        store, optim = engine.store, engine.optim
        cid = store.chunks[1].id
        before = store.chunks[1].home.clone()
        store.fetch(cid)  # a prefetch: the upload lands 50 ms later
        optim.cpu_grad[cid].fill_(1.0)
        store.chunks[1].has_grad.update(range(len(store.chunks[1].params)))  # as the hooks would
        optim.submit_cpu_step(cid)  # the step changes home; it must wait for the upload
        store.wait(cid)
        landed = store.chunks[1].dev[store.chunks[1].own].clone()  # (what home holds)
        optim.wait_all()
        assert not torch.equal(store.chunks[1].home, before)  # the step did change home
        assert torch.equal(landed, before)  # ... but the upload read the old weights
        store.release(cid)
        engine.close()


def test_evaluate_releases_a_prefetch_in_flight():
    """evaluate() ends by releasing every fetched chunk, even after an error in the middle
    of the forward, when a prefetch may still be in flight: release waits for it."""
    plan = _plan("llama-4", "offloaded-buf2")
    assert plan.schedule.forward[2].prefetch  # block 1 prefetches block 2's chunk
    with emulate(5, min_delay_s=0.05, max_delay_s=0.05, tail_p=0.0) as emu:
        run = lockstep("llama-4", plan, steps=2)
        block = dict(run.engine.model.named_modules())[plan.schedule.forward[2].segment]

        def fail(*_):
            raise ValueError("a user's error inside block 1")

        handle = block.register_forward_hook(fail)
        x = next(batches(load_tokens(), 4, 32, 99))
        with pytest.raises(ValueError, match="a user's error"):
            run.engine.evaluate(x)  # not AsyncHazard: the release waited for the prefetch
        assert run.engine.store.resident_offloaded() == frozenset()
        handle.remove()
        loss = run.engine.evaluate(x)
        run.engine.close()
    assert not emu.errors, emu.errors
    run.ref.eval()
    with torch.no_grad():
        assert loss == run.ref(*x).item()


class _HostScalar(torch.autograd.Function):
    """Multiplies by 2 and saves a host-side int64 scalar, like flash SDPA's philox seed."""

    @staticmethod
    def forward(ctx, x):
        from tools.emulation import host_tensor

        seed = host_tensor(torch.tensor(1234, dtype=torch.int64))
        ctx.save_for_backward(seed)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (seed,) = ctx.saved_tensors
        assert seed.item() == 1234 and seed.dim() == 0
        return grad * 2


@pytest.mark.parametrize(
    "policies", ["swap", "swap checkpoint keep swap", "checkpoint swap swap keep"]
)
def test_a_block_saving_a_host_scalar_trains_under_swap(policies):
    """Swap leaves host-side and 0-dim saved tensors alone (D2H of a host tensor: no stream)."""

    def patch(model):
        for block in model.transformer.h:
            block.mlp.register_forward_hook(lambda _m, _a, out: _HostScalar.apply(out))
        return model

    plan = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies=policies)
    ref = patch(make_model("gpt2-4"))
    with emulate(2) as emu:
        engine = wrap(patch(make_model("gpt2-4")), plan, AdamWConfig(), device="cpu")
        data = batches(load_tokens(), 4, 32, 0)
        torch.manual_seed(0)
        losses = [engine.step(next(data)).loss for _ in range(3)]
        engine.close()
    assert not emu.errors, emu.errors
    opt = torch.optim.AdamW(ref.parameters(), fused=True)
    data = batches(load_tokens(), 4, 32, 0)
    torch.manual_seed(0)
    expected = []
    for _ in range(3):
        loss = ref(*next(data))
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    assert losses == expected
