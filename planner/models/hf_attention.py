"""Attention for Hugging Face models: causal SDPA where it is exact, the family's own code
elsewhere.

``ATTENTION`` is our own entry in transformers' attention registry (``hf._transformers``
registers it; ``hf.from_model`` selects it): causal ``F.scaled_dot_product_attention``
with GQA by repeating k/v heads, the call the zoo's models make, for every call it
computes exactly; the rest go to the family's own implementation (see
[Note: which attention]). Because ours has no entry in the *mask* registry,
transformers builds no mask at all (``masking_utils`` returns None for such
implementations): no T x T mask tensor per forward, and no data-dependent checks
(packed-sequence detection reads position values, which fails on ``meta`` and syncs
the device on CUDA). With the zoo's weights, a LLaMA built here gives the zoo's loss
and gradients bit for bit, and so does GPT-2 with the zoo's GELU kernel
(``gelu_pytorch_tanh``; GPT-2's own ``gelu_new`` differs in the last bits). Families
whose attention is their own code (BLOOM, MPT: no attention interface) keep it.

[Note: which attention]
Causal SDPA computes a layer's attention exactly when the layer asks for plain causal
attention: no mask of its own, no sliding window shorter than the sequence, no
keyword beyond the bookkeeping ones in ``_IGNORED_KWARGS`` (soft-capping, attention
sinks ``s_aux``, an ALiBi ``position_bias`` all say otherwise). Anything else goes,
call by call, to the family's own default implementation (``"sdpa"`` or
``"eager"``: what ``from_pretrained`` would pick, ``own_default``, recorded on every
module as ``OWN``; eager whenever the call needs soft-capping or sinks, which
transformers' SDPA path refuses or drops), with the mask transformers itself would
build for that layer (causal, or causal within the window) from positions alone:
nothing reads a token value, so the data path does not sync, and the decision
depends only on shapes and the config, so it is the same on meta, in the forward and
in a checkpointed block's recomputation. Where that implementation cannot be found
(a modeling file without ``eager_attention_forward``) the call is refused with a
ConfigError naming the layer and what it needed.

[Note: packed rows]
A packed micro-batch (``HFCausalLM.forward(idx, targets, position_ids)``) holds several
examples per row that must not attend to each other. ``HFCausalLM`` builds the mask once
per forward (``base.document_mask``: causal and within each example, from position ids
alone), tags it ``DOCUMENTS`` and passes it as the model's ``attention_mask``: transformers
hands a 4D mask to every layer as it is (``masking_utils``: "already prepared, or custom"),
and a checkpointed block's recomputation receives the same tensor among its arguments.
Here a tagged mask is ours, not one the family built: causal SDPA applies it (a sliding
window shorter than the row is and-ed in, as transformers' own window mask would), and any
other reason for the family's own code hands it the tagged mask, which that code applies
instead of building a causal one. Rows of one example each get no mask (``is_causal``).
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

from protrain.plans.errors import ConfigError

DOCUMENTS = "_protrain_documents"
"""Attribute set (True) on the document mask of packed rows: see [Note: packed rows]."""

ATTENTION = "protrain_causal"
"""Our attention implementation's name in transformers' registry (see the module docstring).

It must not contain "sdpa" (or "flash", "flex"): transformers takes any name holding
"sdpa" for its own SDPA and refuses it for families whose classes do not support SDPA."""


def causal_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal SDPA with the zoo's kernel choices, in transformers' attention-function signature.

    query (B, nh, T, hs), key/value (B, nkv, T, hs) → output (B, T, nh, hs), no weights.
    A call that asks for more than plain causal attention (see ``_needs_own``) is
    handed to the family's own implementation instead: see [Note: which attention].
    """
    T, S = query.size(-2), key.size(-2)  # S > T: a step of generate's KV cache
    documents = getattr(attention_mask, DOCUMENTS, False)  # see [Note: packed rows]
    if documents:
        window = kwargs.get("sliding_window")
        if window is not None and T > window:  # the layer's window, within each example
            t = torch.arange(T, device=query.device)  # (T,)
            attention_mask = attention_mask & (t[:, None] - t[None, :] < window)  # (B, 1, T, T)
        kwargs = {k: v for k, v in kwargs.items() if k != "sliding_window"}  # (in the mask now)
    reason = _needs_own(module, S, None if documents else attention_mask, kwargs)
    if reason is not None:
        return _own_attention(
            module, query, key, value, attention_mask, dropout, scaling, reason, **kwargs
        )
    groups = query.size(1) // key.size(1)
    if groups > 1:
        # Repeat k/v per query group (HF's repeat_kv, the zoo's choice) rather than
        # enable_gqa: every SDPA backend takes it, so the kernel does not change with dtype.
        key = key.repeat_interleave(groups, dim=1)  # (B, nh, T, hs)
        value = value.repeat_interleave(groups, dim=1)  # (B, nh, T, hs)
    hs = query.size(-1)
    # The kernel's own default scale when it is the usual 1/sqrt(hs), so the
    # arithmetic is the zoo's exactly; otherwise (GPT-2's per-layer scaling) the given one.
    default = scaling is None or scaling in (hs**-0.5, 1.0 / math.sqrt(hs))
    # SDPA's is_causal aligns the mask top-left; cached queries are the last T of S positions,
    # so they take the bottom-right one (no mask at all for one query).
    mask = (
        None if T in (1, S) else torch.ones(T, S, dtype=torch.bool, device=query.device).tril(S - T)
    )
    y = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask if documents else mask,
        dropout_p=dropout,
        is_causal=not documents and T == S,
        scale=None if default else scaling,
    )  # (B, nh, T, hs)
    return y.transpose(1, 2).contiguous(), None


# Keyword arguments a family's attention module may pass that plain causal attention
# may ignore: bookkeeping for caches, kernels we do not use and the model's outputs
# (MoE layers pass output_router_logits down). Any other keyword with a value
# (softcap, s_aux, position_bias, ...) sends the call to the family's own code.
_IGNORED_KWARGS = frozenset(
    {
        "position_ids",
        "cache_position",
        "output_attentions",
        "use_cache",
        "layer_idx",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "output_router_logits",
        "output_hidden_states",
        "return_dict",
    }
)


def _needs_own(
    module: nn.Module, T: int, attention_mask: torch.Tensor | None, kwargs: dict
) -> str | None:
    """Why this call needs the family's own attention, or None when causal SDPA computes it
    exactly."""
    if attention_mask is not None:
        # transformers makes no mask for our implementation (it is not in the mask
        # registry), so a mask here is one the family built itself (from positions,
        # never from token values): its own kernel applies it.
        return f"a mask of shape {tuple(attention_mask.shape)} built by the model"
    window = kwargs.get("sliding_window")
    if window is not None and T > window:
        return f"a sliding window of {window} < sequence length {T}"
    if kwargs.get("is_causal", True) is False or getattr(module, "is_causal", True) is False:
        return "non-causal attention"
    extra = sorted(
        k
        for k, v in kwargs.items()
        if v is not None and k not in _IGNORED_KWARGS and k not in ("sliding_window", "is_causal")
    )
    return f"{', '.join(extra)}" if extra else None


_EAGER_ONLY = ("softcap", "s_aux")
"""Keywords only a family's eager attention computes (transformers' SDPA path refuses or drops
them)."""

OWN = "_protrain_own_attention"
"""Attribute ``from_model`` sets on every module: the family's own implementation
(``"sdpa"`` or ``"eager"``) that ``causal_attention`` hands a call to when it must."""


def _own_attention(
    module: nn.Module, query, key, value, attention_mask, dropout, scaling, reason: str, **kwargs
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The call as the family's own default implementation makes it, with the mask transformers
    would build.

    See [Note: which attention]. The mask (causal, or causal within the sliding
    window) comes from transformers' own mask functions on positions alone, so it
    is the one the family would use and reads no token values.
    """
    # transformers is imported already: one of its modules is calling us.
    from transformers import masking_utils

    own = getattr(module, OWN, "eager")
    if any(v is not None for k, v in kwargs.items() if k in _EAGER_ONLY):
        # transformers' SDPA refuses soft-capping and ignores sinks; eager computes both
        own = "eager"
    if own == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as fn
    else:
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise ConfigError(
                f"{type(module).__name__}: this attention needs {reason}, which protrain's "
                "causal attention does not compute, and its module has no eager_attention_forward "
                "to hand it to: no exact path",
                "train another family (planner/models/hf_attention.py, [Note: which attention], "
                "says which work)",
            )
    causal = (
        kwargs.get("is_causal", True) is not False
        and getattr(module, "is_causal", True) is not False
    )
    if attention_mask is None and causal:
        T = query.size(-2)
        window = kwargs.get("sliding_window")
        mask_fn = (
            masking_utils.sliding_window_causal_mask_function(window)
            if window is not None
            else masking_utils.causal_mask_function
        )
        make = masking_utils.sdpa_mask if own == "sdpa" else masking_utils.eager_mask
        attention_mask = make(
            batch_size=query.size(0),
            q_length=T,
            kv_length=T,
            mask_function=mask_fn,
            local_size=window,
            dtype=query.dtype,
            device=query.device,
        )  # (B, 1, T, T) or None
    return fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def own_default(model) -> str:
    """The attention implementation transformers picks for this class by default: "sdpa" or
    "eager"."""
    try:
        own = model.get_correct_attn_implementation(None)
    except (ValueError, ImportError):
        own = "eager"
    return own if own in ("sdpa", "eager") else "eager"
