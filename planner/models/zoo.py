"""Reference models (GPT-2, LLaMA) and the model zoo, written as plain PyTorch.

The models here are what the planner plans for and what the parity tests train
against, so they are deliberately ordinary: nn.Linear, nn.Embedding, LayerNorm or
RMSNorm, and ``F.scaled_dot_product_attention``, with Hugging Face's module names
(``transformer.h.3.attn.c_attn``, ``model.layers.7.self_attn.q_proj``) so that a
plan made for a zoo model reads like one made for the HF model of the same shape.

Two rules the runtime depends on:

- No buffers. The executor lays out parameters only (buffers are merely moved
  to the device at wrap), and models are built on ``meta`` and materialised later;
  a registered causal mask or RoPE cache would be left behind on ``meta``.
  Causality comes from ``is_causal=True`` and RoPE cos/sin are computed from
  positions in each forward. (Hugging Face models do hold RoPE buffers; ``hf.py``
  recomputes them when it materialises a model.)
- Every block maps ``(B, T, C) -> (B, T, C)``, its hidden states the first argument, so
  the executor can hook, checkpoint and profile any block the same way. Packed rows
  (``forward(idx, targets, position_ids)``) add keyword tensors only: the document mask
  (``base.document_mask``) and, for RoPE, the position ids. Being block arguments, a
  checkpointed block's recomputation gets them again, with nothing held on the model
  between the forward and the backward.

Configuration (the frozen config dataclasses and the ``ZOO`` table) is kept apart
from mechanism (the modules), as in gpt-fast's ``transformer_configs``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from protrain.plans.errors import ConfigError, did_you_mean

from .base import (  # noqa: F401  (re-exported: the zoo's users import them from here)
    HF_PREFIX,
    ModelInfo,
    block_paths,
    count_params,
    document_mask,
    find_block_list,
    is_hf_name,
    lm_loss,
    materialize,
    retie,
)

# ---------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class GPT2Config:
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int = 50257
    block_size: int = 1024  # longest sequence; the size of the learned position table
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm, as in GPT-2

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ConfigError(
                f"GPT2Config: n_embd={self.n_embd} is not divisible by n_head={self.n_head}",
                hint="choose n_head so that n_embd / n_head is a whole head size",
            )


@dataclass(frozen=True)
class LlamaConfig:
    n_layer: int
    n_head: int
    n_kv_head: int  # < n_head means grouped-query attention (GQA)
    dim: int
    ffn_dim: int  # hidden size of the SwiGLU MLP
    vocab_size: int = 32000
    max_seq_len: int = 4096
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dropout: float = 0.0  # attention dropout only, as in HF's LlamaAttention

    def __post_init__(self) -> None:
        if self.dim % self.n_head != 0 or (self.dim // self.n_head) % 2 != 0:
            raise ConfigError(
                f"LlamaConfig: dim={self.dim} / n_head={self.n_head} must be a whole, even head "
                "size",
                hint="RoPE rotates pairs of channels; choose n_head so the head size is even",
            )
        if self.n_head % self.n_kv_head != 0:
            raise ConfigError(
                f"LlamaConfig: n_head={self.n_head} is not a multiple of "
                f"n_kv_head={self.n_kv_head}",
                hint="each key/value head must serve a whole group of query heads",
            )


# The zoo: a named table, nothing else. Parameter counts (from count_params on
# meta) match the public models: gpt2 124.4M (tied head, learned positions),
# gpt2-xl 1.56B, llama-7b 6.74B, llama-70b 69.0B. The tiny entries are for tests.
ZOO: dict[str, GPT2Config | LlamaConfig] = {
    "gpt2-tiny": GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, block_size=128),
    "gpt2": GPT2Config(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPT2Config(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPT2Config(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPT2Config(n_layer=48, n_head=25, n_embd=1600),
    # Not released models: GPT-2 widened to ~4B and ~10B, the sizes memory papers use.
    "gpt2-4b": GPT2Config(n_layer=48, n_head=20, n_embd=2560),
    "gpt2-10b": GPT2Config(n_layer=48, n_head=32, n_embd=4096),
    "llama-tiny": LlamaConfig(
        n_layer=2, n_head=4, n_kv_head=2, dim=64, ffn_dim=172, vocab_size=256, max_seq_len=128
    ),
    "llama-7b": LlamaConfig(n_layer=32, n_head=32, n_kv_head=32, dim=4096, ffn_dim=11008),
    "llama-13b": LlamaConfig(n_layer=40, n_head=40, n_kv_head=40, dim=5120, ffn_dim=13824),
    # CodeLlama-34B: the only 34B LLaMA with public weights (GQA, 16k context).
    "llama-34b": LlamaConfig(
        n_layer=48,
        n_head=64,
        n_kv_head=8,
        dim=8192,
        ffn_dim=22016,
        max_seq_len=16384,
        rope_theta=1e6,
    ),
    "llama-70b": LlamaConfig(n_layer=80, n_head=64, n_kv_head=8, dim=8192, ffn_dim=28672),
    # Mistral's sliding-window attention (window 4096) is not modelled: for
    # seq_len <= 4096 it is identical to full causal attention, and we plan for that.
    "mistral-7b": LlamaConfig(
        n_layer=32,
        n_head=32,
        n_kv_head=8,
        dim=4096,
        ffn_dim=14336,
        max_seq_len=32768,
        rope_theta=1e6,
    ),
}


def _check_seq_len(T: int, limit: int, name: str) -> None:
    if T > limit:
        raise ConfigError(
            f"sequence length {T} exceeds the model's {name}={limit}",
            hint=f"use --seq {limit} or less (protrain profile/plan --seq)",
        )


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout: float
) -> torch.Tensor:
    """SDPA, causal: q, k, v (B, nh, T, hs) -> (B, nh, T, hs). ``mask`` (B, 1, T, T) bool for
    rows packed with several examples (``document_mask``: causal and within each example);
    None keeps the ``is_causal`` kernels, and so raw text its bits."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)


# ---------------------------------------------------------------------------
# GPT-2


class GPT2Attention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v at once
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = attend(q, k, v, mask, self.dropout if self.training else 0.0)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_drop(self.c_proj(y))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.c_fc(x), approximate="tanh")  # (B, T, 4C); GPT-2's "gelu_new"
        return self.drop(self.c_proj(h))  # (B, T, C)


class GPT2Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        # (B, T, C) -> (B, T, C); mask (B, 1, T, T) for packed rows, else None (causal)
        x = x + self.attn(self.ln_1(x), mask)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT2(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.reset_parameters()

    def tie_weights(self) -> None:
        """Make lm_head use the token embedding (one Parameter object, counted once).

        Called again by materialize(): ``to_empty`` replaces each module's
        parameters one module at a time, which gives the two modules two tensors.
        """
        self.lm_head.weight = self.transformer.wte.weight

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Initialise every parameter as GPT-2 does, from `generator` (default: torch's RNG)."""
        # GPT-2 paper: scale the init of the projections that write into the
        # residual stream by 1/sqrt(number of residual additions) = 1/sqrt(2 * n_layer).
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if module is self.lm_head:
                continue  # its weight is wte's, initialised once with the embedding
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = resid_std if name.endswith("c_proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std, generator=generator)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
            if isinstance(module, (nn.Linear, nn.LayerNorm)) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def protrain_blocks(self) -> list[str]:
        return [f"transformer.h.{i}" for i in range(len(self.transformer.h))]

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Loss (or logits (B, T, V) without targets) of idx (B, T); ``position_ids`` (B, T) for
        packed rows: positions restart, and attention stays within each example."""
        B, T = idx.shape
        _check_seq_len(T, self.config.block_size, "block_size")
        if position_ids is None:
            pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
            mask = None
        else:
            pos, mask = position_ids, document_mask(position_ids)  # (B, T), (B, 1, T, T) | None
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            # today's call for raw text (its checkpoint keeps x alone); the mask only when packed
            x = block(x) if mask is None else block(x, mask=mask)  # (B, T, C)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)  # (B, T, V)
        return logits if targets is None else lm_loss(logits, targets)


# ---------------------------------------------------------------------------
# LLaMA (also Mistral: same blocks, other shapes)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (a bf16 mean of squares is too coarse), cast back, then
        # scale: the order of HF's LlamaRMSNorm, so outputs match it bit for bit.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(
    T: int,
    head_dim: int,
    theta: float,
    device: torch.device,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles for positions 0..T-1, each (T, head_dim), fp32; for
    ``position_ids`` (B, T) at those positions, each (B, 1, T, head_dim) (one per head).

    Computed per forward rather than cached in a buffer (see the module docstring);
    the cost is one (T, head_dim/2) outer product per layer.
    """
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    )  # (hs/2,)
    if position_ids is None:
        pos = torch.arange(T, dtype=torch.float32, device=device)  # (T,)
        angles = torch.outer(pos, inv_freq)  # (T, hs/2)
    else:
        # the same products as the outer one, per row: a position's angles do not depend on
        # the row, so an example packed at offset o gets the angles it has alone
        angles = position_ids.float()[:, None, :, None] * inv_freq  # (B, 1, T, hs/2)
    # (T, hs) or (B, 1, T, hs): HF's layout, halves not pairs
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # HF's "rotate_half" convention: channel i pairs with channel i + hs/2, so
    # checkpoints converted for HF transformers load without permuting q/k.
    return x * cos + rotate_half(x) * sin  # (B, nh, T, hs)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.n_kv_head = cfg.n_kv_head
        self.head_dim = cfg.dim // cfg.n_head
        self.rope_theta = cfg.rope_theta
        self.dropout = cfg.dropout
        self.q_proj = nn.Linear(cfg.dim, cfg.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * self.head_dim, cfg.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, C = x.shape
        hs = self.head_dim
        q = self.q_proj(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.n_kv_head, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, self.n_kv_head, hs).transpose(1, 2)  # (B, nkv, T, hs)

        cos, sin = rope_cos_sin(T, hs, self.rope_theta, x.device, position_ids)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # (T, hs) or (B, 1, T, hs), as HF casts them
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        # GQA by repeating each k/v head for its group of query heads (HF's repeat_kv)
        # rather than SDPA's enable_gqa: every SDPA backend accepts the repeated
        # form, so the kernel (and the memory the planner predicts) does not change
        # with dtype. The cost is a copy of k and v the size of q.
        groups = self.n_head // self.n_kv_head
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)  # (B, nh, T, hs)
            v = v.repeat_interleave(groups, dim=1)  # (B, nh, T, hs)

        y = attend(q, k, v, mask, self.dropout if self.training else 0.0)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * hs)  # (B, T, C)
        return self.o_proj(y)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # SwiGLU: (B, T, C) -> (B, T, ffn) gated -> (B, T, C)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # (B, T, C) -> (B, T, C); packed rows: position_ids (B, T), mask (B, 1, T, T) or None
        x = x + self.self_attn(self.input_layernorm(x), position_ids, mask)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = nn.ModuleDict(
            dict(
                embed_tokens=nn.Embedding(cfg.vocab_size, cfg.dim),
                layers=nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer)),
                norm=RMSNorm(cfg.dim, cfg.norm_eps),
            )
        )
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)  # untied
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Initialise every parameter, from `generator` (default: torch's RNG).

        normal(0, 0.02) for every matrix and ones for the norms, as HF's
        LlamaPreTrainedModel does (initializer_range=0.02, no residual scaling).
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02, generator=generator)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def protrain_blocks(self) -> list[str]:
        return [f"model.layers.{i}" for i in range(len(self.model.layers))]

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Loss (or logits (B, T, V) without targets) of idx (B, T); ``position_ids`` (B, T) for
        packed rows: RoPE at those positions, and attention stays within each example."""
        _check_seq_len(idx.size(1), self.config.max_seq_len, "max_seq_len")
        x = self.model.embed_tokens(idx)  # (B, T, C)
        mask = None if position_ids is None else document_mask(position_ids)  # (B, 1, T, T)
        for block in self.model.layers:
            # today's call for raw text; packed rows pass their positions (and mask) to each block
            x = block(x) if position_ids is None else block(x, position_ids, mask)  # (B, T, C)
        x = self.model.norm(x)
        logits = self.lm_head(x)  # (B, T, V)
        return logits if targets is None else lm_loss(logits, targets)


# ---------------------------------------------------------------------------
# The block protocol: how the planner finds the blocks of any model


# ---------------------------------------------------------------------------
# Building, materialising, counting


def _config(name: str) -> GPT2Config | LlamaConfig:
    if name not in ZOO:
        raise ConfigError(
            f"unknown model {name!r}{did_you_mean(name, ZOO)}; the zoo has: {', '.join(ZOO)}",
            hint="run `protrain models` to list the models with their sizes, or name a local "
            "Hugging Face config as hf:PATH (a config.json or its directory)",
        )
    return ZOO[name]


def check_name(name: str) -> None:
    """Raise ``ConfigError`` unless ``name`` is a zoo model or a readable ``hf:`` config.

    Cheap: reads the config file for ``hf:`` names, builds nothing.
    """
    if is_hf_name(name):
        from . import hf

        hf.load_config(hf.parse_hf_name(name)[0])
    else:
        _config(name)


def build(
    name: str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    dropout: float | None = None,
    seed: int = 0,
) -> nn.Module:
    """Build zoo model `name` on `device`, initialised from `seed`, then cast to `dtype`.

    On ``device="meta"`` nothing is allocated (llama-70b builds in about a second
    and ~80 MiB). On a real device the model is built on meta and materialised
    there, so each parameter is written once, by our init, and ``build(name,
    seed=s)`` equals ``materialize(build(name, device="meta"), seed=s)`` bit for bit. The
    global torch RNG is not touched (see materialize). Parameters are initialised
    in fp32 and then cast, so a bf16 model is the rounding of the fp32 one.

    ``name`` may also be ``hf:PATH[#BLOCKS]``, a local Hugging Face config.json (or
    checkpoint directory): see ``planner/models/hf.py``, which keeps the same contract.
    """
    if is_hf_name(name):
        # A local Hugging Face config (planner/models/hf.py): same contract, transformers' init.
        from . import hf

        path, blocks = hf.parse_hf_name(name)
        return hf.build(path, blocks=blocks, device=device, dtype=dtype, dropout=dropout, seed=seed)
    cfg = _config(name)
    if dropout is not None:
        cfg = dataclasses.replace(cfg, dropout=dropout)
    with torch.device("meta"):
        model: nn.Module = GPT2(cfg) if isinstance(cfg, GPT2Config) else Llama(cfg)
    if torch.device(device).type != "meta":
        model = materialize(model, device=device, seed=seed)
    model = model.to(dtype)
    retie(model)
    return model


def describe(name: str) -> ModelInfo:
    """Size and shape of zoo model `name` (or ``hf:PATH``); counts parameters on meta, allocates
    nothing."""
    if is_hf_name(name):
        from . import hf

        return hf.describe(name)
    cfg = _config(name)
    n_params = count_params(build(name, device="meta"))
    if isinstance(cfg, GPT2Config):
        family, hidden, n_kv_head, max_seq_len = "gpt2", cfg.n_embd, cfg.n_head, cfg.block_size
    else:
        family, hidden, n_kv_head, max_seq_len = "llama", cfg.dim, cfg.n_kv_head, cfg.max_seq_len
    return ModelInfo(
        name=name,
        family=family,
        n_params=n_params,
        n_blocks=cfg.n_layer,
        hidden=hidden,
        n_head=cfg.n_head,
        n_kv_head=n_kv_head,
        vocab_size=cfg.vocab_size,
        max_seq_len=max_seq_len,
    )
