"""Mixture-of-experts models (planner/moe.py) in the analytic profile, and ``fit`` for one model
(planner/fit_model.py).

What is pinned: detection across the transformers MoE families (experts, top-k, shared
experts, which blocks); the analytic profile charges the routed experts at top_k / n_experts
of their all-experts compute (FLOPs against the hand formula) while every expert stays a
parameter; the balanced stand-in saves what transformers' grouped GEMM saves; the
analytic block time against a measured CPU profile; the fit answer and its report.
Models are tiny transformers configs built on meta (nothing downloaded).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import msgspec
import pytest
import torch
from planfactory import gpu_spec
from torch import nn

from protrain.executor.errors import BudgetError, ConfigError
from protrain.executor.plan import POST, PRE
from protrain.planner import analytic
from protrain.planner.analytic import analytic_profile, count_segments
from protrain.planner.fit import host_need_bytes
from protrain.planner.fit_model import fit_model, render_model_fit, run_model_fit
from protrain.planner.models import block_paths, count_params
from protrain.planner.moe import balanced_experts, detect, moe_blocks
from protrain.planner.spec import find_spec

transformers = pytest.importorskip("transformers")
MiB = 2**20

H, FFN, E = 64, 128, 8  # hidden, expert width, experts: the tiny Mixtral
ATTN = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, vocab_size=256)


def tiny(family: str, **changes):
    """A transformers config of ``family`` with a few 64-wide layers."""
    if family == "mixtral":
        cfg = transformers.MixtralConfig(hidden_size=H, intermediate_size=FFN, num_hidden_layers=2,
                                         num_local_experts=E, num_experts_per_tok=2, **ATTN)
    elif family == "mistral":  # Mixtral's dense twin: one MLP as wide as top_k experts
        cfg = transformers.MistralConfig(hidden_size=H, intermediate_size=2 * FFN, num_hidden_layers=2, **ATTN)
    elif family == "qwen3_moe":  # block 0 dense (mlp_only_layers)
        cfg = transformers.Qwen3MoeConfig(hidden_size=H, intermediate_size=128, moe_intermediate_size=32,
                                          num_hidden_layers=3, num_experts=16, num_experts_per_tok=4,
                                          head_dim=16, mlp_only_layers=[0], **ATTN)
    elif family == "olmoe":
        cfg = transformers.OlmoeConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_experts=8,
                                       num_experts_per_tok=2, **{**ATTN, "num_key_value_heads": 4})
    elif family == "qwen2_moe":  # one shared expert beside the routed ones
        cfg = transformers.Qwen2MoeConfig(hidden_size=H, intermediate_size=128, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=64, num_hidden_layers=2,
                                          num_experts=8, num_experts_per_tok=2, **ATTN)
    elif family == "deepseek_v3":  # first block dense, one shared expert, grouped routing
        cfg = transformers.DeepseekV3Config(hidden_size=H, intermediate_size=128, moe_intermediate_size=32,
                                            num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                                            n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                                            q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                            qk_nope_head_dim=8, v_head_dim=16,
                                            **{**ATTN, "num_key_value_heads": 4})
    elif family == "gpt_oss":  # transposed banks with biases, its own gate (clamped SwiGLU)
        cfg = transformers.GptOssConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                                        num_local_experts=8, num_experts_per_tok=2, head_dim=16,
                                        sliding_window=256, **ATTN)
    else:
        raise AssertionError(family)
    for k, v in changes.items():
        setattr(cfg, k, v)
    cfg.use_cache = False
    return cfg


def build(cfg, device="meta"):
    """The protrain adapter of a transformers model built from ``cfg`` (on meta by default)."""
    from protrain.planner import hf

    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return hf.from_model(model)


# ---------------------------------------------------------------------------- detection


def routed(cfg) -> int:
    """Routed-expert parameters of one MoE block, by hand: gate+up (2 x FFN x H) and down (H x FFN)."""
    width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    n = getattr(cfg, "num_local_experts", None) or getattr(cfg, "n_routed_experts", None) or cfg.num_experts
    return n * 3 * cfg.hidden_size * width


@pytest.mark.parametrize("family,n_experts,top_k,shared,blocks", [
    ("mixtral", 8, 2, 0, [0, 1]),
    ("qwen3_moe", 16, 4, 0, [1, 2]),
    ("olmoe", 8, 2, 0, [0, 1]),
    ("qwen2_moe", 8, 2, 1, [0, 1]),
    ("deepseek_v3", 8, 2, 1, [1, 2]),
    ("gpt_oss", 8, 2, 0, [0, 1]),
])
def test_detects_the_experts_of_each_family(family, n_experts, top_k, shared, blocks):
    cfg = tiny(family)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)  # raw transformers: detect needs no adapter
    layout = detect(model)
    assert (layout.n_experts, layout.top_k, layout.n_shared_experts, layout.fused) == (n_experts, top_k, shared, True)
    paths = [f"model.layers.{i}" for i in range(cfg.num_hidden_layers)]
    assert moe_blocks(layout, paths) == [paths[i] for i in blocks]  # the dense blocks are left out
    assert layout.total_params == count_params(model)
    # gpt-oss's banks carry biases, (E, 2I) and (E, H), on top of the weights
    bias = len(blocks) * n_experts * (2 * cfg.intermediate_size + H) if family == "gpt_oss" else 0
    assert layout.routed_params == len(blocks) * routed(cfg) + bias
    assert layout.active_params == layout.total_params - layout.routed_params * (n_experts - top_k) // n_experts


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
    counts = count_segments(model, blocks=block_paths(model), micro_batch=B, seq_len=T, compute_dtype=dtype,
                            spec=spec or find_spec("cpu"))
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
    flops = {k: block_counts(tiny("mixtral", num_experts_per_tok=k), B=B, T=T)[blk] for k in (1, 2, 8)}
    for phase, factor in (("fwd", 1), ("bwd", 2)):
        f = {k: getattr(c, phase).flops for k, c in flops.items()}
        assert f[2] - f[1] == factor * per_expert_fwd
        assert f[8] - f[2] == 6 * factor * per_expert_fwd
        expert_top2 = 2 * factor * per_expert_fwd
        assert expert_top2 / (8 * factor * per_expert_fwd) == 2 / 8
        # ... and the rest of the block equals the dense twin's attention + the router (2·N·H·E)
        dense = getattr(block_counts(tiny("mistral"), B=B, T=T)[blk], phase).flops
        mlp = factor * 2 * N * 3 * H * (2 * FFN)  # the twin's MLP: as wide as two experts
        router = factor * 2 * N * H * E  # router logits (forward); input + weight gradient (backward)
        assert f[2] - expert_top2 == dense - mlp + router
    # Time follows: the experts' share at top-2 is about a quarter of the all-experts one.
    t = {k: c.fwd.time_s for k, c in flops.items()}
    assert 0.2 < (t[2] - t[1]) * 2 / ((t[8] - t[1]) * 8 / 7) < 0.3


def test_memory_is_charged_for_every_expert():
    # The profile lists every expert parameter (the planner lays all of them out in
    # chunks), while its compute is the top-k one above.
    model = build(tiny("mixtral"))
    p = analytic_profile(model, name="mixtral-tiny", blocks=block_paths(model), micro_batch=2, seq_len=32,
                         compute_dtype="bfloat16", spec=find_spec("h200"))
    assert p.model.n_params == count_params(model) == detect(model).total_params
    banks = [q for q in p.params if ".mlp.experts." in q.name]
    assert {tuple(q.shape) for q in banks} == {(E, 2 * FFN, H), (E, H, FFN)}
    assert all(q.uses == [q.name.rsplit(".mlp", 1)[0]] for q in banks)  # used by its own block
    # The instances' forward is theirs again, and the model still routes for real on CPU.
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_every_family_profiles_on_meta(family):
    model = build(tiny(family))
    p = analytic_profile(model, name=family, blocks=block_paths(model), micro_batch=2, seq_len=32,
                         compute_dtype="bfloat16", spec=find_spec("h200"))
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
    analytic.balanced_experts = lambda _model: contextlib.nullcontext()
    try:
        grouped = block_counts(cfg, dtype="bfloat16")
    finally:
        analytic.balanced_experts = stock
    blk = "model.layers.0"
    assert abs(grouped[blk].saved_bytes - balanced[blk].saved_bytes) <= 2 * 4 * E
    router_and_attention = grouped[blk].fwd.flops  # the grouped GEMMs count nothing
    assert balanced[blk].fwd.flops == router_and_attention + 2 * 2 * 32 * 2 * 3 * H * FFN


# ---------------------------------------------------------------------------- against a measured profile


def measured_block_us(model, *, B, T, rounds) -> tuple[float, float]:
    """The least over ``rounds`` measured profiles of the least block's (fwd_us, bwd_us)."""
    from protrain.planner.profile import measure

    blocks = block_paths(model)
    best = (float("inf"), float("inf"))
    for _ in range(rounds):
        p = measure(model, name="m", blocks=blocks, micro_batch=B, seq_len=T, compute_dtype="float32",
                    device="cpu", spec=find_spec("cpu"), iterations=5, warmup=1)
        seg = p.segments[1:-1]
        best = (min(best[0], *(s.fwd_us for s in seg)), min(best[1], *(s.bwd_us for s in seg)))
    return best


@pytest.mark.slow
def test_moe_block_time_against_a_measured_cpu_profile(capsys):
    # The cpu spec (plans/hardware/cpu.json) is a generic 4-core box, not this machine,
    # and the dense comparison itself is looser than 25% here (analytic ~0.4-0.5x the
    # measured block on a 2-core box: its matmul rate, and per-op costs above the
    # 5 us KERNEL_OVERHEAD_US), so we compare the MoE/dense ratio: the tiny Mixtral
    # block over its dense twin (same attention, one MLP as wide as the two experts a
    # token visits), analytic against measured; the machine's level cancels. Charging
    # all eight experts would make the analytic ratio 2.44 (fwd) and 2.59 (bwd).
    # Where the remaining gap comes from (the MoE is measured slower than charged): on
    # CPU the grouped GEMM runs one small GEMM per expert, and routing's bookkeeping ops
    # (sort, histc, cumsum, gathers) cost more per op than on a GPU. Slow-marked
    # because it is a timing test: on a loaded 2-core box the MoE block's many small
    # ops show a long tail (its forward's 90th percentile 4-9x its median, measured),
    # which can reach a 5-step median; the least of several interleaved rounds resists
    # short bursts, not a machine busy for the whole test.
    B, T, rounds = 4, 64, 5
    pair = {}
    for name, cfg in (("dense", tiny("mistral")), ("moe", tiny("mixtral"))):
        meta = build(cfg)
        c = count_segments(meta, blocks=block_paths(meta), micro_batch=B, seq_len=T, compute_dtype="float32",
                           spec=find_spec("cpu"))
        torch.manual_seed(0)
        pair[name] = ((c[1].fwd.time_s * 1e6, c[1].bwd.time_s * 1e6), build(cfg, device="cpu"))
    measured = {name: (0.0, 0.0) for name in pair}
    # One thread: on a shared 2-core box another process that takes a core stalls every
    # OpenMP barrier of a 2-thread op for a time slice, and the MoE block runs many more
    # small ops than its twin (measured under load: its forward swung 2-10x, the twin's not).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(rounds):  # interleaved, so that a busy moment hits both models
            for name, (_, model) in pair.items():
                m = measured_block_us(model, B=B, T=T, rounds=1)
                measured[name] = tuple(min(a, b) if a else b for a, b in zip(measured[name], m))
    finally:
        torch.set_num_threads(threads)
    lines = []
    for i, phase in enumerate(("fwd", "bwd")):
        a = {n: pair[n][0][i] for n in pair}
        m = {n: measured[n][i] for n in pair}
        ratio_a, ratio_m = a["moe"] / a["dense"], m["moe"] / m["dense"]
        lines.append(f"{phase}: analytic dense {a['dense']:.0f} us, moe {a['moe']:.0f} us; measured dense "
                     f"{m['dense']:.0f} us, moe {m['moe']:.0f} us; moe/dense analytic {ratio_a:.2f}, "
                     f"measured {ratio_m:.2f}")
        assert abs(ratio_a / ratio_m - 1) <= 0.25, lines[-1]
    with capsys.disabled():
        print("\n" + "\n".join(lines))


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
    assert "verdict: fits at micro-batch 16 x seq 128" in text and "routing: charged at balanced load" in text

    # 6 MiB: micro-batches 1-4 fit (offloading and checkpointing more as they grow), 8 needs
    # 7.62 MiB at least, so device memory binds.
    budget = 6 * MiB
    mid = fit_model(model, name="mixtral-tiny", spec=SPEC, seq_len=128, budget_bytes=budget)
    assert [(p.micro_batch, p.fits) for p in mid.probes] == [(1, True), (2, True), (4, True), (8, False)]
    assert mid.binds.startswith("device memory: needs 7.62 MiB at least, 6.00 MiB budget"), mid.binds
    best = mid.best
    assert best.plan.prediction.peak_memory_bytes <= budget and best.micro_batch == 4
    assert best.tokens_per_s == max(p.tokens_per_s for p in mid.probes)
    # Host memory: with a small device budget the states must go to the host, which is too small.
    host = fit_model(model, name="mixtral-tiny", spec=SPEC, seq_len=128, budget_bytes=budget,
                     host_budget_bytes=MiB)
    assert not host.fits and host.binds.startswith("host memory: needs")
    assert "verdict: does not fit, even at micro-batch 1: host memory" in render_model_fit(host)
    assert host_need_bytes(best.plan) > MiB


def test_fit_a_dense_model_has_all_parameters_active():
    model = build(tiny("mistral"))
    r = fit_model(model, name="mistral-tiny", spec=SPEC, seq_len=64, micro_batches=(1, 2))
    assert r.moe is None and r.active_params == r.total_params == count_params(model)
    assert "(dense: all active)" in render_model_fit(r) and "routing" not in render_model_fit(r)


def test_fit_cli_with_an_hf_config(tmp_path):
    from click.testing import CliRunner

    from protrain.planner.cli import main

    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=172,
        num_hidden_layers=2, **ATTN)))
    runner = CliRunner()
    t0 = time.perf_counter()
    r = runner.invoke(main, ["fit", "--hf-config", str(d), "--hardware", "rtx3090", "--seq", "64"])
    assert r.exit_code == 0, r.output
    assert time.perf_counter() - t0 < 20
    assert "parameters: 0.1M (dense: all active)" in r.output and "verdict: fits at micro-batch 16" in r.output
    r = runner.invoke(main, ["fit", "--hf-config", str(d), "--hardware", "rtx3090", "--seq", "64",
                             "--budget", "64KiB"])
    assert r.exit_code == 1 and "does not fit" in r.output and "HINT: a larger --budget" in r.output
    r = runner.invoke(main, ["fit", "--hardware", "rtx3090", "--host-memory", "1GiB"])
    assert r.exit_code == 2 and "go with --hf-config" in r.output


def test_run_model_fit_raises_after_the_report_when_nothing_fits(tmp_path):
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=172,
        num_hidden_layers=2, **ATTN)))
    lines: list[str] = []
    with pytest.raises(BudgetError, match="host memory") as e:
        run_model_fit(f"hf:{d}", "rtx3090", budget="1MiB", host_memory="1KiB", seq_len=64, echo=lines.append)
    assert "--host-memory" in str(e.value)
    assert "verdict: does not fit" in lines[-1]


# ---------------------------------------------------------------------------- the committed MoE configs

CONFIGS = Path(__file__).resolve().parent.parent / "plans" / "configs"


@pytest.mark.parametrize("name,total_b,active_b", [
    ("mixtral-8x7b", 46.70, 12.88),  # Mistral AI: 46.7B total, 12.9B active
    ("qwen3-30b-a3b", 30.53, 3.35),  # Qwen: 30.5B total, 3.3B activated
    # OpenAI: 20.9B total, 3.6B active, which leaves out the input embedding (a lookup,
    # no FLOPs; 201088 x 2880 = 0.58B); we count every parameter a token touches.
    ("gpt-oss-20b", 20.91, 4.19),
])
def test_committed_moe_configs_total_and_active(name, total_b, active_b):
    if not (CONFIGS / name / "config.json").is_file():
        pytest.skip(f"plans/configs/{name} is not there")
    from protrain.planner.models import build as build_name

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

    from protrain.planner.cli import main

    base = ["fit", "--hf-config", str(CONFIGS / "mixtral-8x7b"), "--hardware", "h200", "--seq", "4096"]
    runner = CliRunner()
    t0 = time.perf_counter()
    r = runner.invoke(main, base)
    assert r.exit_code == 1 and "verdict: does not fit, even at micro-batch 1: host memory" in r.output
    r = runner.invoke(main, [*base, "--host-memory", "1.5TiB"])
    assert r.exit_code == 0, r.output
    assert "46.70B total, 12.88B active per token (mixture of experts: top-2 of 8 in 32 blocks)" in r.output
    assert "verdict: fits at micro-batch" in r.output
    seconds = time.perf_counter() - t0
    assert seconds < 120
    with capsys.disabled():
        print(f"\n{r.output}({seconds:.0f} s)")
