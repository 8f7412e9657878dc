"""Plan vs live model: a plan made for another model is refused, parameter by parameter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from protrain import plans
from protrain.executor.check import check, model_fingerprint, tied_pairs
from protrain.planner.models.zoo import GPT2, GPT2Config, block_paths, build
from protrain.plans import plan as P
from protrain.plans.errors import FingerprintError

EXAMPLE = Path(__file__).resolve().parent.parent / "plans" / "gpt2-tiny" / "example.json"


def test_example_plan_matches_gpt2_tiny_on_meta_and_cpu():
    plan = plans.load(EXAMPLE)
    check(plan, build("gpt2-tiny", device="meta"))
    check(plan, build("gpt2-tiny"))
    assert tied_pairs(build("gpt2-tiny")) == [["transformer.wte.weight", "lm_head.weight"]]


def test_plan_for_another_model_lists_the_differences():
    plan = plans.load(EXAMPLE)
    with pytest.raises(FingerprintError) as e:
        check(plan, build("llama-tiny", device="meta"))
    msg = str(e.value)
    assert "missing in the model: transformer.h.0.attn.c_attn.weight" in msg
    assert "not in the plan: lm_head.weight [256, 64] float32" in msg
    assert "more like this" in msg and "is not a module of the model" in msg
    assert "HINT:" in msg


def test_changed_shape_and_near_names():
    plan = plans.load(EXAMPLE)
    wider = GPT2(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=300, block_size=128))
    with pytest.raises(
        FingerprintError,
        match=r"shape of transformer.wte.weight: plan \[256, 64\], model \[300, 64\]",
    ):
        check(plan, wider)

    renamed = build("gpt2-tiny", device="meta")
    renamed.transformer.ln_final = renamed.transformer.ln_f
    del renamed.transformer.ln_f
    with pytest.raises(FingerprintError) as e:
        check(plan, renamed)
    assert "did you mean 'transformer.ln_final.weight'?" in str(e.value)


def test_dtype_and_untied_head_are_reported():
    plan = plans.load(EXAMPLE)
    with pytest.raises(
        FingerprintError,
        match="dtype of transformer.h.0.attn.c_attn.bias: plan float32, model bfloat16",
    ):
        check(plan, build("gpt2-tiny", device="meta", dtype=torch.bfloat16))
    untied = build("gpt2-tiny", device="meta")
    untied.lm_head.weight = torch.nn.Parameter(torch.empty(256, 64, device="meta"))
    with pytest.raises(FingerprintError, match="not in the plan: lm_head.weight"):
        check(plan, untied)


def test_fingerprint_covers_blocks_and_is_order_independent():
    model = build("gpt2-tiny", device="meta")
    blocks = block_paths(model)
    fp = model_fingerprint(model, blocks)
    assert fp == plans.load(EXAMPLE).model.fingerprint
    assert model_fingerprint(model, blocks[:1]) != fp
    sig = [(n, tuple(p.shape), "float32") for n, p in model.named_parameters()]
    assert P.fingerprint(list(reversed(sig)), blocks) == fp
