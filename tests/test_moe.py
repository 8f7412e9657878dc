"""Mixture-of-experts models (planner/models/moe.py) in the analytic profile, and ``fit`` for one
model (planner/commands/fit_config.py).

What is pinned: detection across the transformers MoE families (experts, top-k, shared
experts, which blocks); the analytic profile charges the routed experts at top_k / n_experts
of their all-experts compute (FLOPs against the hand formula) while every expert stays a
parameter; the balanced stand-in launches the kernels and saves the tensors of
transformers' grouped GEMM path; the analytic block time against a measured CPU profile,
both with a spec probed on this machine; the fit answer and its report.
Models are tiny transformers configs built on meta (nothing downloaded).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path

import msgspec
import pytest
import torch
from planfactory import gpu_spec
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from protrain.executor import transfer
from protrain.planner.commands.fit import host_need_bytes
from protrain.planner.commands.fit_config import fit_model, render_model_fit, run_model_fit
from protrain.planner.hardware.spec import find_spec
from protrain.planner.models.moe import balanced_experts, balanced_forward, detect, moe_blocks
from protrain.planner.models.zoo import block_paths, count_params
from protrain.planner.profiling import analytic
from protrain.planner.profiling.analytic import analytic_profile, count_segments
from protrain.plans.errors import BudgetError, ConfigError
from protrain.plans.plan import POST, PRE

transformers = pytest.importorskip("transformers")
MiB = 2**20

H, FFN, E = 64, 128, 8  # hidden, expert width, experts: the tiny Mixtral
ATTN = dict(
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, vocab_size=256
)


def tiny(family: str, **changes):
    """A transformers config of ``family`` with a few 64-wide layers."""
    if family == "mixtral":
        cfg = transformers.MixtralConfig(
            hidden_size=H,
            intermediate_size=FFN,
            num_hidden_layers=2,
            num_local_experts=E,
            num_experts_per_tok=2,
            **ATTN,
        )
    elif family == "mistral":  # Mixtral's dense twin: one MLP as wide as top_k experts
        cfg = transformers.MistralConfig(
            hidden_size=H, intermediate_size=2 * FFN, num_hidden_layers=2, **ATTN
        )
    elif family == "qwen3_moe":  # block 0 dense (mlp_only_layers)
        cfg = transformers.Qwen3MoeConfig(
            hidden_size=H,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_experts=16,
            num_experts_per_tok=4,
            head_dim=16,
            mlp_only_layers=[0],
            **ATTN,
        )
    elif family == "olmoe":
        cfg = transformers.OlmoeConfig(
            hidden_size=H,
            intermediate_size=64,
            num_hidden_layers=2,
            num_experts=8,
            num_experts_per_tok=2,
            **{**ATTN, "num_key_value_heads": 4},
        )
    elif family == "qwen2_moe":  # one shared expert beside the routed ones
        cfg = transformers.Qwen2MoeConfig(
            hidden_size=H,
            intermediate_size=128,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_hidden_layers=2,
            num_experts=8,
            num_experts_per_tok=2,
            **ATTN,
        )
    elif family == "deepseek_v3":  # first block dense, one shared expert, grouped routing
        cfg = transformers.DeepseekV3Config(
            hidden_size=H,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            **{**ATTN, "num_key_value_heads": 4},
        )
    elif family == "gpt_oss":  # transposed banks with biases, its own gate (clamped SwiGLU)
        cfg = transformers.GptOssConfig(
            hidden_size=H,
            intermediate_size=64,
            num_hidden_layers=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            head_dim=16,
            sliding_window=256,
            **ATTN,
        )
    else:
        raise AssertionError(family)
    for k, v in changes.items():
        setattr(cfg, k, v)
    cfg.use_cache = False
    return cfg


def build(cfg, device="meta"):
    """The protrain adapter of a transformers model built from ``cfg`` (on meta by default)."""
    from protrain.planner.models import hf

    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return hf.from_model(model)


# ---------------------------------------------------------------------------- detection


def routed(cfg) -> int:
    """Routed-expert parameters of one MoE block, by hand: gate+up (2 x FFN x H) and down (H x
    FFN)."""
    width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    n = (
        getattr(cfg, "num_local_experts", None)
        or getattr(cfg, "n_routed_experts", None)
        or cfg.num_experts
    )
    return n * 3 * cfg.hidden_size * width


@pytest.mark.parametrize(
    "family,n_experts,top_k,shared,blocks",
    [
        ("mixtral", 8, 2, 0, [0, 1]),
        ("qwen3_moe", 16, 4, 0, [1, 2]),
        ("olmoe", 8, 2, 0, [0, 1]),
        ("qwen2_moe", 8, 2, 1, [0, 1]),
        ("deepseek_v3", 8, 2, 1, [1, 2]),
        ("gpt_oss", 8, 2, 0, [0, 1]),
    ],
)
def test_detects_the_experts_of_each_family(family, n_experts, top_k, shared, blocks):
    cfg = tiny(family)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            cfg
        )  # raw transformers: detect needs no adapter
    layout = detect(model)
    assert (layout.n_experts, layout.top_k, layout.n_shared_experts, layout.fused) == (
        n_experts,
        top_k,
        shared,
        True,
    )
    paths = [f"model.layers.{i}" for i in range(cfg.num_hidden_layers)]
    assert moe_blocks(layout, paths) == [paths[i] for i in blocks]  # the dense blocks are left out
    assert layout.total_params == count_params(model)
    # gpt-oss's banks carry biases, (E, 2I) and (E, H), on top of the weights
    bias = len(blocks) * n_experts * (2 * cfg.intermediate_size + H) if family == "gpt_oss" else 0
    assert layout.routed_params == len(blocks) * routed(cfg) + bias
    assert (
        layout.active_params
        == layout.total_params - layout.routed_params * (n_experts - top_k) // n_experts
    )


def test_dense_models_have_no_layout_and_undeclared_experts_are_refused():
    with torch.device("meta"):
        dense = transformers.AutoModelForCausalLM.from_config(tiny("mistral"))
    assert detect(dense) is None

    class Opaque(nn.Module):  # says it has experts, keeps them where we cannot see them
        config = type("Cfg", (), {"num_local_experts": 8})()

        def __init__(self):
            super().__init__()
            self.mlp = nn.Linear(4, 4)

    with pytest.raises(ConfigError, match="declares 8 experts") as e:
        detect(Opaque())
    assert "HINT" in str(e.value)


class ListMoE(nn.Module):
    """Experts as an nn.ModuleList with a data-dependent loop (transformers 4.x style)."""

    config = type("Cfg", (), {"num_experts_per_tok": 2})()

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, idx, targets=None):  # pragma: no cover - only detected, never run
        raise AssertionError


def test_module_list_experts_are_counted_but_not_profiled_on_meta():
    model = ListMoE()
    layout = detect(model)
    assert (layout.n_experts, layout.top_k, layout.fused) == (4, 2, False)
    assert layout.routed_params == 4 * (8 * 8 + 8)
    with pytest.raises(ConfigError, match="nn.ModuleList") as e, balanced_experts(model):
        pass
    assert "protrain profile" in str(e.value)


# ---------------------------------------------------------------------------- analytic compute


def block_counts(cfg, *, B=2, T=32, dtype="float32", spec=None):
    model = build(cfg)
    counts = count_segments(
        model,
        blocks=block_paths(model),
        micro_batch=B,
        seq_len=T,
        compute_dtype=dtype,
        spec=spec or find_spec("cpu"),
    )
    return {c.segment: c for c in counts}


def test_a_top2_of_8_block_charges_2_of_8_experts():
    # FLOPs of one Mixtral block as top_k goes 1, 2, 8: attention and the router do not
    # depend on top_k, each routed expert a token visits adds 2 x 3HI per token in forward
    # (gate+up H→2·FFN, down FFN→H) and twice that in backward. So the expert part at top-2 is
    # 2/8 of the all-experts part (top-8 of 8: what counting every expert would charge).
    B, T = 2, 32
    N = B * T
    per_expert_fwd = 2 * N * 3 * H * FFN  # one expert's FLOPs if every token visited it
    blk = "model.layers.0"
    flops = {
        k: block_counts(tiny("mixtral", num_experts_per_tok=k), B=B, T=T)[blk] for k in (1, 2, 8)
    }
    for phase, factor in (("fwd", 1), ("bwd", 2)):
        f = {k: getattr(c, phase).flops for k, c in flops.items()}
        assert f[2] - f[1] == factor * per_expert_fwd
        assert f[8] - f[2] == 6 * factor * per_expert_fwd
        expert_top2 = 2 * factor * per_expert_fwd
        assert expert_top2 / (8 * factor * per_expert_fwd) == 2 / 8
        # ... and the rest of the block equals the dense twin's attention + the router (2·N·H·E)
        dense = getattr(block_counts(tiny("mistral"), B=B, T=T)[blk], phase).flops
        mlp = factor * 2 * N * 3 * H * (2 * FFN)  # the twin's MLP: as wide as two experts
        router = (
            factor * 2 * N * H * E
        )  # router logits (forward); input + weight gradient (backward)
        assert f[2] - expert_top2 == dense - mlp + router
    # Time follows: the experts' share at top-2 is about a quarter of the all-experts one.
    t = {k: c.fwd.time_s for k, c in flops.items()}
    assert 0.2 < (t[2] - t[1]) * 2 / ((t[8] - t[1]) * 8 / 7) < 0.3


def test_memory_is_charged_for_every_expert():
    # The profile lists every expert parameter (the planner lays all of them out in
    # chunks), while its compute is the top-k one above.
    model = build(tiny("mixtral"))
    p = analytic_profile(
        model,
        name="mixtral-tiny",
        blocks=block_paths(model),
        micro_batch=2,
        seq_len=32,
        compute_dtype="bfloat16",
        spec=find_spec("h200"),
    )
    assert p.model.n_params == count_params(model) == detect(model).total_params
    banks = [q for q in p.params if ".mlp.experts." in q.name]
    assert {tuple(q.shape) for q in banks} == {(E, 2 * FFN, H), (E, H, FFN)}
    assert all(q.uses == [q.name.rsplit(".mlp", 1)[0]] for q in banks)  # used by its own block
    # The instances' forward is theirs again, and the model still routes for real on CPU.
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize(
    "family", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "deepseek_v3", "gpt_oss"]
)
def test_every_family_profiles_on_meta(family):
    model = build(tiny(family))
    p = analytic_profile(
        model,
        name=family,
        blocks=block_paths(model),
        micro_batch=2,
        seq_len=32,
        compute_dtype="bfloat16",
        spec=find_spec("h200"),
    )
    assert [s.segment for s in p.segments] == [PRE, *block_paths(model), POST]
    assert all(s.fwd_us > 0 and s.bwd_us > 0 and s.saved_bytes > 0 for s in p.segments[1:-1])


def test_balanced_banks_save_what_the_grouped_gemm_saves():
    # transformers' grouped_mm path runs on meta only in bf16 (torch's meta kernel takes
    # the CUDA kernel's dtype rule), and there FlopCounterMode has no formula for it: the
    # experts would count 0 FLOPs. Its saved activations are real, though, and the
    # balanced bank saves the same tensors: the permuted inputs, both GEMMs' inputs,
    # the gate's, the routing weights; all but the grouped GEMM's offsets, (E,) int32
    # per GEMM, which the bmm does not need (2 x 4E bytes per block).
    cfg = tiny("mixtral")
    balanced = block_counts(cfg, dtype="bfloat16")
    stock = analytic.balanced_experts
    analytic.balanced_experts = lambda _model, **_: contextlib.nullcontext()
    try:
        grouped = block_counts(cfg, dtype="bfloat16")
    finally:
        analytic.balanced_experts = stock
    blk = "model.layers.0"
    assert abs(grouped[blk].saved_bytes - balanced[blk].saved_bytes) <= 2 * 4 * E
    router_and_attention = grouped[blk].fwd.flops  # the grouped GEMMs count nothing
    assert balanced[blk].fwd.flops == router_and_attention + 2 * 2 * 32 * 2 * 3 * H * FFN


# ---------------------------------------------------------------------------- the balanced
# stand-in, op for op


class _Kernels(TorchDispatchMode):
    """Counts the aten ops that launch a kernel (views and aliases left out), per phase."""

    def __init__(self):
        super().__init__()
        self.phase = "fwd"  # moved to "bwd" by the caller
        self.ops = {"fwd": Counter(), "bwd": Counter()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (
            func.is_view or func._overloadpacket.__name__ in ("_unsafe_view", "detach", "alias")
        ):
            self.ops[self.phase][func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "family", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "deepseek_v3", "gpt_oss"]
)
def test_the_balanced_bank_launches_the_kernels_of_the_grouped_path(family):
    # The analytic profile charges a MoE block for the ops it sees on meta, so the balanced
    # stand-in must launch what transformers' grouped path launches on a real device: the
    # sort, the gathers, the offsets (a cast, histc, cumsum: routing bookkeeping the bmm
    # does not need but the block pays for), per-row biases (gpt-oss), the gate, the
    # weighting, the un-permute, the top-k sum and all their backward kernels, with each
    # grouped GEMM replaced by one bmm. Tokens x top_k divisible by the experts: the
    # stand-in pads nothing and slices nothing.
    torch.manual_seed(0)
    model = build(tiny(family), device="cpu")
    layout = detect(model)
    bank = dict(model.named_modules())[layout.banks[0]]
    n_tok, k = 64, layout.top_k
    routing = torch.stack([torch.randperm(layout.n_experts)[:k] for _ in range(n_tok)])  # (N, k)

    def kernels(forward) -> dict[str, Counter]:
        for p in (
            bank.parameters()
        ):  # preset, as the analytic profile and the executor's chunks have them:
            p.grad = torch.zeros_like(
                p
            )  # gradients accumulate in place (an add_ per weight in both paths)
        x = torch.randn(n_tok, H, requires_grad=True)  # (N, H)
        weights = torch.rand(n_tok, k, requires_grad=True)  # (N, k)
        rec = _Kernels()
        with rec:
            y = forward(bank, x, routing, weights)  # (N, H)
            rec.phase = "bwd"
            y.sum().backward()
        return rec.ops

    grouped = kernels(lambda m, *a: m(*a))  # our EXPERTS: transformers' grouped_mm path on CPU
    balanced = kernels(balanced_forward)
    assert grouped["fwd"]["_grouped_mm"] == 2 and grouped["bwd"]["_grouped_mm"] == 4
    for phase in ("fwd", "bwd"):
        expected = grouped[phase].copy()
        expected["bmm"] = expected.pop("_grouped_mm")
        assert balanced[phase] == expected, (
            phase,
            balanced[phase] - expected,
            expected - balanced[phase],
        )


# ---------------------------------------------------------------------------- against a measured
# profile

PROFILE_B, PROFILE_T, PROFILE_ROUNDS, PROBE_EVERY, MAX_ROUNDS, NEAR = 4, 64, 12, 4, 36, 0.2
if os.environ.get("PROTRAIN_PROBED_ROUNDS"):
    # The test of tools/bench/moe_spread.py (test_bench_tools.py) checks the shape of the
    # tool's report, not its figures: a run of one round is enough there.
    PROFILE_ROUNDS = MAX_ROUNDS = int(os.environ["PROTRAIN_PROBED_ROUNDS"])
CAL_HOST_NS, SLOW_HOST = 1100, 1.2
"""A bare ``Tensor.view`` from Python (``host_view_ns``) on the 2-core box the CPU host
costs in analytic.py were measured on, in its usual state: 1.05-1.21 us on 2026-12-06 (the
least of 7 x 2000 calls, one thread, the thread's CPU clock), and 1.9-2.6 us in the spells,
minutes long, in which that VM runs slow. A measurement whose host ran more than
``SLOW_HOST`` times slower (the median over its rounds) is not one the absolute checks
compare against (``_calibrated``): the CPU host costs are ~45% of the Mixtral forward's
analytic time and do not scale, so the forward reads lower as the host slows (medians of
1,073-1,195 ns gave 0.80-0.93x, 1,252-1,441 ns 0.80-0.84x, in eleven runs here), and a host
1.35x slow would take its usual 0.86x to ~0.75x, the bound."""


def measured_block_us(model, *, B, T, spec) -> tuple[float, float]:
    """One measured profile's least block (fwd_us, bwd_us)."""
    from protrain.planner.commands.measure import measure

    p = measure(
        model,
        name="m",
        blocks=block_paths(model),
        micro_batch=B,
        seq_len=T,
        compute_dtype="float32",
        device="cpu",
        spec=spec,
        iterations=5,
        warmup=1,
    )
    seg = p.segments[1:-1]
    return min(s.fwd_us for s in seg), min(s.bwd_us for s in seg)


def host_view_ns(calls: int = 2000) -> float:
    """Nanoseconds of one ``Tensor.view`` called from Python, on the thread's CPU clock (after a
    warm-up)."""
    x = torch.zeros(4, 4)
    for _ in range(calls // 10):
        x.view(16)
    t0 = time.thread_time()
    for _ in range(calls):
        x.view(16)
    return (time.thread_time() - t0) / calls * 1e9


def _calibrated(host_ns: float) -> None:
    """Skip an absolute check when this host's per-op speed is unlike the calibration box's."""
    if host_ns > SLOW_HOST * CAL_HOST_NS:
        pytest.skip(
            f"a bare Tensor.view took {host_ns:.0f} ns (median) while measuring, "
            f"{host_ns / CAL_HOST_NS:.1f}x the {CAL_HOST_NS} ns of the box analytic.py's CPU host "
            "costs were measured on, which they do not scale by: an absolute time is not "
            "comparable here (the MoE-over-dense checks still ran)"
        )


@pytest.fixture(scope="module")
def probed_block_us():
    """The tiny Mixtral block, its dense twin and a tiny Qwen3-MoE block against a spec probed on
    this machine.

    Returns the probed spec; per model ((analytic fwd_us, bwd_us), (measured fwd_us,
    bwd_us)): the analytic profile planned with the probed spec, the measured profile of
    the same model (real weights) run with it; the host's per-op time while measuring
    (``host_view_ns``, the median over the rounds); and the measured MoE over its dense
    twin per phase, the median over the rounds of the two blocks measured back to back. The dense
    twin has the same attention and one MLP as wide as the two experts a token visits. The Qwen3-MoE
    (16 experts, top-4, every block MoE, head size 16, q/k norms) is the second family: another
    router and other routing sizes (1024 routed rows over 16 experts, against Mixtral's 512 over 8),
    none of which the CPU MoE constants were measured on.

    Three things keep the numbers about this machine and not about its neighbours:

    - **One thread**, for the probe and the profiles alike, so the spec describes the
      machine the profile runs on. On a shared 2-core box another process that takes a
      core stalls every OpenMP barrier of a 2-thread op for a time slice, and the MoE
      block runs many more small ops than its twin (measured under load: its forward
      swung 2-10x with two threads, the twin's did not).
    - **The thread's CPU clock** (``time.thread_time``) in place of ``perf_counter`` while
      probing and profiling, so time slices other processes take from us are not
      counted. With one thread every op runs on the calling thread (backward on CPU too:
      the autograd engine runs CPU work on the thread that called backward), so the CPU
      clock is the op's time. Measured at load 5 on 2 cores: the wall-clock probe gave
      46-63 GFLOP/s fp32 from run to run, the CPU clock 79-101, and a wall-clock 8x256
      block came out 2x its ops' sum. Cache and memory-bandwidth contention still count.
    - **The machine at its best on both sides.** The CPU clock still counts the spells in
      which this VM's core runs slow (a bare ``x.view`` took 1.1 us or 2.0-2.6 us by turns:
      spells of a second on an idle box, at times of minutes). A profile is the least over
      ``PROFILE_ROUNDS`` interleaved rounds, which filters the short spells, and a rate is
      the best of a probe every ``PROBE_EVERY`` rounds, the same statistic. With one probe
      ahead of 5 rounds (before 2026-12-06) a probe that fell in a slow spell read 93-117
      GFLOP/s where others read 130-158, which moved every analytic time with it (backward
      up to 1.27x of measured), and 5 rounds that all fell in slow spells made a measured
      block 1.3x slow (the Mixtral forward at 0.70x, once in CI and once in 12 runs here).
      A spell of minutes slows every round, and the small ops of these blocks more than
      the probe's large matmul (in one: dense forward 0.65x, backward 0.79x; MoE over
      dense still 0.97x and 0.95x), so the absolute checks skip when ``host_view_ns``
      shows one (``CAL_HOST_NS``), and the MoE-over-dense checks, which cancel it, run
      on every host: on pairs measured back to back, since the least of each alone can
      come from different states (0.71x once, in a spell that came and went).
    - **More rounds near the bound.** A spell the host-op time does not show can last a
      whole measurement: in the slow suite's process, with a host median of 1,196 ns, the
      Mixtral forward read 0.72x and the dense one 0.78x (0.79-0.93x on other runs). When
      any ratio is more than ``NEAR`` off, ``PROFILE_ROUNDS`` more rounds run, up to
      ``MAX_ROUNDS``, and every figure is the least (the best probe) over all of them: the
      same statistic over a longer window, the same 25% bound. A model that is wrong stays
      out: with the MoE costs at 0 the Mixtral forward read 0.74x after 24 rounds (0.70-0.71x
      in 12), still failing; the margin is thin, the absolute checks' power is a calibration's.
    """
    from protrain.planner.hardware.probe import probe

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(time, "perf_counter", time.thread_time)  # measure() and the probe read it
            # The CPU path a user runs: not the suite's emulated asynchronous device (its copy
            # threads share this core; tests/emulation.py), which the host costs never described.
            mp.setattr(transfer, "EMULATION", None)
            cfgs = {
                "dense": tiny("mistral"),
                "moe": tiny("mixtral"),
                "qwen3_moe": tiny("qwen3_moe", mlp_only_layers=[], num_hidden_layers=2),
            }
            models = {}
            for name, cfg in cfgs.items():
                torch.manual_seed(0)
                models[name] = build(cfg, device="cpu")
            spec, rounds, host = None, [], []
            while True:
                for r in range(
                    len(rounds), len(rounds) + PROFILE_ROUNDS
                ):  # interleaved: a busy moment hits all
                    host.append(host_view_ns())
                    if r % PROBE_EVERY == 0:
                        s = probe("cpu", quick=True)
                        spec = (
                            s
                            if spec is None
                            else msgspec.structs.replace(
                                spec,
                                matmul_fp32_flops_per_s=max(
                                    spec.matmul_fp32_flops_per_s, s.matmul_fp32_flops_per_s
                                ),
                                mem_bytes_per_s=max(spec.mem_bytes_per_s, s.mem_bytes_per_s),
                            )
                        )
                    rounds.append(
                        {
                            name: measured_block_us(model, B=PROFILE_B, T=PROFILE_T, spec=spec)
                            for name, model in models.items()
                        }
                    )
                analytic = {}
                for name, cfg in cfgs.items():
                    meta = build(cfg)
                    c = count_segments(
                        meta,
                        blocks=block_paths(meta),
                        micro_batch=PROFILE_B,
                        seq_len=PROFILE_T,
                        compute_dtype="float32",
                        spec=spec,
                    )
                    analytic[name] = (c[1].fwd.time_s * 1e6, c[1].bwd.time_s * 1e6)
                measured = {
                    name: tuple(min(r[name][i] for r in rounds) for i in (0, 1)) for name in cfgs
                }
                near = any(
                    abs(analytic[n][i] / measured[n][i] - 1) > NEAR for n in cfgs for i in (0, 1)
                )
                if not near or len(rounds) >= MAX_ROUNDS:
                    # (near the bound: PROFILE_ROUNDS more, later; the least over all of them)
                    break
    finally:
        torch.set_num_threads(threads)
    paired = tuple(statistics.median(r["moe"][i] / r["dense"][i] for r in rounds) for i in (0, 1))
    return (
        spec,
        {name: (analytic[name], measured[name]) for name in cfgs},
        statistics.median(host),
        paired,
    )


def _report(spec, times, host_ns) -> list[str]:
    lines = [
        f"probed spec: fp32 matmul {spec.matmul_fp32_flops_per_s / 1e9:.1f} GFLOP/s, "
        f"memory {spec.mem_bytes_per_s / 1e9:.1f} GB/s (1 thread, CPU clock); "
        f"host: a bare Tensor.view in {host_ns:.0f} ns, median (calibration box {CAL_HOST_NS})"
    ]
    for i, phase in enumerate(("fwd", "bwd")):
        row = []
        for name in times:
            a, m = times[name][0][i], times[name][1][i]
            row.append(f"{name} analytic {a:.0f} us, measured {m:.0f} us ({a / m:.2f}x)")
        ratio_a = times["moe"][0][i] / times["dense"][0][i]
        ratio_m = times["moe"][1][i] / times["dense"][1][i]
        lines.append(
            f"{phase}: {'; '.join(row)}; moe/dense analytic {ratio_a:.2f}, measured {ratio_m:.2f}"
        )
    return lines


@pytest.mark.bench
def test_moe_block_backward_time_against_a_probed_cpu_spec(probed_block_us, capsys):
    # Absolute, within 25%, MoE and dense: measured 0.89-1.04x (MoE) and 0.92-1.06x
    # (dense) in seven runs at load 2.5-5 on the 2-core box, probes of 79-101 GFLOP/s. With
    # the best of three probes and 12 rounds (the fixture's docstring), 14 runs on 2026-12-06
    # (four with a busy loop on the other core; probes of 150-163 GFLOP/s): 1.02-1.13x (MoE),
    # 1.03-1.11x (dense), where one probe ahead of 5 rounds had given 0.92-1.27x in 25 runs.
    spec, times, host_ns, _ = probed_block_us
    lines = _report(spec, times, host_ns)
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    _calibrated(host_ns)
    for name in ("moe", "dense"):
        (_, a), (_, m) = times[name]
        assert abs(a / m - 1) <= 0.25, (name, lines)


@pytest.mark.bench
def test_moe_over_dense_backward_against_a_probed_cpu_spec(probed_block_us):
    # The MoE block over its dense twin, analytic against measured: what the MoE charge
    # adds to a dense block, with the errors both share cancelling. Charging all eight
    # experts would make the analytic ratio ~2.6. Measured 1.21-1.24 analytic against
    # 1.17-1.32; on 2026-12-06, pairs measured back to back, 0.95-1.01x in ten runs and
    # 0.96-0.98x in five runs in a slow spell that skipped the absolute checks (the
    # fixture's docstring). Runs on any host.
    _, times, _, paired = probed_block_us
    ratio_a, ratio_m = times["moe"][0][1] / times["dense"][0][1], paired[1]
    assert abs(ratio_a / ratio_m - 1) <= 0.25, (ratio_a, ratio_m)


@pytest.mark.bench
def test_moe_over_dense_forward_against_a_probed_cpu_spec(probed_block_us):
    # The same in forward, where a cpu spec charges the MoE's own host costs
    # (CPU_MOE_EXPERT_US, CPU_MOE_ROW_US; the MoE forward test below), which were fitted as
    # this difference (the MoE block less its dense twin, tools/bench/moe_cpu.py) on other
    # shapes. 1.47-1.50 analytic against 1.42-1.61 measured in seven runs (1.17-1.18 against
    # 1.38-1.67 before them); on 2026-12-06, pairs measured back to back, 0.94-1.00x in ten
    # runs and 0.90-0.98x in five in a slow spell that skipped the absolute checks. Runs on
    # any host, but catches
    # only gross errors: with the two MoE costs set to 0 it reads ~0.78x, inside the bound
    # (the absolute check below fails on that). The Qwen3-MoE over the same twin is not a
    # pair (another router, head size and width; 1.17-1.20x): its absolute check covers it.
    _, times, _, paired = probed_block_us
    ratio_a, ratio_m = times["moe"][0][0] / times["dense"][0][0], paired[0]
    assert abs(ratio_a / ratio_m - 1) <= 0.25, (ratio_a, ratio_m)


@pytest.mark.bench
def test_dense_block_forward_time_against_a_probed_cpu_spec(probed_block_us):
    # Absolute, within 25%, the dense twin: the forward on a cpu spec charges the host's
    # eager costs, ops without a kernel (views, metadata: CPU_FORWARD_FREE_OP_US) and the
    # ledger's pack hook per saved tensor (CPU_SAVED_TENSOR_US), both measured apart from
    # this test (see their docstrings in planner/profiling/analytic.py). Before them 0.58-0.68x;
    # with them 0.86-0.98x in seven runs on a quiet box (probes of 81-97 GFLOP/s), 0.72-0.83x
    # with another of our processes on the second core (the backward test fails there too).
    spec, times, host_ns, _ = probed_block_us
    _calibrated(host_ns)
    (a, _), (m, _) = times["dense"]
    assert abs(a / m - 1) <= 0.25, _report(spec, times, host_ns)


@pytest.mark.bench
@pytest.mark.parametrize("family", ["moe", "qwen3_moe"])
def test_moe_block_forward_time_against_a_probed_cpu_spec(probed_block_us, family):
    # Absolute, within 25%, the tiny Mixtral block and a tiny Qwen3-MoE block (the second
    # family: 16 experts, top-4, its own router and q/k norms). Where the Mixtral forward's
    # gap came from, per block at B=4, T=64, one thread, CPU clock; the first diagnostic (a
    # probe of 90 GFLOP/s, ops timed one by one under a dispatch mode on the bare layer;
    # dense / MoE, us): measured 1165 / 1837, analytic 757 / 894:
    #   view and metadata ops, which analytic.py charged nothing:   +162 / +175 (41 / 43 ops)
    #   the executor: the CPU ledger's Python pack hook per saved
    #   tensor (on CPU always; 38 / 49 per block), segment events:    +59 / +288
    #   transformers' Python between the ops:                         +89 / +120
    #   SDPA (CPU flash kernel, head size 16: ~1/3 of the matmul
    #   rate, charged at 100% with the causal half cancelling):        +90 / +89
    #   routing ops (softmax, topk, sort, histc, index, index_put;
    #   per-row cost, charged as bytes + 5 us):                          0 / +183
    #   matmuls (grouped_mm at 64 rows per expert: ~0.85x of mm):      +15 / +96
    #   other elementwise (charged at DRAM bandwidth, run in cache):    -7 / -10
    # The first three rows are charged on a cpu spec by CPU_FORWARD_FREE_OP_US and
    # CPU_SAVED_TENSOR_US, which brought the dense twin within 25% (test above) and the
    # Mixtral block to 0.68-0.77x. The MoE's own rows (routing ops, the grouped GEMM) are
    # charged per routed expert bank by CPU_MOE_EXPERT_US per expert reached (8 here, 16
    # for the Qwen3-MoE) and CPU_MOE_ROW_US per routed row (512 here, 1024 for the
    # Qwen3-MoE): +376 / +736 us. Both were measured by tools/bench/moe_cpu.py on other
    # Mixtral shapes (the MoE block less its dense twin, against the analytic charge),
    # none of them these two blocks (see their docstrings in planner/profiling/analytic.py).
    # Measured in seven runs at load 3-6 on the 2-core box (probes of 84-95 GFLOP/s):
    # Mixtral 0.80-0.95x (median 0.85; 0.68-0.77x before), Qwen3-MoE 1.03-1.13x (median
    # 1.10; 0.71-0.73x before), the dense twin 0.84-0.97x in the same runs. By hand, the
    # same way (three runs): OLMoE 0.88-0.93x, Qwen2-MoE (a shared expert) 0.91-0.98x.
    # With the best of three probes and 12 rounds, 14 runs on 2026-12-06: Mixtral 0.85-0.93x,
    # Qwen3-MoE 1.02-1.13x, the dense twin 0.86-0.93x (one probe ahead of 5 rounds: Mixtral
    # 0.70-0.97x in 25 runs, 0.70x once in CI). Ten more with the slow-spell guard: Mixtral
    # 0.80-0.93x, Qwen3-MoE 0.97-1.10x, one run skipped (its host ran 1.9x slow). Without the
    # MoE host charges (both constants set to 0) the Mixtral forward reads 0.71x and fails here.
    spec, times, host_ns, _ = probed_block_us
    _calibrated(host_ns)
    (a, _), (m, _) = times[family]
    assert abs(a / m - 1) <= 0.25, (family, _report(spec, times, host_ns))


# ---------------------------------------------------------------------------- fit for one model

SPEC = msgspec.structs.replace(gpu_spec(mem_gib=1), name="small-1g", host_memory_bytes=8 * 2**30)


def test_fit_a_moe_model_reports_active_and_total_and_what_binds():
    model = build(tiny("mixtral"))
    layout = detect(model)
    big = fit_model(model, name="mixtral-tiny", spec=SPEC, seq_len=128)
    assert big.fits and [p.micro_batch for p in big.probes] == [1, 2, 4, 8, 16]
    assert (big.total_params, big.active_params) == (layout.total_params, layout.active_params)
    assert big.active_params < big.total_params
    assert big.binds.startswith("nothing up to micro-batch 16")
    text = render_model_fit(big)
    assert "0.5M total, 0.2M active per token (mixture of experts: top-2 of 8 in 2 blocks)" in text
    assert (
        "verdict: fits at micro-batch 16 x seq 128" in text
        and "routing: charged at balanced load" in text
    )

    # 6 MiB: micro-batches 1-4 fit (offloading and checkpointing more as they grow), 8 needs
    # 7.62 MiB at least, so device memory binds.
    budget = 6 * MiB
    mid = fit_model(model, name="mixtral-tiny", spec=SPEC, seq_len=128, budget_bytes=budget)
    assert [(p.micro_batch, p.fits) for p in mid.probes] == [
        (1, True),
        (2, True),
        (4, True),
        (8, False),
    ]
    assert mid.binds.startswith("device memory: needs 7.62 MiB at least, 6.00 MiB budget"), (
        mid.binds
    )
    best = mid.best
    assert best.plan.prediction.peak_memory_bytes <= budget and best.micro_batch == 4
    assert best.tokens_per_s == max(p.tokens_per_s for p in mid.probes)
    # Host memory: with a small device budget the states must go to the host, which is too small.
    host = fit_model(
        model,
        name="mixtral-tiny",
        spec=SPEC,
        seq_len=128,
        budget_bytes=budget,
        host_budget_bytes=MiB,
    )
    assert not host.fits and host.binds.startswith("host memory: needs")
    assert "verdict: does not fit, even at micro-batch 1: host memory" in render_model_fit(host)
    assert host_need_bytes(best.plan) > MiB


def test_fit_a_dense_model_has_all_parameters_active():
    model = build(tiny("mistral"))
    r = fit_model(model, name="mistral-tiny", spec=SPEC, seq_len=64, micro_batches=(1, 2))
    assert r.moe is None and r.active_params == r.total_params == count_params(model)
    assert "(dense: all active)" in render_model_fit(r) and "routing" not in render_model_fit(r)


def _llama_dir(tmp_path):
    """A local directory holding a tiny Llama's config.json (nothing downloaded)."""
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            dict(
                model_type="llama",
                architectures=["LlamaForCausalLM"],
                hidden_size=64,
                intermediate_size=172,
                num_hidden_layers=2,
                **ATTN,
            )
        )
    )
    return d


def test_fit_cli_with_an_hf_config(tmp_path):
    from click.testing import CliRunner

    from protrain.planner.commands.cli import main

    d = _llama_dir(tmp_path)
    runner = CliRunner()
    r = runner.invoke(main, ["fit", "--hf-config", str(d), "--hardware", "rtx3090", "--seq", "64"])
    assert r.exit_code == 0, r.output
    assert (
        "parameters: 0.1M (dense: all active)" in r.output
        and "verdict: fits at micro-batch 16" in r.output
    )
    r = runner.invoke(
        main,
        ["fit", "--hf-config", str(d), "--hardware", "rtx3090", "--seq", "64", "--budget", "64KiB"],
    )
    assert r.exit_code == 1 and "does not fit" in r.output and "HINT: a larger --budget" in r.output
    r = runner.invoke(main, ["fit", "--hardware", "rtx3090", "--blocks", "model.layers"])
    assert r.exit_code == 2 and "goes with --hf-config" in r.output


@pytest.mark.bench
def test_fit_cli_with_an_hf_config_under_20_seconds(tmp_path):
    from click.testing import CliRunner

    from protrain.planner.commands.cli import main

    d = _llama_dir(tmp_path)
    t0 = time.perf_counter()
    r = CliRunner().invoke(
        main, ["fit", "--hf-config", str(d), "--hardware", "rtx3090", "--seq", "64"]
    )
    seconds = time.perf_counter() - t0
    assert r.exit_code == 0, r.output
    assert seconds < 20


def test_run_model_fit_raises_after_the_report_when_nothing_fits(tmp_path):
    d = _llama_dir(tmp_path)
    lines: list[str] = []
    with pytest.raises(BudgetError, match="host memory") as e:
        run_model_fit(
            f"hf:{d}", "rtx3090", budget="1MiB", host_memory="1KiB", seq_len=64, echo=lines.append
        )
    assert "--host-memory" in str(e.value)
    assert "verdict: does not fit" in lines[-1]


# ---------------------------------------------------------------------------- the committed MoE
# configs

CONFIGS = Path(__file__).resolve().parent.parent / "plans" / "configs"


@pytest.mark.parametrize(
    "name,total_b,active_b",
    [
        ("mixtral-8x7b", 46.70, 12.88),  # Mistral AI: 46.7B total, 12.9B active
        ("qwen3-30b-a3b", 30.53, 3.35),  # Qwen: 30.5B total, 3.3B activated
        # OpenAI: 20.9B total, 3.6B active, which leaves out the input embedding (a lookup,
        # no FLOPs; 201088 x 2880 = 0.58B); we count every parameter a token touches.
        ("gpt-oss-20b", 20.91, 4.19),
    ],
)
def test_committed_moe_configs_total_and_active(name, total_b, active_b):
    if not (CONFIGS / name / "config.json").is_file():
        pytest.skip(f"plans/configs/{name} is not there")
    from protrain.planner.models.zoo import build as build_name

    model = build_name(f"hf:{CONFIGS / name}", device="meta")
    layout = detect(model)
    assert round(layout.total_params / 1e9, 2) == total_b
    assert round(layout.active_params / 1e9, 2) == active_b
    assert moe_blocks(layout, block_paths(model)) == block_paths(model)  # every block is MoE


@pytest.mark.slow
def test_fit_mixtral_8x7b_on_an_h200(capsys):
    # The real config on meta, end to end through the CLI: with the H200 spec's own host
    # share (1/8 of a DGX) the states do not fit the host; with 1.5 TiB they do.
    from click.testing import CliRunner

    from protrain.planner.commands.cli import main

    base = [
        "fit",
        "--hf-config",
        str(CONFIGS / "mixtral-8x7b"),
        "--hardware",
        "h200",
        "--seq",
        "4096",
    ]
    runner = CliRunner()
    r = runner.invoke(main, base)
    assert (
        r.exit_code == 1 and "verdict: does not fit, even at micro-batch 1: host memory" in r.output
    )
    r = runner.invoke(main, [*base, "--host-memory", "1.5TiB"])
    assert r.exit_code == 0, r.output
    assert (
        "46.70B total, 12.88B active per token (mixture of experts: top-2 of 8 in 32 blocks)"
        in r.output
    )
    assert "verdict: fits at micro-batch" in r.output
    with capsys.disabled():
        print(f"\n{r.output}")


@pytest.mark.bench
def test_fit_mixtral_8x7b_on_an_h200_under_two_minutes(capsys):
    # The two fits of the test above, timed end to end.
    from click.testing import CliRunner

    from protrain.planner.commands.cli import main

    base = ["fit", "--hf-config", str(CONFIGS / "mixtral-8x7b"), "--hardware", "h200"]
    runner = CliRunner()
    t0 = time.perf_counter()
    codes = [
        runner.invoke(main, [*base, "--seq", "4096", *extra]).exit_code
        for extra in ([], ["--host-memory", "1.5TiB"])
    ]
    seconds = time.perf_counter() - t0
    with capsys.disabled():
        print(f"\nmixtral-8x7b fit on an h200, twice: {seconds:.0f} s")
    assert codes == [1, 0] and seconds < 120
