"""The executor bugs a GPU would hit first (issue #14), each pinned on CPU.

Masters start from the user's fp32 values; a forward between steps is refused and
``evaluate`` replaces it; nothing blocks the host on the device during backward or
on the CPU worker; out-of-memory anywhere in a step (or in a collective) is a
BudgetError; a failed wrap leaves nothing pinned; pinned memory is unpinned by a
finaliser; the plan's ``n_buffer`` and ``cpu_adam`` bind the executor.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from harness import make_model, make_plan

from protrain.executor import AdamWConfig, ProtrainError, wrap
from protrain.executor import transfer as T
from protrain.executor.dist import Comm
from protrain.executor.schedule import Phase
from protrain.planner.models.data import batches, load_tokens
from protrain.plans.errors import BudgetError, ConfigError
from tools.emulation import emulate

PLAN = dict(persistent=[0], n_buffer=2, policies="keep checkpoint swap keep")


# -- fp32 masters


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("persistent", [[0, 2], []])
def test_masters_equal_the_users_fp32_parameters_after_wrap(dtype, persistent):
    """[Note: masters from the user's fp32 values]: not the 16-bit rounding of them."""
    model = make_model("llama-4")
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = make_plan(
        "llama-4", persistent=persistent, n_buffer=2, policies="keep", compute_dtype=dtype
    )
    engine = wrap(model, plan, AdamWConfig(), device="cpu")
    sd = engine.state_dict()["model"]
    rounded = 0
    for n, p in original.items():
        assert sd[n].dtype == torch.float32
        assert torch.equal(sd[n], p), n  # bit for bit
        rounded += not torch.equal(p.to(getattr(torch, dtype)).float(), p)
    assert rounded > 0  # the rounded weights would have differed
    # ... and the compute-dtype chunks hold the rounding of those masters.
    for c in engine.store.chunks:
        if c.persistent:
            assert torch.equal(c.dev, engine.optim.master[c.id].to(c.dev.dtype))
        else:
            assert torch.equal(c.home, engine.optim.master[c.id].to(c.home.dtype))
    engine.close()


# -- evaluate, and no other forward between steps


def test_a_plain_forward_after_wrap_runs_under_the_plan_or_is_refused():
    # It used to read released (zero-byte) storage: SIGSEGV. Now the root's own forward with
    # grad enabled is a micro-batch under the plan (executor/engine.py [Note: split phases]),
    # and a module inside whose chunk is released refuses by name.
    model = make_model("gpt2-4")
    engine = wrap(model, make_plan("gpt2-4", **PLAN), device="cpu")
    x, y = next(batches(load_tokens(), 4, 32, 0))
    hidden = torch.zeros(4, 32, model.config.n_embd)
    with pytest.raises(ProtrainError, match="offloaded, released") as e:
        model.transformer.h[1](hidden)
    assert "engine.state_dict()" in e.value.hint
    model(x, y).backward()
    engine.finish_step()
    engine.step((x, y))  # the engine is unharmed
    engine.close()


@pytest.mark.parametrize(
    "policies,grad_accum", [("keep", 1), ("swap checkpoint keep swap", 2), ("checkpoint", 1)]
)
def test_evaluate_between_steps_changes_nothing(policies, grad_accum):
    """evaluate() = the model's eval-mode no-grad loss; the training run goes on bit for bit."""
    plan = make_plan(
        "llama-4", persistent=[1], n_buffer=2, policies=policies, grad_accum=grad_accum
    )
    data = batches(load_tokens(), 4, 32, 0)
    held_out = next(batches(load_tokens(), 4, 32, 77))
    steps = [[next(data) for _ in range(grad_accum)] for _ in range(4)]

    def run(evaluate: bool):
        torch.manual_seed(0)
        model = make_model("llama-4")
        engine = wrap(model, plan, AdamWConfig(lr=2e-3), device="cpu")
        losses, evals = [], []
        for batch in steps:
            losses.append(engine.step(batch).loss)
            if evaluate:
                evals.append(engine.evaluate(held_out))
                assert engine.store.resident_offloaded() == frozenset()
                assert engine.ledger.bytes["activations"] == 0
                assert all(m.training for m in model.modules())
        sd = engine.state_dict()
        engine.close()
        return losses, evals, sd

    losses, evals, sd = run(True)
    ref_losses, _, ref_sd = run(False)
    assert losses == ref_losses
    assert all(torch.equal(sd["model"][n], ref_sd["model"][n]) for n in sd["model"])
    reference = make_model("llama-4")
    reference.load_state_dict(sd["model"])
    reference.eval()
    with torch.no_grad():
        assert evals[-1] == reference(*held_out).item()


# -- nothing blocks the host on the device during backward or on the CPU worker


@pytest.mark.parametrize(
    "dtype,grad_accum,cpu_adam",
    [("float32", 1, None), ("bfloat16", 2, None), ("float32", 1, "after_backward")],
)
def test_no_blocking_device_reads_in_backward_or_the_worker(
    monkeypatch, dtype, grad_accum, cpu_adam
):
    """Patch the blocking device reads to raise during backward and on the CPU worker."""
    plan = make_plan(
        "gpt2-4", compute_dtype=dtype, grad_accum=grad_accum, cpu_adam=cpu_adam, **PLAN
    )
    config = AdamWConfig(max_grad_norm=1.0 if cpu_adam else None)
    with emulate(4) as emu:
        engine = wrap(make_model("gpt2-4"), plan, config, device="cpu")
        calls: list[str] = []

        def forbidden(name, original):
            def f(*args, **kwargs):
                worker = threading.current_thread().name.startswith("protrain-cpu-adam")
                if worker or engine.replayer.phase is Phase.BACKWARD:
                    calls.append(f"{name} on {'the worker' if worker else 'backward'}")
                    raise AssertionError(f"blocking {name}")
                return original(*args, **kwargs)

            return f

        for name in ("item", "cpu", "tolist"):
            monkeypatch.setattr(torch.Tensor, name, forbidden(name, getattr(torch.Tensor, name)))
        monkeypatch.setattr(
            torch.cuda, "synchronize", forbidden("synchronize", torch.cuda.synchronize)
        )
        # A host wait on one copy is the worker's to make (after its download), never backward's.
        host_wait = T.CopyHandle.synchronize

        def copy_synchronize(self):
            if (
                engine.replayer.phase is Phase.BACKWARD
                and threading.current_thread() is threading.main_thread()
            ):
                calls.append("CopyHandle.synchronize on backward")
                raise AssertionError("backward waited for a copy on the host")
            return host_wait(self)

        monkeypatch.setattr(T.CopyHandle, "synchronize", copy_synchronize)
        data = batches(load_tokens(), 4, 32, 0)
        for _ in range(2):
            engine.step([next(data) for _ in range(grad_accum)])
        engine.close()
    assert calls == [] and not emu.errors


# -- out of memory anywhere in a step is a BudgetError


def test_out_of_memory_in_the_first_fetch_is_a_budget_error(monkeypatch):
    engine = wrap(
        make_model("gpt2-4"),
        make_plan("gpt2-4", persistent=[], n_buffer=2, policies="keep"),
        device="cpu",
    )

    def oom(*_a, **_k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 MiB")

    monkeypatch.setattr(engine.copies, "resize", oom)  # the <pre> fetch, before the model runs
    with pytest.raises(BudgetError, match="out of device memory in the forward"):
        engine.step(next(batches(load_tokens(), 4, 32, 0)))
    assert engine.replayer.phase is Phase.IDLE


def test_out_of_memory_in_a_collective_is_not_a_rank_failure():
    comm = Comm(1)

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        comm._run("all-gather of chunk 3", lambda: oom())
    with pytest.raises(ProtrainError, match="another rank probably died"):
        comm._run(
            "all-gather of chunk 3", lambda: (_ for _ in ()).throw(RuntimeError("gloo: closed"))
        )


# -- pinned memory: unpinned on close, on a failed wrap, and by a finaliser


class _FakeCudart:
    def __init__(self):
        self.pinned: set[int] = set()

    def cudaHostRegister(self, ptr, nbytes, flags):
        assert ptr not in self.pinned, "registered twice"
        self.pinned.add(ptr)
        return 0

    def cudaHostUnregister(self, ptr):
        self.pinned.remove(ptr)
        return 0


@pytest.fixture
def cudart(monkeypatch):
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_arena_is_unpinned_by_close_and_by_its_finaliser(cudart):
    arena = T.HostArena(4096, pin=True)
    assert arena.registered and len(cudart.pinned) == 1
    arena.close()
    arena.close()  # idempotent
    assert not arena.registered and not cudart.pinned
    T.HostArena(4096, pin=True)  # dropped without close: the finaliser unpins
    gc.collect()
    assert not cudart.pinned


def test_a_failed_wrap_leaves_nothing_pinned_and_no_hooks(cudart, monkeypatch):
    from protrain.executor import schedule

    model = make_model("gpt2-4")
    plan = make_plan("gpt2-4", **PLAN)
    real_copy_engine = T.CopyEngine.__init__
    real_install = schedule.Replayer.install

    def pinning_copy_engine(self, device, emulation=None):
        real_copy_engine(self, device, emulation)
        self.cuda = True  # the arena pins as on CUDA (with the fake cudart)

    def broken_install(self, model):
        real_install(self, model)  # hooks and the activation wrappers are in place ...
        raise RuntimeError("boom after the hooks")  # ... when wrap fails

    monkeypatch.setattr(T.CopyEngine, "__init__", pinning_copy_engine)
    monkeypatch.setattr(schedule.Replayer, "install", broken_install)
    with pytest.raises(RuntimeError, match="boom") as failure:
        wrap(model, plan, device="cpu")
    # The traceback keeps the half-built engine alive, so this is wrap's own clean-up, not
    # the arena's finaliser.
    assert failure.traceback and not cudart.pinned
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks and "forward" not in m.__dict__


# -- the plan binds: n_buffer and cpu_adam


def test_fetch_beyond_n_buffer_is_an_invariant_error():
    engine = wrap(
        make_model("gpt2-4"),
        make_plan("gpt2-4", persistent=[], n_buffer=2, policies="keep"),
        device="cpu",
    )
    engine.store.fetch(1)
    engine.store.fetch(2)
    with pytest.raises(AssertionError, match="n_buffer=2"):
        engine.store.fetch(3)
    engine.store.release(1)
    engine.store.release(2)
    engine.close()


def test_clipping_needs_an_after_backward_plan():
    plan = make_plan("gpt2-4", **PLAN)
    assert plan.schedule.cpu_adam == "during_backward"
    with pytest.raises(ConfigError, match="--max-grad-norm"):
        wrap(make_model("gpt2-4"), plan, AdamWConfig(max_grad_norm=1.0), device="cpu")


@pytest.mark.parametrize("cpu_adam", ["during_backward", "after_backward"])
def test_the_executed_cpu_step_schedule_is_the_plans(cpu_adam):
    """during_backward: a chunk's CPU step is queued inside backward; after_backward: after it."""
    plan = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep", cpu_adam=cpu_adam)
    engine = wrap(make_model("gpt2-4"), plan, AdamWConfig(), device="cpu")
    phases = []
    submit = engine.optim.submit_cpu_step

    def spy(cid, *args, **kwargs):
        phases.append(engine.replayer.phase)
        return submit(cid, *args, **kwargs)

    engine.optim.submit_cpu_step = spy
    engine.step(next(batches(load_tokens(), 4, 32, 0)))
    n_off = len(plan.placement.offloaded)
    expected = Phase.BACKWARD if cpu_adam == "during_backward" else Phase.IDLE
    assert phases == [expected] * n_off
    engine.close()


def test_the_chunk_pool_is_sized_from_the_plan():
    """[Note: chunk memory pool]: persistent values + gradients, n_buffer fetches, and the
    offloaded gradient buffers open at once in backward."""
    from protrain.executor.chunks import pool_slots

    plan = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep")
    open_grads, most = set(), 0
    for step in plan.schedule.backward:
        open_grads |= set(step.fetch)
        most = max(most, len(open_grads))
        open_grads -= set(step.offload)
    assert 1 <= most <= 2
    assert pool_slots(plan) == 2 * 1 + 2 + most
    everything = make_plan("gpt2-4", persistent="all", n_buffer=0, policies="keep")
    assert pool_slots(everything) == 2 * len(everything.chunks.items)
