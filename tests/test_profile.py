"""The measuring profiler: the CLI run, exact saved-activation bytes, scaling, stability,
bootstrap."""

from __future__ import annotations

import statistics

import pytest
import torch
from click.testing import CliRunner
from torch.autograd.graph import saved_tensors_hooks

from protrain.planner.commands.cli import main
from protrain.planner.commands.measure import measure
from protrain.planner.hardware.spec import find_spec
from protrain.planner.models.data import batches, load_tokens
from protrain.planner.models.zoo import block_paths, build
from protrain.planner.profiling.profile import dump_profile, load_profile

CPU = find_spec("cpu")


def _measure(name="gpt2-tiny", b=4, t=64, **kw):
    model = build(name)
    return measure(
        model,
        name=name,
        blocks=block_paths(model),
        micro_batch=b,
        seq_len=t,
        compute_dtype="float32",
        device="cpu",
        spec=CPU,
        **kw,
    )


def test_cli_profile_writes_a_complete_profile(tmp_path):
    out = tmp_path / "p.json"
    result = CliRunner().invoke(
        main,
        [
            "profile",
            "--model",
            "gpt2-tiny",
            "--batch",
            "4",
            "--seq",
            "128",
            "--device",
            "cpu",
            "--hardware",
            "cpu",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    data = out.read_bytes()
    prof = load_profile(data)
    assert dump_profile(prof) == data
    assert [s.segment for s in prof.segments] == [
        "<pre>",
        "transformer.h.0",
        "transformer.h.1",
        "<post>",
    ]
    for s in prof.segments[1:-1]:
        assert s.fwd_us > 0 and s.bwd_us > 0 and s.saved_bytes > 0 and s.input_bytes > 0
        assert s.saved_tensor_bytes >= s.saved_bytes
    assert prof.source == "measured" and prof.device == "cpu" and not prof.bootstrap
    assert prof.attention and prof.iterations >= 5  # more where the times vary (measure)
    assert {p.name for p in prof.params} == {
        n for n, _ in build("gpt2-tiny", device="meta").named_parameters()
    }
    assert next(p for p in prof.params if p.name == "transformer.wte.weight").uses == [
        "<pre>",
        "<post>",
    ]


def independent_saved_bytes(name: str, b: int, t: int) -> dict[str, int]:
    """Per block: bytes of the distinct storages autograd saves, found with our own hooks on a
    plain model (no executor), parameters excluded."""
    model = build(name)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current = {"seg": "<pre>"}
    seen: dict[int, str] = {}
    sizes: dict[str, int] = {}
    blocks = block_paths(model)
    mods = dict(model.named_modules())
    hooks = [
        mods[bp].register_forward_pre_hook(lambda m, a, bp=bp: current.update(seg=bp))
        for bp in blocks
    ]
    hooks.append(
        mods[blocks[-1]].register_forward_hook(lambda m, a, o: current.update(seg="<post>"))
    )

    def pack(x):
        s = x.untyped_storage()
        if s.data_ptr() not in params and s.data_ptr() not in seen:
            seen[s.data_ptr()] = current["seg"]
            sizes[current["seg"]] = sizes.get(current["seg"], 0) + s.nbytes()
        return x

    x, y = next(batches(load_tokens(), b, t, 0))
    with saved_tensors_hooks(pack, lambda v: v):
        loss = model(x, y)
    for h in hooks:
        h.remove()
    del loss
    return {bp: sizes[bp] for bp in blocks}


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_saved_bytes_are_exact_and_linear(name):
    shapes = [(2, 32), (4, 32), (2, 64)]
    got = {}
    for b, t in shapes:
        prof = _measure(name, b, t, warmup=0, iterations=1)
        measured = {s.segment: s.saved_bytes for s in prof.segments[1:-1]}
        assert measured == independent_saved_bytes(name, b, t)
        got[(b, t)] = measured
    for block in got[(2, 32)]:
        base = got[(2, 32)][block]
        if name.startswith("gpt2"):
            assert got[(4, 32)][block] == 2 * base  # batch
        else:
            # LLaMA's RoPE cos/sin tables are per position, not per sequence: linear in B
            # with a constant term.
            assert 1.9 * base < got[(4, 32)][block] <= 2 * base
        assert got[(2, 64)][block] >= 2 * base  # sequence (attention's saved rows grow too)
        assert got[(2, 64)][block] <= 2.2 * base


@pytest.mark.bench  # measured times against measured times: a timing check
def test_repeated_profiles_are_stable(capsys):
    """Per-block medians of two profiles agree within 25%.

    On a quiet machine they agree within ~5% (seen: max 1.051). Under a concurrent
    load (a benchmark on the other core) both blocks of one run slowed uniformly by
    ~29%: the machine, not the profiler. So the absolute check allows a uniform drift
    of up to 2x, and the 25% bound applies to each block's share of the step — the
    proportions the planner's choices rest on.
    """
    runs = [_measure("gpt2-tiny", 8, 128, warmup=2, iterations=9) for _ in range(2)]
    ratios, share_ratios = [], []
    totals = [sum(s.fwd_us + s.bwd_us for s in r.segments) for r in runs]
    for a, b in zip(runs[0].segments[1:-1], runs[1].segments[1:-1]):
        for fa, fb in ((a.fwd_us, b.fwd_us), (a.bwd_us, b.bwd_us)):
            ratios.append(max(fa, fb) / min(fa, fb))
            sa, sb = fa / totals[0], fb / totals[1]
            share_ratios.append(max(sa, sb) / min(sa, sb))
    with capsys.disabled():
        print(
            f"\nper-block median ratio between two profiles: max {max(ratios):.3f}, "
            f"median {statistics.median(ratios):.3f}; of shares: max {max(share_ratios):.3f}"
        )
    assert max(share_ratios) <= 1.25
    # Absolute medians drift with whatever else the machine runs (seen 1.53 mid-suite);
    # only a gross instability fails here.
    assert max(ratios) <= 2.0


def test_bootstrap_plan_gives_the_same_activations():
    normal = _measure("llama-tiny", 2, 32, warmup=0, iterations=1)
    boot = _measure("llama-tiny", 2, 32, warmup=0, iterations=1, bootstrap=True)
    assert boot.bootstrap and not normal.bootstrap
    assert [s.saved_bytes for s in boot.segments] == [s.saved_bytes for s in normal.segments]
    assert [s.input_bytes for s in boot.segments] == [s.input_bytes for s in normal.segments]


def test_unavailable_cuda_is_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = CliRunner().invoke(
        main,
        [
            "profile",
            "--model",
            "gpt2-tiny",
            "--batch",
            "1",
            "--seq",
            "8",
            "--device",
            "cuda",
            "-o",
            str(tmp_path / "x.json"),
        ],
    )
    assert (
        result.exit_code == 1
        and "no CUDA device" in result.output
        and "Traceback" not in result.output
    )


def test_a_busy_machine_does_not_set_the_profile(monkeypatch):
    # Issue 39 item 12: four `plan --device cpu` runs of one tiny llama predicted 772, 172,
    # 3.9 and 12 ms: a thread the scheduler parks stalls a segment for a time slice, in
    # most steps, and the median of 5 steps kept the stalls. Here 60% of the segment times
    # carry a 50 ms stall (a clock that jumps when the profiler reads a segment's end): the
    # profile keeps each segment's least time, measures more steps while the least is not
    # confirmed, and says the spread is wide.
    import random
    import sys
    import time

    real, rng, offset = time.perf_counter, random.Random(0), [0.0]

    def stalling_clock():
        if sys._getframe(1).f_code.co_name == "now" and rng.random() < 0.6:
            offset[0] += 0.05
        return real() + offset[0]

    timings = []
    monkeypatch.setattr(time, "perf_counter", stalling_clock)
    prof = _measure("llama-tiny", 2, 64, on_timing=timings.append)
    monkeypatch.setattr(time, "perf_counter", real)
    total_ms = sum(s.fwd_us + s.bwd_us for s in prof.segments) / 1e3
    assert total_ms < 25, (total_ms, [(s.fwd_us, s.bwd_us) for s in prof.segments])
    (timing,) = timings
    assert prof.iterations > 5 and len(timing.step_s) == prof.iterations
    assert timing.statistic == "least" and timing.wide and "noisy" in timing.warning()
    assert "measured steps after 2 warm-up" in timing.describe()


@pytest.mark.bench
def test_ten_plans_on_a_busy_machine_predict_the_same_time(tmp_path, monkeypatch):
    # A bench test: it holds ratios of measured times, which a correctness run may not (the
    # parallel slow run adds a second test process to the busy loop, and one of ten read 1.8x
    # there); `test_a_busy_machine_does_not_set_the_profile` checks the rule deterministically.
    # Issue 39 acceptance: ten `protrain plan --device cpu` runs of one tiny llama (2 layers,
    # hidden 64, batch 2, seq 64) predict iteration times within 1.5x of each other while
    # another process keeps one core busy. run_plan is what the command runs; the machine's
    # probe is made once (the first run, under the same load) and read from the cache after,
    # as on a user's machine. Before: 772, 172, 3.9 and 12 ms; on this 2-core box under the
    # other engineers' load, 6.5 to 514 ms in five profiles.
    import subprocess
    import sys

    from protrain.planner.commands.profile_plan import run_plan

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    predicted, lines = [], []
    try:
        for k in range(10):
            plan = run_plan(
                profile_path=None,
                model_name="llama-tiny",
                hardware=None,
                batch=2,
                seq=64,
                dtype=None,
                device="cpu",
                budget=None,
                world_size=1,
                grad_accum=1,
                output=str(tmp_path / f"plan{k}.json"),
                echo=lines.append,
            )
            predicted.append(plan.prediction.iter_time_us / 1e3)
    finally:
        busy.kill()
        busy.wait()
    spread = [x for x in lines if "measured steps after" in x]
    assert len(spread) == 10  # plan prints the measurement's spread every time
    print(f"\npredicted ms: {', '.join(f'{x:.2f}' for x in predicted)}")
    assert max(predicted) / min(predicted) <= 1.5, (predicted, spread)
