"""Mixture-of-experts models: which blocks route tokens to experts, and how we charge them.

A mixture-of-experts (MoE) block replaces the dense MLP by ``n_experts`` expert MLPs
and a router that sends every token to ``top_k`` of them (plus, in some families,
``n_shared_experts`` experts every token goes through). The planner must charge
such a model two different sizes:

- **memory: all parameters.** Every expert has weights, gradients and Adam states,
  whichever tokens it gets; the chunk layout, the cost model and the executor see
  the model's parameters as they are, so nothing here changes memory.
- **compute: the active parameters.** A token passes through ``top_k`` routed experts,
  the shared ones and the router, not through all ``n_experts``; see ``balanced_experts``
  for how the analytic profile (``analytic.py``) charges that, and
  [Note: routing imbalance] for what it leaves out. A measured profile needs nothing
  from this module: it times whatever routing happens.

Detection (``detect``) reads the built model, not only its config:

- **expert banks** are found by structure: Hugging Face (transformers ≥ 5) keeps each
  MoE block's experts as one module with 3-D parameters (``gate_up_proj`` or
  ``up_proj``, and ``down_proj``, leading dimension ``n_experts``) whose forward is
  chosen by ``config._experts_implementation`` (``use_experts_implementation``);
  ``n_experts`` is that leading dimension. Older code keeps an ``nn.ModuleList`` named
  ``experts``: recognised for parameter counts, refused by the analytic profile.
- **which blocks are MoE** is which blocks hold a bank. The config's layer-pattern
  fields (``first_k_dense_replace``/``moe_layer_freq`` in DeepSeek, ``decoder_sparse_step``/
  ``mlp_only_layers`` in Qwen-MoE, ``expert_layer_period``/``offset`` in Jamba) are what
  built that structure, so we read the structure and need not interpret each family's
  pattern.
- **top_k** and **n_shared_experts** come from the config (``CONFIG_TOP_K``,
  ``CONFIG_SHARED``), or from the router module's ``top_k``; a model whose config
  declares experts (``CONFIG_EXPERTS``) but has no bank we recognise is refused
  rather than charged for all of its experts.
- **dense banks**: 3-D expert weights outside transformers' experts interface whose
  forward runs every token through every expert (Llama 4's text experts: one ``bmm``,
  unrouted experts weighted by zero) are dense compute; such a model is planned as the
  dense model it runs as (``detect`` returns None).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from protrain.plans.errors import ConfigError

CONFIG_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""Config fields that give the number of routed experts (Mixtral/gpt-oss, Qwen-MoE/OLMoE,
DeepSeek, DBRX)."""
CONFIG_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "top_k")
"""Config fields that give the routed experts per token."""
CONFIG_SHARED = ("n_shared_experts", "num_shared_experts")
"""Config fields that give the always-active experts per MoE block (DeepSeek, GLM-4.5 …)."""


@dataclass(frozen=True)
class MoeLayout:
    """The experts of a model, as detected from its structure and config."""

    n_experts: int
    """Routed experts per MoE block."""
    top_k: int
    """Routed experts each token goes through."""
    n_shared_experts: int
    """Experts every token goes through (Qwen2-MoE's ``shared_expert`` counts as 1); dense
    compute."""
    banks: list[str]
    """Module paths of the routed expert banks, one per MoE block, in model order."""
    fused: bool
    """Banks are transformers' fused 3-D expert modules (else ``nn.ModuleList`` experts)."""
    total_params: int
    """Every parameter element, tied ones once: what memory is charged for."""
    routed_params: int
    """Parameter elements of all routed experts (all banks, all experts)."""

    @property
    def active_params(self) -> int:
        """Parameters one token's compute touches: all but the routed experts, plus
        ``top_k / n_experts`` of those (router, shared experts, attention, embeddings included)."""
        return (
            self.total_params
            - self.routed_params
            + self.routed_params * self.top_k // self.n_experts
        )


# ---------------------------------------------------------------------------- detection


def _config(model: nn.Module):
    cfg = getattr(model, "config", None)
    text = getattr(cfg, "get_text_config", None)
    return text() if callable(text) else cfg


def _config_int(cfg, fields: tuple[str, ...]) -> int | None:
    for f in fields:
        v = getattr(cfg, f, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _is_fused_bank(m: nn.Module) -> bool:
    """transformers' fused experts: 3-D weights, one row per expert, and the experts interface's
    flags."""
    down = getattr(m, "down_proj", None)
    up = getattr(m, "gate_up_proj", None)
    if up is None:
        up = getattr(m, "up_proj", None)
    return (
        isinstance(down, nn.Parameter)
        and isinstance(up, nn.Parameter)
        and down.dim() == 3
        and up.dim() == 3
        and down.shape[0] == up.shape[0]
        and hasattr(m, "has_gate")
        and hasattr(m, "is_transposed")
    )


def _is_dense_bank(m: nn.Module) -> bool:
    """3-D expert weights outside the experts interface, run on every token (Llama 4's
    ``Llama4TextExperts``: one ``bmm`` over all experts, the router's scores zero for
    the experts a token is not routed to). Its compute is dense, whatever the routing."""
    down = getattr(m, "down_proj", None)
    up = getattr(m, "gate_up_proj", None)
    if up is None:
        up = getattr(m, "up_proj", None)
    return (
        isinstance(down, nn.Parameter)
        and isinstance(up, nn.Parameter)
        and down.dim() == 3
        and up.dim() == 3
        and down.shape[0] == up.shape[0]
        and not (hasattr(m, "has_gate") or hasattr(m, "is_transposed"))
    )


def _is_expert_list(name: str, m: nn.Module) -> bool:
    return (
        name.rsplit(".", 1)[-1] == "experts"
        and isinstance(m, nn.ModuleList)
        and len(m) > 1
        and len({type(e) for e in m}) == 1
    )


def detect(model: nn.Module) -> MoeLayout | None:
    """The model's experts (module docstring), or None for a dense model.

    Raises ``ConfigError`` when the config declares routed experts the structure does
    not show, or when ``top_k`` cannot be found.
    """
    cfg = _config(model)
    banks: list[tuple[str, nn.Module]] = []
    fused = True
    for name, m in model.named_modules():
        if _is_fused_bank(m):
            banks.append((name, m))
    if not banks:
        banks = [(n, m) for n, m in model.named_modules() if _is_expert_list(n, m)]
        fused = False
    declared = _config_int(cfg, CONFIG_EXPERTS)
    if not banks and any(_is_dense_bank(m) for m in model.modules()):
        return None  # every token goes through every expert: dense compute, charged as it runs
    if not banks:
        if declared is not None and declared > 1:
            raise ConfigError(
                f"{type(model).__name__}: the config declares {declared} experts, but no expert "
                "bank was found (a module with 3-D gate_up_proj/up_proj and down_proj parameters, "
                "or an nn.ModuleList named experts)",
                "use transformers >= 5 for this family, whose experts are fused banks",
            )
        return None
    sizes = {m.down_proj.shape[0] if fused else len(m) for _, m in banks}
    if len(sizes) != 1:
        raise ConfigError(
            f"{type(model).__name__}: expert banks of different sizes {sorted(sizes)}",
            "protrain charges one n_experts per model",
        )
    (n_experts,) = sizes
    top_k = _config_int(cfg, CONFIG_TOP_K)
    if top_k is None:  # the router usually knows: MixtralTopKRouter.top_k
        parents = dict(model.named_modules())
        for name, _ in banks:
            parent = parents[name.rpartition(".")[0]]
            top_k = next(
                (c.top_k for c in parent.children() if isinstance(getattr(c, "top_k", None), int)),
                None,
            )
            if top_k is not None:
                break
    if top_k is None or not 1 <= top_k <= n_experts:
        raise ConfigError(
            f"{type(model).__name__}: {n_experts} experts per MoE block, but the number each token "
            f"is routed to is {'unknown' if top_k is None else top_k}",
            f"set one of {', '.join(CONFIG_TOP_K)} in the config (1..{n_experts})",
        )
    shared = _config_int(cfg, CONFIG_SHARED)
    if shared is None:  # Qwen2-MoE: one shared expert of this width
        shared = 1 if (getattr(cfg, "shared_expert_intermediate_size", 0) or 0) > 0 else 0
    seen: set[int] = set()
    routed = 0
    for _, m in banks:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                routed += p.numel()
    total = sum(p.numel() for p in model.parameters())
    return MoeLayout(
        n_experts=n_experts,
        top_k=top_k,
        n_shared_experts=shared,
        banks=[n for n, _ in banks],
        fused=fused,
        total_params=total,
        routed_params=routed,
    )


def moe_blocks(layout: MoeLayout, blocks: list[str]) -> list[str]:
    """The blocks (of ``blocks``) that hold an expert bank."""
    return [b for b in blocks if any(bank.startswith(b + ".") for bank in layout.banks)]


# ---------------------------------------------------------------------------- charging


def balanced_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """A fused expert bank's forward at perfectly balanced load; runs on ``meta``.

    The same signature and result shape as transformers' experts forward
    (``integrations/moe.py``, ``grouped_mm_experts_forward``), and the same kernels in
    the same order, forward and backward (tests/test_moe.py counts them), except the
    grouped GEMM: that one's groups are the experts' token
    counts, known only from the routing's values, which ``meta`` does not have. Here
    each expert gets ``ceil(S / n_experts)`` rows (``S = tokens x top_k``), and the
    grouped GEMM becomes one ``bmm`` over (n_experts, rows, in) — the same FLOPs
    (``2 S in out``), the same weights read (every expert's, once) and the same saved
    activations as the grouped GEMM at any routing, up to the rounding of ``S``.
    The routing's values are ignored (only its shape is used).
    """
    n_tok, top_k = top_k_index.shape
    hidden = hidden_states.size(-1)
    down = self.down_proj
    n_exp = down.shape[0]
    s = n_tok * top_k
    rows = -(-s // n_exp)
    expert_ids, perm = torch.sort(
        top_k_index.reshape(-1)
    )  # (S,): grouped by expert, as transformers sorts
    # The grouped GEMM's offsets, computed as transformers computes them (a cast, histc,
    # cumsum: three kernels in every MoE block's forward, on any device); the bmm does not
    # read them, but the block launches them, so they are charged. (E,)
    torch.cumsum(
        torch.histc(expert_ids.float(), bins=n_exp, min=0, max=n_exp - 1), dim=0, dtype=torch.int32
    )
    x = hidden_states[perm // top_k]  # (S, H)
    if rows * n_exp != s:
        x = torch.cat([x, x.new_zeros(rows * n_exp - s, hidden)])
    x = x.view(n_exp, rows, hidden)  # (E, rows, H)

    def bias_rows(bias: torch.Tensor) -> torch.Tensor:
        # Each row's expert bias, gathered by expert id as transformers gathers it (its
        # kernels: the gather, and in backward a scatter into the bias gradient).
        b = bias[expert_ids]  # (S, out)
        if rows * n_exp != s:
            b = torch.cat([b, b.new_zeros(rows * n_exp - s, b.size(-1))])
        return b.view(n_exp, rows, -1)  # (E, rows, out)

    up = self.gate_up_proj if self.has_gate else self.up_proj
    h = torch.bmm(x, up if self.is_transposed else up.transpose(1, 2))  # (E, rows, 2I or I)
    if self.has_bias:
        h.add_(
            bias_rows(self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)
        )  # in place, as theirs
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)  # (E, rows, I)
    y = torch.bmm(h, down if self.is_transposed else down.transpose(1, 2))  # (E, rows, H)
    if self.has_bias:
        y.add_(bias_rows(self.down_proj_bias))
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    y = y.reshape(rows * n_exp, hidden)  # (E x rows, H)
    if rows * n_exp != s:
        y = y[:s]  # (S, H); only when padded: a slice costs a slice_backward kernel
    weighted = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1)  # (S, H)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(s, device=perm.device)
    out = weighted[inv].view(n_tok, top_k, hidden).sum(dim=1)  # (N, H)
    return out.to(hidden_states.dtype)


def _balanced_forward_for(on_bank: Callable[[int, int, int], None] | None):
    """``balanced_forward``, telling ``on_bank`` (tokens, top_k, experts) first when given."""
    if on_bank is None:
        return balanced_forward

    def forward(self, hidden_states, top_k_index, top_k_weights):
        n_tok, top_k = top_k_index.shape
        on_bank(n_tok, top_k, self.down_proj.shape[0])
        return balanced_forward(self, hidden_states, top_k_index, top_k_weights)

    return forward


@contextlib.contextmanager
def balanced_experts(
    model: nn.Module, on_bank: Callable[[int, int, int], None] | None = None
) -> Iterator[MoeLayout | None]:
    """Within this context every routed expert bank of ``model`` runs ``balanced_forward``.

    Yields the layout (None for a dense model, which is left alone). The banks'
    forward is replaced on the instances only and restored on exit, so other models
    of the same class, and the model after the context, route as before.
    ``on_bank(n_tokens, top_k, n_experts)``, if given, is called at each bank call
    before its kernels run: the analytic profile charges a CPU's per-expert and
    per-routed-row costs there (``analytic.CPU_MOE_EXPERT_US``, ``CPU_MOE_ROW_US``).
    [Note: routing imbalance] says what the balanced charge leaves out.

    [Note: routing imbalance]
    The analytic profile charges every expert ``tokens x top_k / n_experts`` rows.
    With protrain's data and ZeRO-3 parallelism (every rank holds, in turn, every
    expert, and routes its own tokens; there is no expert parallelism) the routing
    cannot change the expert FLOPs or the saved activations: every token goes to
    exactly ``top_k`` experts (transformers' MoE training drops no tokens; there is no
    capacity factor to hit), so the rows summed over experts are ``tokens x top_k``
    whatever the split, and so are the bytes of the activations saved for backward.
    What the split can change is each expert's GEMM time, per the roofline of
    ``analytic.py``: expert ``e`` with ``L_e`` rows takes ``max(a L_e, w + b L_e)``
    (``a``: compute per row, ``w``: reading its weights, ``b``: its rows' bytes).
    Summed over experts this is at most ``a S + E w + b S``, and at balance it is at
    least half of that, so **routing imbalance at most doubles the expert GEMMs'
    time, and costs nothing while every expert's load stays above the ridge point**
    ``L_e >= w / (a - b)`` (compute-bound everywhere; for wide experts about
    ``rate x element bytes / (2 x bandwidth)`` rows, ``fit_model.ridge_rows``: ~170 on
    the H200 spec in bf16, against a mean load of ``B T top_k / E`` = 1024 for Mixtral
    at B=1, T=4096). We charge the balanced time and state the bound rather than pay
    the factor 2, which the routers' load-balancing losses exist to avoid.
    Not modelled on a ``gpu`` spec: the grouped kernels' lower efficiency on small groups
    (on our 2-core CPU box, torch's grouped_mm over 8 experts x 128 rows took 1.35x the
    time of one dense GEMM of the same FLOPs in a micro-benchmark); on any spec, expert
    parallelism. On a ``cpu`` spec the analytic profile does charge, in forward, what the grouped
    GEMM's per-expert GEMMs and the routing ops' per-row work (softmax and top-k over n_experts
    columns, the sort, the gathers) cost the host beyond the per-op model
    (``analytic.CPU_MOE_EXPERT_US``, ``CPU_MOE_ROW_US``, measured by `python -m tools.bench
    moe-cpu`).
    """
    layout = detect(model)
    if layout is None:
        yield None
        return
    if not layout.fused:
        raise ConfigError(
            f"{type(model).__name__}: its experts are an nn.ModuleList whose routing loop depends "
            "on the router's values, which the analytic profile (on meta) does not have",
            "measure the profile instead (`protrain profile` without --analytic), or use "
            "transformers >= 5, whose fused expert banks protrain charges at balanced load",
        )
    modules = dict(model.named_modules())
    saved: list[tuple[nn.Module, object]] = []
    try:
        for path in layout.banks:
            m = modules[path]
            saved.append((m, m.__dict__.get("forward")))
            m.forward = types.MethodType(_balanced_forward_for(on_bank), m)
        yield layout
    finally:
        for m, before in saved:
            if before is None:
                del m.forward
            else:
                m.forward = before
