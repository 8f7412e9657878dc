"""The model zoo: sizes against the public models, the block protocol, meta builds, init,
training."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from protrain.planner.models.data import batches, load_tokens
from protrain.planner.models.zoo import (
    GPT2,
    ZOO,
    GPT2Config,
    LlamaConfig,
    apply_rope,
    block_paths,
    build,
    count_params,
    describe,
    materialize,
    rope_cos_sin,
)
from protrain.plans.errors import ConfigError

# Public parameter counts: HF model cards / papers (gpt2 124.4M counts the tied
# head once and includes the learned positions; LLaMA counts the untied head).
PUBLIC_N_PARAMS = {
    "gpt2": 124.4e6,
    "gpt2-xl": 1.56e9,
    "llama-7b": 6.74e9,
    "llama-70b": 69.0e9,
}


@pytest.mark.parametrize("name", list(PUBLIC_N_PARAMS))
def test_param_count_matches_public_model(name):
    n = count_params(build(name, device="meta"))
    assert abs(n / PUBLIC_N_PARAMS[name] - 1) < 0.005, f"{name}: {n=:,}"
    assert describe(name).n_params == n


@pytest.mark.parametrize("name", list(ZOO))
def test_every_zoo_model_builds_on_meta_with_its_blocks(name):
    model = build(name, device="meta")
    cfg = ZOO[name]
    paths = block_paths(model)
    assert len(paths) == cfg.n_layer
    assert len(set(paths)) == len(paths)
    for path in paths:
        model.get_submodule(path)  # raises AttributeError if the path is wrong
    assert all(p.is_meta for p in model.parameters())
    assert list(model.buffers()) == [], "the executor moves parameters only"
    info = describe(name)
    assert info.n_blocks == cfg.n_layer
    assert info.family == ("gpt2" if isinstance(cfg, GPT2Config) else "llama")


def test_block_paths_are_hf_names_in_order():
    assert block_paths(build("gpt2-tiny", device="meta")) == ["transformer.h.0", "transformer.h.1"]
    assert block_paths(build("llama-tiny", device="meta")) == ["model.layers.0", "model.layers.1"]


def _llama_70b_meta_build() -> tuple[float, int]:
    """(seconds to build llama-70b on meta, the process's peak RSS in bytes), in a fresh
    interpreter, so that nothing this test session allocated counts."""
    code = textwrap.dedent(
        """
        import resource, time
        from protrain.planner.models.zoo import build, count_params
        t0 = time.perf_counter()
        model = build("llama-70b", device="meta")
        build_s = time.perf_counter() - t0
        assert count_params(model) > 68e9
        # VmHWM: this process image's peak RSS. ru_maxrss would also count the pytest
        # parent's RSS, which a forked child carries until exec.
        hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]
        print(build_s, hwm)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    build_s, maxrss_kib = out.stdout.split()  # VmHWM is in KiB
    return float(build_s), int(maxrss_kib) * 1024


def test_llama_70b_meta_build_is_small():
    # VmHWM is the peak RSS of the whole process, so the ~0.2-0.4 GiB of
    # importing torch is included in what we bound: the total must stay < 1 GiB.
    _, rss = _llama_70b_meta_build()
    assert rss < 1024**3, f"peak RSS {rss / 2**20:.0f} MiB"


@pytest.mark.bench
def test_llama_70b_meta_build_is_fast():
    build_s, _ = _llama_70b_meta_build()
    assert build_s < 10.0


def test_gpt2_head_is_tied_after_build_and_materialize():
    def tied(m):
        return m.lm_head.weight is m.transformer.wte.weight

    assert tied(build("gpt2-tiny"))
    assert tied(build("gpt2-tiny", device="meta"))
    assert tied(build("gpt2-tiny", dtype=torch.bfloat16))
    model = materialize(build("gpt2-tiny", device="meta"), device="cpu", seed=3)
    assert tied(model)
    assert model.lm_head.bias is None
    # Counted once: the tied head adds nothing.
    assert count_params(model) == sum(p.numel() for n, p in model.named_parameters())


def test_llama_head_is_untied():
    model = build("llama-tiny")
    assert model.lm_head.weight is not model.model.embed_tokens.weight


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_init_is_deterministic_from_seed_and_leaves_global_rng_alone(name):
    rng_before = torch.get_rng_state()
    a, b, c = build(name, seed=1), build(name, seed=1), build(name, seed=2)
    assert torch.equal(torch.get_rng_state(), rng_before)
    for (na, pa), (_, pb), (_, pc) in zip(
        a.named_parameters(), b.named_parameters(), c.named_parameters()
    ):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=na)
        if pa.dim() == 2:  # norms and biases are constants; matrices must differ
            assert not torch.equal(pa, pc), na
    # build on a real device == build on meta, then materialize with the same seed.
    m = materialize(build(name, device="meta"), seed=1)
    for (na, pa), (_, pm) in zip(a.named_parameters(), m.named_parameters()):
        torch.testing.assert_close(pa, pm, rtol=0, atol=0, msg=na)


def test_gpt2_init_values():
    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_layer=8, n_head=4, n_embd=256, vocab_size=512, block_size=64))
    blk = model.transformer.h[0]
    assert blk.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert blk.attn.c_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)  # 1/sqrt(2*8)
    assert blk.mlp.c_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.all(blk.attn.c_attn.bias == 0)
    assert torch.all(blk.ln_1.weight == 1) and torch.all(blk.ln_1.bias == 0)


def test_dtype_and_dropout_options():
    model = build("llama-tiny", dtype=torch.bfloat16, dropout=0.1)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.dropout == 0.1
    assert ZOO["llama-tiny"].dropout == 0.0  # the table itself is unchanged


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_forward_shapes_and_finite_loss(name):
    model = build(name)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (2, 16), generator=gen)
    targets = torch.randint(0, 256, (2, 16), generator=gen)
    assert model(idx).shape == (2, 16, 256)
    loss = model(idx, targets=targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    # An untrained model predicts about uniformly: loss close to ln(256) = 5.55.
    assert loss.item() == pytest.approx(5.55, abs=0.3)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_attention_is_causal(name):
    model = build(name).eval()
    idx = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[0, 8] = (idx[0, 8] + 1) % 256
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=0, atol=0)  # the past never sees it
    assert not torch.equal(a[:, 8:], b[:, 8:])


def test_rope_scores_depend_only_on_relative_position():
    # The defining property of RoPE: <R(m) q, R(n) k> is a function of m - n.
    cos, sin = rope_cos_sin(16, 8, 10000.0, torch.device("cpu"))  # (T, hs)
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    rq = apply_rope(q.expand(16, 8), cos.double(), sin.double())  # (T, hs)
    rk = apply_rope(k.expand(16, 8), cos.double(), sin.double())  # (T, hs)
    scores = rq @ rk.T  # (T, T); scores[m, n] = <R(m) q, R(n) k>
    torch.testing.assert_close(torch.diagonal(scores, 3)[1:], torch.diagonal(scores, 3)[:-1])
    torch.testing.assert_close(rq[0], q)  # position 0 is not rotated


def test_sequence_longer_than_the_model_is_a_config_error():
    model = build("gpt2-tiny")
    with pytest.raises(ConfigError, match="block_size=128"):
        model(torch.zeros(1, 129, dtype=torch.long))


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_loss_falls_on_embedded_corpus(name):
    model = build(name, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = batches(load_tokens(), micro_batch=8, seq_len=64, seed=0)
    losses = []
    for _ in range(50):
        x, y = next(data)
        loss = model(x, targets=y)
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    # From ~5.5 (uniform over 256 bytes) byte frequencies alone bring it under ~3.5.
    assert last < first - 1.0, f"{first=:.3f} {last=:.3f}"


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.fc(x)


class _UserModel(nn.Module):
    """A model without protrain_blocks: a short mixed list and the real block stack."""

    def __init__(self):
        super().__init__()
        self.stem = nn.ModuleList([nn.Linear(8, 8), nn.ReLU()])  # mixed classes: not blocks
        self.body = nn.Module()
        self.body.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.heads = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])  # shorter


def test_block_paths_fallback_finds_the_longest_uniform_modulelist():
    model = _UserModel()
    paths = block_paths(model)
    assert paths == ["body.blocks.0", "body.blocks.1", "body.blocks.2"]
    assert all(isinstance(model.get_submodule(p), _Block) for p in paths)


def test_block_paths_fallback_on_a_bare_modulelist():
    stack = nn.ModuleList(_Block() for _ in range(2))
    assert block_paths(stack) == ["0", "1"]


def test_block_paths_without_blocks_is_a_config_error():
    with pytest.raises(ConfigError, match="--blocks"):
        block_paths(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))


@pytest.mark.parametrize(("name", "suggestion"), [("gpt2-xxl", "gpt2-xl"), ("lama-7b", "llama-7b")])
def test_unknown_model_name_suggests_the_closest(name, suggestion):
    with pytest.raises(ConfigError) as info:
        build(name)
    assert f"did you mean {suggestion!r}" in str(info.value)
    assert "llama-70b" in str(info.value)  # lists the valid choices
    assert info.value.hint is not None and "protrain models" in info.value.hint


def test_bad_config_is_a_config_error():
    with pytest.raises(ConfigError, match="n_kv_head"):
        LlamaConfig(n_layer=1, n_head=4, n_kv_head=3, dim=64, ffn_dim=128)
    with pytest.raises(ConfigError, match="n_head"):
        GPT2Config(n_layer=1, n_head=5, n_embd=64)


def test_materialize_needs_reset_parameters():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2))  # Sequential has no reset_parameters()
    with pytest.raises(ConfigError, match="reset_parameters"):
        materialize(model)
