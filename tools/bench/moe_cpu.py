"""The CPU host costs of a mixture-of-experts block's forward, measured: where
``planner/profiling/analytic.py``'s ``CPU_MOE_EXPERT_US`` and ``CPU_MOE_ROW_US`` come from (issue
20).

On a CPU, transformers' MoE path (router softmax and top-k over a few experts per row,
the sort, the row gathers and the un-permute, a grouped GEMM that runs one small GEMM
per expert on weights it fetches cold) costs more than the per-op roofline of
``analytic.py`` charges. What it adds is measured here as a difference of differences,
so that what a MoE block shares with a dense one (attention, norms, the executor's
hooks) cancels:

    extra = (measured - analytic)(MoE block) - (measured - analytic)(dense twin)

for Mixtral-shaped configs (the twin: Mistral, one MLP as wide as the ``top_k`` experts
a token visits, the same attention). Each block's forward is a measured profile
(``profile.measure``, the executor, one thread, the thread's CPU clock: the test's
conditions, ``tests/test_moe.py::probed_block_us``), the least over blocks and
``--rounds`` interleaved rounds; the analytic one is planned with the spec probed the
same way, with both MoE constants at 0. A least-squares fit of
``extra = CPU_MOE_EXPERT_US x active experts + CPU_MOE_ROW_US x routed rows`` (active
experts: ``min(n_experts, rows)``, routed rows: ``tokens x top_k``) gives the two.

The configs leave out what the tests check (the tiny Mixtral at B=4, T=64 and any
Qwen3-MoE) and keep T <= 64, where the dense twin's forward is within 25%: past that
SDPA at small head sizes dominates both blocks and the difference is noise.

    python -m tools.bench moe-cpu                 # the default configs, 2 rounds
    python -m tools.bench moe-cpu --rounds 4      # steadier on a shared box
"""

from __future__ import annotations

import time

from tools.bench import harness

CONFIGS = [  # (hidden, expert width, experts, top_k, micro-batch, seq len)
    (48, 96, 8, 1, 1, 1),
    (48, 96, 8, 1, 4, 32),
    (32, 128, 4, 2, 1, 64),
    (128, 32, 8, 1, 2, 64),
    (128, 64, 16, 4, 2, 32),
    (32, 96, 8, 2, 2, 64),
    (64, 32, 32, 4, 2, 64),
    (96, 96, 12, 3, 8, 64),
]
ATTN = dict(
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, vocab_size=256
)


def _pair(H: int, W: int, E: int, k: int):
    """A 2-layer Mixtral config (expert width W) and its dense twin (Mistral, MLP width k x W)."""
    import transformers

    moe = transformers.MixtralConfig(
        hidden_size=H,
        intermediate_size=W,
        num_hidden_layers=2,
        num_local_experts=E,
        num_experts_per_tok=k,
        **ATTN,
    )
    dense = transformers.MistralConfig(
        hidden_size=H, intermediate_size=k * W, num_hidden_layers=2, **ATTN
    )
    for c in (moe, dense):
        c.use_cache = False
    return moe, dense


def _build(cfg, device: str):
    import torch
    import transformers

    from protrain.planner.models import hf

    with torch.device(device):
        return hf.from_model(transformers.AutoModelForCausalLM.from_config(cfg))


def main(argv: list[str] | None = None, name: str = "moe-cpu") -> int:
    ap = harness.parser(name, __doc__, rounds=2, what="interleaved measured rounds per config")
    args = ap.parse_args(argv)
    harness.no_baseline(ap, args)
    if args.write:
        ap.error("moe-cpu prints the constants to copy into analytic.py; it writes no section")

    import numpy as np
    import torch

    from protrain.planner.commands.measure import measure
    from protrain.planner.hardware.probe import probe
    from protrain.planner.models.zoo import block_paths
    from protrain.planner.profiling import analytic

    torch.set_num_threads(1)
    time.perf_counter = time.thread_time  # measure() and the probe read it: the thread's CPU clock
    spec = probe("cpu", quick=True)
    analytic.CPU_MOE_EXPERT_US = analytic.CPU_MOE_ROW_US = 0.0  # measure what they must add
    print(
        f"probed: fp32 matmul {spec.matmul_fp32_flops_per_s / 1e9:.1f} GFLOP/s, "
        f"memory {spec.mem_bytes_per_s / 1e9:.1f} GB/s (1 thread, CPU clock)"
    )
    rows, extra = [], []
    for H, W, E, k, B, T in CONFIGS:
        res = {}
        models = {}
        for name, cfg in zip(("moe", "dense"), _pair(H, W, E, k)):
            meta = _build(cfg, "meta")
            c = analytic.count_segments(
                meta,
                blocks=block_paths(meta),
                micro_batch=B,
                seq_len=T,
                compute_dtype="float32",
                spec=spec,
            )
            torch.manual_seed(0)
            models[name] = _build(cfg, "cpu")
            res[name] = [c[1].fwd.time_s * 1e6, float("inf")]
        for _ in range(args.rounds):  # interleaved, so that a busy moment hits both
            for name, model in models.items():
                p = measure(
                    model,
                    name=name,
                    blocks=block_paths(model),
                    micro_batch=B,
                    seq_len=T,
                    compute_dtype="float32",
                    device="cpu",
                    spec=spec,
                    iterations=5,
                    warmup=1,
                )
                res[name][1] = min(res[name][1], *(s.fwd_us for s in p.segments[1:-1]))
        (am, mm), (ad, md) = res["moe"], res["dense"]
        S = B * T * k
        rows.append((min(E, S), S))
        extra.append((mm - am) - (md - ad))
        print(
            f"H={H:3d} W={W:3d} E={E:2d} top-{k} B={B} T={T:3d}: MoE {am:5.0f} / {mm:5.0f} us "
            f"({am / mm:.2f}x), dense {ad:5.0f} / {md:5.0f} us ({ad / md:.2f}x), extra "
            f"{extra[-1]:+5.0f} us"
        )
    coef, *_ = np.linalg.lstsq(np.array(rows, float), np.array(extra), rcond=None)
    print(f"CPU_MOE_EXPERT_US = {coef[0]:.1f}, CPU_MOE_ROW_US = {coef[1]:.3f}")
    return 0
