"""Mixture-of-experts kernels for Hugging Face models: transformers' grouped GEMM, also on meta.

``EXPERTS`` is our entry in transformers' experts registry (``hf._transformers``
registers it; ``hf.from_model`` selects it for classes with fused expert banks):
transformers' ``grouped_mm`` experts (tokens sorted by expert, one grouped GEMM;
nothing read back to the host), which also runs on ``meta`` in fp32
(``grouped_experts``). Not transformers' ``eager`` experts, whose loop over the
experts hit reads the routing back every layer. How the planner *charges* an expert
bank (at balanced load, on meta) is ``planner/models/moe.py``'s job, not this module's.
"""

from __future__ import annotations

import torch
from torch import nn

EXPERTS = "protrain_grouped_mm"
"""Our mixture-of-experts implementation's name in transformers' experts registry."""


def grouped_experts(
    module: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' ``grouped_mm`` experts, runnable on ``meta`` in any dtype.

    hidden_states (N, C), top_k_index/top_k_weights (N, k) → (N, C). On a real device
    this *is* ``grouped_mm_experts_forward`` (sort by expert, one grouped matmul,
    offsets from ``histc``: nothing reads a routing decision back to the host). Only
    on ``meta`` in a dtype other than bf16, where torch's meta kernel for grouped_mm
    applies the CUDA kernel's bf16-only rule (the CPU kernel computes fp32), the
    grouped matmuls run in bf16 and are cast back: shapes are all meta has, and the
    analytic profile of an fp32 MoE then counts those two casts (an estimate).
    """
    from transformers.integrations import moe

    if hidden_states.device.type != "meta" or hidden_states.dtype == torch.bfloat16:
        return moe.grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    exact = moe._grouped_mm

    def bf16_grouped_mm(input, weight, offs):
        return exact(input.to(torch.bfloat16), weight.to(torch.bfloat16), offs=offs).to(input.dtype)

    moe._grouped_mm = bf16_grouped_mm  # only for this meta call; restored below
    try:
        return moe.grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    finally:
        moe._grouped_mm = exact
