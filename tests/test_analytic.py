"""Analytic profiles (planner/profiling/analytic.py): format, FLOPs against hand formulas, saved
activations against the executor's CPU ledger, scaling, speed on a 70B model.

The saved-activation test is the one that matters most: the cost model's memory walk
adds up ``saved_bytes`` and the executor's ledger counts the same bytes, so on CPU the
two must be equal, segment by segment, not merely close.
"""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest
from harness import MICRO_BATCH, SEQ_LEN, make_plan

from protrain.executor import AdamWConfig, wrap
from protrain.executor.check import model_fingerprint, tied_pairs
from protrain.planner.hardware.spec import (
    HARDWARE_DIR,
    HardwareSpec,
    LinkPoint,
    dump_spec,
    find_spec,
)
from protrain.planner.models.data import batches, load_tokens
from protrain.planner.models.zoo import ZOO, block_paths, build
from protrain.planner.profiling.analytic import (
    KERNEL_OVERHEAD_US,
    analytic_profile,
    count_segments,
    scale_profile,
)
from protrain.planner.profiling.graph import trace
from protrain.planner.profiling.profile import dump_profile, load_profile
from protrain.plans.errors import ConfigError
from protrain.plans.plan import POST, PRE

GiB = 2**30


def rtx3090_like(**changes) -> HardwareSpec:
    """Made-up but plausible figures for a 24 GiB consumer card (datasheet-ish)."""
    spec = HardwareSpec(
        name="rtx3090-like",
        kind="gpu",
        device_name="NVIDIA GeForce RTX 3090 (made up)",
        device_memory_bytes=24 * GiB,
        usable_memory_bytes=23 * GiB,
        host_memory_bytes=128 * GiB,
        cpu_cores=16,
        matmul_flops_per_s=71 * 10**12,  # dense bf16 with fp32 accumulate
        matmul_fp32_flops_per_s=35 * 10**12,
        mem_bytes_per_s=936 * 10**9,
        link=[
            LinkPoint(size_bytes=2**20, h2d_bytes_per_s=12 * 10**9, d2h_bytes_per_s=12 * 10**9),
            LinkPoint(size_bytes=2**28, h2d_bytes_per_s=24 * 10**9, d2h_bytes_per_s=24 * 10**9),
        ],
        cpu_adam_params_per_s=1_000_000_000,
        dev_adam_params_per_s=20_000_000_000,
        source="datasheet",
    )
    return msgspec.structs.replace(spec, **changes)


def profile_of(
    name: str,
    *,
    micro_batch=MICRO_BATCH,
    seq_len=SEQ_LEN,
    compute_dtype="float32",
    spec: HardwareSpec | None = None,
):
    model = build(name, device="meta")
    return analytic_profile(
        model,
        name=name,
        blocks=block_paths(model),
        micro_batch=micro_batch,
        seq_len=seq_len,
        compute_dtype=compute_dtype,
        spec=spec or rtx3090_like(),
    )


def counts_of(
    name: str,
    *,
    micro_batch=MICRO_BATCH,
    seq_len=SEQ_LEN,
    compute_dtype="float32",
    spec: HardwareSpec | None = None,
):
    model = build(name, device="meta")
    counts = count_segments(
        model,
        blocks=block_paths(model),
        micro_batch=micro_batch,
        seq_len=seq_len,
        compute_dtype=compute_dtype,
        spec=spec or rtx3090_like(),
    )
    return {c.segment: c for c in counts}


# ---------------------------------------------------------------------------- format


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_profile_round_trips_and_describes_the_model(name, dtype):
    model = build(name, device="meta")
    blocks = block_paths(model)
    profile = profile_of(name, compute_dtype=dtype)
    data = dump_profile(profile)
    assert load_profile(data) == profile
    assert dump_profile(load_profile(data)) == data  # byte-identical
    assert dump_profile(profile_of(name, compute_dtype=dtype)) == data  # deterministic

    assert [s.segment for s in profile.segments] == [PRE, *blocks, POST]
    assert (profile.source, profile.device, profile.attention) == (
        "analytic",
        "analytic:rtx3090-like",
        "sdpa (analytic)",
    )
    assert (profile.bootstrap, profile.iterations) == (False, 0)
    assert profile.hardware == rtx3090_like()
    assert profile.training.compute_dtype == dtype
    assert profile.model.fingerprint == model_fingerprint(model, blocks)
    assert profile.model.tied == tied_pairs(model)
    assert profile.model.n_params == sum(p.numel() for p in model.parameters())
    # Parameters as built (fp32, the fingerprint's dtypes), in first-use order with their uses.
    graph = trace(model, blocks)
    assert [p.name for p in profile.params] == graph.order
    assert {p.dtype for p in profile.params} == {"float32"}
    for p in profile.params:
        assert p.uses == [s for s in graph.segments if p.name in graph.uses[s]]
    for s in profile.segments:
        assert s.fwd_us > 0 and s.bwd_us > 0 and s.saved_bytes > 0 and s.input_bytes > 0
        assert s.saved_tensor_bytes >= s.saved_bytes  # de-duplication only removes
    # The caller's model is left as it was: fp32 and hook-free.
    assert {str(p.dtype) for p in model.parameters()} == {"torch.float32"}
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_refusals():
    model = build("gpt2-tiny", device="meta")
    blocks = block_paths(model)
    kw = dict(name="gpt2-tiny", micro_batch=1, seq_len=8, spec=rtx3090_like())
    with pytest.raises(ConfigError, match="meta"):
        analytic_profile(build("gpt2-tiny"), blocks=blocks, compute_dtype="float32", **kw)
    with pytest.raises(ConfigError, match="not a module"):
        analytic_profile(model, blocks=["transformer.h.9"], compute_dtype="float32", **kw)
    with pytest.raises(ConfigError, match="compute dtype"):
        analytic_profile(model, blocks=blocks, compute_dtype="int8", **kw)


# ---------------------------------------------------------------------------- FLOPs and times


@pytest.mark.parametrize("B,T", [(1, 32), (4, 64), (2, 128)])
def test_gpt2_flops_equal_the_hand_formula(B, T):
    cfg = ZOO["gpt2-tiny"]
    C, V = cfg.n_embd, cfg.vocab_size
    counts = counts_of("gpt2-tiny", micro_batch=B, seq_len=T)
    # Forward: c_attn (C→3C), c_proj (C→C), c_fc (C→4C), mlp c_proj (4C→C): 2·B·T·12·C²;
    # attention: QKᵀ and PV, 2·B·T²·C each (FlopCounterMode counts the full, unmasked square).
    matmul = 2 * B * T * 12 * C**2
    attention = 2 * 2 * B * T**2 * C
    for b in block_paths(build("gpt2-tiny", device="meta")):
        fwd, bwd = counts[b].fwd, counts[b].bwd
        assert fwd.flops == matmul + attention
        # Backward: two matmuls per forward matmul (input and weight gradients);
        # attention recomputes QKᵀ and does four more: 2.5× its forward.
        assert bwd.flops == 2 * matmul + 5 * attention // 2
        assert 2.0 <= bwd.flops / fwd.flops <= 2.5
    # <post>: the tied head, B·T×C by C×V; <pre> is gathers only.
    assert counts[POST].fwd.flops == 2 * B * T * C * V
    assert counts[POST].bwd.flops == 2 * counts[POST].fwd.flops
    assert counts[PRE].fwd.flops == counts[PRE].bwd.flops == 0


def test_matmul_rate_scales_compute_bound_time():
    # Memory is made free so that every op is compute-bound or pure overhead.
    base = rtx3090_like(mem_bytes_per_s=10**18)
    fast = rtx3090_like(
        mem_bytes_per_s=10**18, matmul_fp32_flops_per_s=4 * base.matmul_fp32_flops_per_s
    )
    a, b = counts_of("gpt2-tiny", spec=base), counts_of("gpt2-tiny", spec=fast)
    for s in a:
        for pa, pb in ((a[s].fwd, b[s].fwd), (a[s].bwd, b[s].bwd)):
            overhead = pa.kernels * KERNEL_OVERHEAD_US * 1e-6
            assert pa.kernels == pb.kernels
            # (rel 1e-4: elementwise ops still cost bytes / 10**18 s each)
            assert pb.time_s - overhead == pytest.approx((pa.time_s - overhead) / 4, rel=1e-4)
    # The 16-bit rate is what a bf16 profile uses, the fp32 rate what an fp32 one uses.
    b16 = rtx3090_like(mem_bytes_per_s=10**18, matmul_flops_per_s=10 * base.matmul_flops_per_s)
    blk = "transformer.h.0"
    assert counts_of("gpt2-tiny", spec=b16)[blk].fwd.time_s == a[blk].fwd.time_s
    assert (
        counts_of("gpt2-tiny", spec=b16, compute_dtype="bfloat16")[blk].fwd.time_s
        < counts_of("gpt2-tiny", spec=base, compute_dtype="bfloat16")[blk].fwd.time_s
    )


def test_memory_bandwidth_scales_memory_bound_time():
    # Matmuls made free: what is left is bytes over bandwidth plus overhead.
    base = rtx3090_like(matmul_flops_per_s=10**20, matmul_fp32_flops_per_s=10**20)
    fast = rtx3090_like(
        matmul_flops_per_s=10**20,
        matmul_fp32_flops_per_s=10**20,
        mem_bytes_per_s=2 * base.mem_bytes_per_s,
    )
    a, b = counts_of("llama-tiny", spec=base), counts_of("llama-tiny", spec=fast)
    for s in a:
        overhead = a[s].bwd.kernels * KERNEL_OVERHEAD_US * 1e-6
        assert b[s].bwd.time_s - overhead == pytest.approx(
            (a[s].bwd.time_s - overhead) / 2, rel=1e-3
        )
        assert a[s].bwd.bytes_moved == b[s].bwd.bytes_moved > 0


def test_a_block_of_gpt2_is_compute_bound_at_training_shapes():
    # gpt2 at B=8, T=1024 in bf16: the block's time is within 25% of its matmul time
    # at the 16-bit rate plus per-kernel overhead (the rest is layer norms, GELU, adds).
    spec = rtx3090_like()
    c = counts_of("gpt2", micro_batch=8, seq_len=1024, compute_dtype="bfloat16", spec=spec)[
        "transformer.h.5"
    ]
    ideal = c.fwd.flops / spec.matmul_flops_per_s + c.fwd.kernels * KERNEL_OVERHEAD_US * 1e-6
    assert ideal <= c.fwd.time_s <= 1.25 * ideal
    double = rtx3090_like(matmul_flops_per_s=2 * spec.matmul_flops_per_s)
    p1 = profile_of("gpt2", micro_batch=8, seq_len=1024, compute_dtype="bfloat16", spec=spec)
    p2 = profile_of("gpt2", micro_batch=8, seq_len=1024, compute_dtype="bfloat16", spec=double)
    for s1, s2 in zip(p1.segments[1:-1], p2.segments[1:-1]):
        assert 0.5 * s1.fwd_us <= s2.fwd_us < 0.62 * s1.fwd_us


# ---------------------------------------------------------------------------- activations


def ledger_counts(name: str) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Saved bytes per segment as the executor's CPU ledger counts them at the end of
    forward, training the real model for one step under an all-persistent keep plan;
    plus the segments' input storage bytes seen by hooks."""
    plan = make_plan(name, persistent="all", n_buffer=0, policies="keep")  # B=4, T=32, fp32
    model = build(name)  # dropout 0: the same kernels as the analytic run
    engine = wrap(model, plan, AdamWConfig(), device="cpu")
    saved, tensors, inputs = {}, {}, {}

    def on_event(ev):  # end of forward: each segment's saved bytes, as the ledger counts them
        if ev.kind == "saved":
            saved[ev.segment], tensors[ev.segment] = ev.nbytes, ev.swap_bytes

    engine.on_event(on_event)
    modules = dict(model.named_modules())
    blocks = plan.model.blocks
    for b in blocks:
        modules[b].register_forward_pre_hook(
            lambda _m, args, b=b: inputs.__setitem__(b, args[0].untyped_storage().nbytes())
        )
    modules[blocks[-1]].register_forward_hook(
        lambda _m, _a, out: inputs.__setitem__(POST, out.untyped_storage().nbytes())
    )
    x, y = next(batches(load_tokens(), MICRO_BATCH, SEQ_LEN, 0))
    inputs[PRE] = x.untyped_storage().nbytes()
    engine.step((x, y))
    return saved, tensors, inputs


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_saved_bytes_equal_the_cpu_ledger(name):
    saved, tensors, inputs = ledger_counts(name)
    profile = profile_of(name)  # same B, T, fp32
    for s in profile.segments:
        # Exact: same saved tensors (SDPA as the CPU flash kernel on both sides), same
        # de-duplication by storage, same first-segment ownership, parameters excluded.
        assert s.saved_bytes == saved[s.segment], s.segment
        assert s.saved_tensor_bytes == tensors[s.segment], s.segment
        assert s.input_bytes == inputs[s.segment], s.segment


def test_saved_bytes_scale_linearly_in_batch_and_sequence():
    base = counts_of("gpt2-tiny", micro_batch=2, seq_len=32)
    batch = counts_of("gpt2-tiny", micro_batch=4, seq_len=32)
    seq = counts_of("gpt2-tiny", micro_batch=2, seq_len=64)
    for b in block_paths(build("gpt2-tiny", device="meta")):
        for other in (batch, seq):
            assert other[b].saved_bytes == 2 * base[b].saved_bytes
            assert other[b].saved_tensor_bytes == 2 * base[b].saved_tensor_bytes
            assert other[b].input_bytes == 2 * base[b].input_bytes
    # LLaMA: linear in T; in B up to the RoPE cos/sin tables, (T, head_dim) fp32 each,
    # saved once per block whatever the batch.
    cfg = ZOO["llama-tiny"]
    rope = 2 * 32 * (cfg.dim // cfg.n_head) * 4
    base = counts_of("llama-tiny", micro_batch=2, seq_len=32)
    batch = counts_of("llama-tiny", micro_batch=4, seq_len=32)
    seq = counts_of("llama-tiny", micro_batch=2, seq_len=64)
    for b in block_paths(build("llama-tiny", device="meta")):
        assert seq[b].saved_bytes == 2 * base[b].saved_bytes
        assert batch[b].saved_bytes == 2 * base[b].saved_bytes - rope


def test_dropout_masks_follow_the_spec_kind():
    # Two dropouts per GPT-2 block (after attention and after the MLP), each over (B, T, C).
    # On a GPU spec as CUDA's native_dropout (1-byte mask); on a CPU spec as the CPU's
    # (a noise tensor in the compute dtype, 2 bytes in bf16). Attention dropout saves no mask.
    B, T, C = 2, 32, ZOO["gpt2-tiny"].n_embd
    model = build("gpt2-tiny", device="meta", dropout=0.1)
    blocks = block_paths(model)
    kw = dict(blocks=blocks, micro_batch=B, seq_len=T, compute_dtype="bfloat16")
    gpu = count_segments(model, spec=rtx3090_like(kind="gpu"), **kw)
    cpu = count_segments(model, spec=rtx3090_like(kind="cpu"), **kw)
    none = counts_of("gpt2-tiny", micro_batch=B, seq_len=T, compute_dtype="bfloat16")
    for g, c in zip(gpu[1:-1], cpu[1:-1]):
        assert g.saved_bytes == none[g.segment].saved_bytes + 2 * B * T * C
        assert c.saved_bytes == none[c.segment].saved_bytes + 2 * B * T * C * 2


@pytest.mark.parametrize("dtype,logit_bytes", [("float32", 4), ("bfloat16", 2 + 4)])
def test_post_transient_is_the_logits(dtype, logit_bytes):
    # In <post> forward the logits (compute dtype) and their fp32 copy for the loss are
    # alive at once and gone by the end; log-softmax's output is saved, not transient.
    # lm_loss's all-ignored check adds at most B·T bytes: a (B, T) bool of the supervised
    # targets (alive with the fp32 logits), and its 1-byte flag that ``where`` keeps for
    # backward (alive at the segment's end, so one byte less above it).
    B, T, V = 2, 32, ZOO["gpt2-tiny"].vocab_size
    post = counts_of("gpt2-tiny", micro_batch=B, seq_len=T, compute_dtype=dtype)[POST]
    assert abs(post.fwd.peak_bytes - B * T * V * logit_bytes) <= B * T


def test_cpu_spec_profiles_carry_no_transients():
    # As measured CPU profiles: the CPU ledger counts no transients, so the cost model
    # must not add any when it predicts a CPU run.
    cpu = profile_of("gpt2-tiny", spec=rtx3090_like(kind="cpu", name="cpu-like"))
    gpu = profile_of("gpt2-tiny")
    assert all(s.fwd_peak_bytes == s.bwd_peak_bytes == 0 for s in cpu.segments)
    assert all(s.fwd_peak_bytes > 0 and s.bwd_peak_bytes > 0 for s in gpu.segments)


# ---------------------------------------------------------------------------- scaling


def test_scale_profile_linear_in_tokens():
    p = profile_of("gpt2-tiny", micro_batch=2, seq_len=32)
    measured = msgspec.structs.replace(p, source="measured", iterations=5, device="cpu")
    s = scale_profile(measured, micro_batch=4, seq_len=64)
    assert s.source == "analytic" and s.device == "cpu"
    assert (s.training.micro_batch, s.training.seq_len) == (4, 64)
    assert s.params == measured.params and s.model == measured.model
    for a, b in zip(measured.segments, s.segments):
        assert b.segment == a.segment
        assert (b.fwd_us, b.bwd_us, b.saved_bytes) == (
            4 * a.fwd_us,
            4 * a.bwd_us,
            4 * a.saved_bytes,
        )
    assert load_profile(dump_profile(s)) == s


def test_scale_profile_with_the_model_follows_the_analytic_shape():
    model = build("gpt2-tiny", device="meta")
    p = profile_of("gpt2-tiny", micro_batch=2, seq_len=32)
    s = scale_profile(p, micro_batch=4, seq_len=128, model=model)
    direct = profile_of("gpt2-tiny", micro_batch=4, seq_len=128)
    for a, b in zip(s.segments, direct.segments):
        for key in (
            "fwd_us",
            "bwd_us",
            "saved_bytes",
            "saved_tensor_bytes",
            "input_bytes",
            "fwd_peak_bytes",
            "bwd_peak_bytes",
        ):
            assert abs(getattr(a, key) - getattr(b, key)) <= 1, (a.segment, key)
    with pytest.raises(ConfigError, match="not the profiled"):
        scale_profile(p, micro_batch=4, seq_len=64, model=build("llama-tiny", device="meta"))


# ---------------------------------------------------------------------------- real cards, 70B


@pytest.mark.parametrize("name", ["rtx3090", "a100-80g", "h200", "cpu"])
def test_with_committed_hardware_specs(name):
    if not (HARDWARE_DIR / f"{name}.json").exists():
        pytest.skip(f"plans/hardware/{name}.json is not written yet")
    spec = find_spec(name)
    # GPUs train in bf16; the CPU spec in fp32 (its fp32 matmul rate is the higher one).
    dtype, rate = (
        ("bfloat16", spec.matmul_flops_per_s)
        if spec.kind == "gpu"
        else ("float32", spec.matmul_fp32_flops_per_s)
    )
    p = profile_of("gpt2", micro_batch=4, seq_len=1024, compute_dtype=dtype, spec=spec)
    assert p.device == f"analytic:{spec.name}" and p.hardware == spec
    assert load_profile(dump_profile(p)) == p
    # GPT-2 at B=4, T=1024 is matmul-bound: a block's forward lies between its matmul
    # time at the spec's rate and twice that (norms, GELU, adds, launch overhead).
    c = counts_of("gpt2", micro_batch=4, seq_len=1024, compute_dtype=dtype, spec=spec)
    fwd = c["transformer.h.0"].fwd
    assert fwd.flops / rate < fwd.time_s < 2 * fwd.flops / rate
    assert all(s.fwd_us == round(c[s.segment].fwd.time_s * 1e6) for s in p.segments)


def test_a100_is_faster_than_rtx3090():
    if not all((HARDWARE_DIR / f"{n}.json").exists() for n in ("rtx3090", "a100-80g")):
        pytest.skip("plans/hardware/{rtx3090,a100-80g}.json are not written yet")
    slow = profile_of(
        "gpt2", micro_batch=4, seq_len=1024, compute_dtype="bfloat16", spec=find_spec("rtx3090")
    )
    fast = profile_of(
        "gpt2", micro_batch=4, seq_len=1024, compute_dtype="bfloat16", spec=find_spec("a100-80g")
    )
    assert all(
        f.fwd_us < s.fwd_us and f.bwd_us < s.bwd_us
        for s, f in zip(slow.segments[1:-1], fast.segments[1:-1])
    )


_LLAMA_70B = """
import resource, sys, time
t0 = time.perf_counter()
from protrain.planner.profiling.analytic import analytic_profile
from protrain.planner.models.zoo import block_paths, build
from protrain.planner.profiling.profile import dump_profile
from protrain.planner.hardware.spec import load_spec
spec = load_spec(sys.stdin.buffer.read())
t1 = time.perf_counter()
model = build("llama-70b", device="meta")
p = analytic_profile(model, name="llama-70b", blocks=block_paths(model), micro_batch=1,
                     seq_len=4096, compute_dtype="bfloat16", spec=spec)
dump_profile(p)
t2 = time.perf_counter()
block = p.segments[1]
# VmHWM, not ru_maxrss: the latter also carries the (large) pytest parent's RSS across fork+exec.
hwm = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) * 1024
print(f"{t2 - t1} {t1 - t0} {hwm} "
      f"{len(p.segments)} {block.fwd_us} {block.saved_bytes}")
"""


@pytest.fixture(scope="module")
def llama_70b_run():
    """(build + profile seconds, import seconds, peak RSS bytes, segments, block fwd_us,
    block saved bytes) of llama-70b's analytic profile, in a fresh interpreter."""
    out = (
        subprocess.run(
            [sys.executable, "-c", _LLAMA_70B],
            input=dump_spec(rtx3090_like()),
            capture_output=True,
            check=True,
            timeout=300,
        )
        .stdout.decode()
        .split()
    )
    return float(out[0]), float(out[1]), int(out[2]), int(out[3]), int(out[4]), int(out[5])


@pytest.mark.slow  # (11 s)
def test_llama_70b_is_small(llama_70b_run, capsys):
    seconds, import_s, rss, n_segments, fwd_us, saved = llama_70b_run
    with capsys.disabled():
        print(
            f"\nllama-70b analytic profile (B=1, T=4096, bf16): build + profile {seconds:.1f} s "
            f"(imports {import_s:.1f} s), peak RSS {rss / 2**20:.0f} MiB, "
            f"block forward {fwd_us / 1e3:.1f} ms, block saved {saved / 2**20:.0f} MiB"
        )
    assert n_segments == 82
    assert rss < 2 * GiB
    # Sanity against 2·N·tokens: one block is ~856M parameters → ~7 TFLOP at T=4096,
    # ~100 ms at 71 TFLOP/s, plus attention.
    assert 90_000 < fwd_us < 140_000


@pytest.mark.bench
def test_llama_70b_is_fast(llama_70b_run):
    seconds = llama_70b_run[0]
    assert seconds < 30


def test_json_of_the_profile_is_plain_data():
    data = json.loads(dump_profile(profile_of("llama-tiny")))
    assert data["source"] == "analytic" and data["segments"][0]["segment"] == PRE


# ---------------------------------------------------------------------------- replicated blocks


def _deepened_and_full(cfg, *, micro_batch, seq_len, compute_dtype, spec):
    """``deepen`` of the ``REPLICA_BLOCKS``-deep model of ``cfg``, and ``cfg``'s own profile."""
    import dataclasses

    import torch

    from protrain.executor.check import model_signature
    from protrain.planner.models.zoo import GPT2, GPT2Config, Llama
    from protrain.planner.profiling.deepen import REPLICA_BLOCKS, deepen

    def profile(c):
        with torch.device("meta"):
            model = GPT2(c) if isinstance(c, GPT2Config) else Llama(c)
        return analytic_profile(
            model,
            name="m",
            blocks=block_paths(model),
            micro_batch=micro_batch,
            seq_len=seq_len,
            compute_dtype=compute_dtype,
            spec=spec,
        ), model_signature(model)

    shallow = profile(dataclasses.replace(cfg, n_layer=REPLICA_BLOCKS))
    full, signature = profile(cfg)
    deep = deepen(*shallow, cfg.n_layer)
    assert deep is not None, "deepen declined a model of identical blocks"
    return deep, (full, signature), shallow


def _cases():
    from protrain.planner.commands.fit import gpt2_ladder, llama_ladder
    from protrain.planner.models.zoo import GPT2Config, LlamaConfig

    gpu, cpu = rtx3090_like(), find_spec("cpu")
    # (config, micro-batch, seq, dtype, spec): both families, GQA, dropout, fp32, a CPU spec
    return [
        pytest.param(gpt2_ladder()[0], 2, 128, "bfloat16", gpu, id="gpt2-124m"),
        pytest.param(
            GPT2Config(n_layer=7, n_head=4, n_embd=256, dropout=0.1),
            3,
            64,
            "float32",
            gpu,
            id="gpt2-dropout-fp32",
        ),
        pytest.param(
            GPT2Config(n_layer=6, n_head=4, n_embd=256, dropout=0.1),
            2,
            64,
            "float32",
            cpu,
            id="gpt2-dropout-cpu",
        ),
        pytest.param(llama_ladder()[0], 1, 256, "bfloat16", gpu, id="llama-1.1b"),
        pytest.param(
            LlamaConfig(n_layer=9, n_head=8, n_kv_head=2, dim=512, ffn_dim=1408),
            2,
            128,
            "bfloat16",
            gpu,
            id="llama-gqa",
        ),
        pytest.param(
            LlamaConfig(n_layer=5, n_head=8, n_kv_head=8, dim=512, ffn_dim=1408),
            1,
            64,
            "float16",
            cpu,
            id="llama-cpu",
        ),
    ]


@pytest.mark.parametrize("cfg, micro_batch, seq_len, dtype, spec", _cases())
def test_deepen_equals_profiling_every_block(cfg, micro_batch, seq_len, dtype, spec):
    """``deepen.deepen`` (a shallow model's profile with its interior block repeated: what
    ``protrain fit`` profiles) is the deep model's own profile, field by field, segment by
    segment, parameter by parameter, with the deep model's parameter signature."""
    (deep, deep_sig), (full, full_sig), _ = _deepened_and_full(
        cfg, micro_batch=micro_batch, seq_len=seq_len, compute_dtype=dtype, spec=spec
    )
    assert deep_sig == full_sig
    assert deep.model == full.model
    assert len(deep.segments) == len(full.segments)
    for a, b in zip(deep.segments, full.segments):
        assert a == b, (a, b)
    assert deep.params == full.params
    for f in full.__struct_fields__:
        assert getattr(deep, f) == getattr(full, f), f
    assert dump_profile(deep) == dump_profile(full)


@pytest.mark.slow
@pytest.mark.parametrize("family, rung", [("gpt2", 60), ("llama", 28)])
def test_deepen_equals_profiling_every_block_at_ladder_sizes(family, rung):
    """The same at sizes ``protrain fit`` probes (gpt2 5.6B, 48 layers; llama 60B-shaped, GQA)."""
    from protrain.planner.commands.fit import ladder

    cfg = ladder(family, 1024)[rung]
    (deep, _), (full, _), _ = _deepened_and_full(
        cfg, micro_batch=2, seq_len=1024, compute_dtype="bfloat16", spec=find_spec("rtx3090")
    )
    assert [a for a, b in zip(deep.segments, full.segments) if a != b] == []
    assert dump_profile(deep) == dump_profile(full)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_fit_profiles_with_adapters_equal_the_deep_models(family, monkeypatch):
    """With LoRA's adapters (peft; the base frozen) ``fit._profile`` through ``deepen`` is still
    the deep model's own profile, its frozen marks included (``fit --lora`` relies on it)."""
    pytest.importorskip("peft")
    import dataclasses

    from protrain.planner.commands import fit as F
    from protrain.planner.models.lora import LoraSpec

    monkeypatch.setattr(F, "_PROFILES", {})
    monkeypatch.setattr(F, "_SHALLOW", {})
    spec, lora = rtx3090_like(), LoraSpec(r=4)
    cfg = dataclasses.replace(F.ladder(family, 64)[0], n_layer=7)
    got = F._profile(cfg, 2, 64, "bfloat16", spec, "d", lora)
    assert F._SHALLOW, "deepen was not used"
    want, _ = F._analytic(cfg, got.model.name, 2, 64, "bfloat16", spec, lora)
    assert any(p.frozen for p in want.params) and not all(p.frozen for p in want.params)
    assert dump_profile(got) == dump_profile(want)


def test_deepen_declines_what_it_cannot_replicate():
    """Where the shallow model's two interior blocks differ, or the blocks are too few, or a
    non-block parameter is used inside a block, ``deepen`` returns None (fit then profiles
    every block)."""
    from protrain.planner.models.zoo import GPT2Config
    from protrain.planner.profiling.deepen import deepen

    cfg = GPT2Config(n_layer=6, n_head=4, n_embd=256)
    _, _, (shallow, sig) = _deepened_and_full(
        cfg, micro_batch=1, seq_len=32, compute_dtype="float32", spec=rtx3090_like()
    )
    assert deepen(shallow, sig, 6) is not None
    segs = list(shallow.segments)
    segs[3] = msgspec.structs.replace(segs[3], fwd_us=segs[3].fwd_us + 1)
    assert deepen(msgspec.structs.replace(shallow, segments=segs), sig, 6) is None
    assert deepen(shallow, sig, 3) is None
    params = list(shallow.params)
    params[0] = msgspec.structs.replace(params[0], uses=[*params[0].uses, shallow.model.blocks[1]])
    assert deepen(msgspec.structs.replace(shallow, params=params), sig, 6) is None


def test_fit_profiles_equal_the_deep_models(monkeypatch):
    """``fit._profile`` (through ``deepen``) gives the profile ``analytic_profile`` gives the deep
    model, named as fit names it; and the shallow profile is shared by the depths of one width."""
    import dataclasses

    from protrain.planner.commands import fit as F

    monkeypatch.setattr(F, "_PROFILES", {})
    monkeypatch.setattr(F, "_SHALLOW", {})
    spec = rtx3090_like()
    cfg = dataclasses.replace(F.gpt2_ladder()[0], n_layer=7)
    got = F._profile(cfg, 2, 64, "bfloat16", spec, "d")
    want, _ = F._analytic(cfg, got.model.name, 2, 64, "bfloat16", spec)
    assert dump_profile(got) == dump_profile(want)
    assert got.model.name == f"gpt2-{F.n_params(cfg) / 1e9:.2f}b"
    F._profile(dataclasses.replace(cfg, n_layer=9), 2, 64, "bfloat16", spec, "d")
    assert len(F._SHALLOW) == 1 and len(F._PROFILES) == 2
