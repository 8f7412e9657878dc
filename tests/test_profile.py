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
    assert prof.attention and prof.iterations == 5
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
