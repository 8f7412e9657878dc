"""Hugging Face models (planner/models/hf.py): zoo parity, executor parity, discovery, errors,
weights, planning.

Needs the optional extra (``pip install transformers``); without it every test that
builds a transformers model skips, and the ones that do not (the keyword-block
executor test, the name helpers) still run. Tiny configs are written as plain JSON
into tmp directories, as a downloaded ``config.json`` would be; nothing touches the hub.
"""

from __future__ import annotations

import copy
import json
import resource
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from harness import PARITY_MATRIX, assert_same_state, lockstep
from harness import make_plan as harness_plan

from protrain import plans
from protrain.executor import AdamWConfig, wrap
from protrain.executor.check import model_fingerprint
from protrain.planner.models import zoo as models
from protrain.planner.models.zoo import block_paths, build, lm_loss
from protrain.planner.search.emit import emit
from protrain.plans import plan as P
from protrain.plans.errors import ConfigError


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from protrain.planner.models import hf

    return hf


# Plain config.json contents. bos/eos inside the byte vocabulary keeps transformers quiet.
CONFIGS = {
    "gpt2": dict(
        model_type="gpt2",
        architectures=["GPT2LMHeadModel"],
        vocab_size=256,
        n_embd=64,
        n_layer=4,
        n_head=2,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "llama": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
    ),
    "mistral": dict(
        model_type="mistral",
        architectures=["MistralForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=32,
    ),
    "opt": dict(
        model_type="opt",
        architectures=["OPTForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=3,
        num_attention_heads=2,
        max_position_embeddings=64,
        word_embed_proj_dim=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
    ),
    "qwen2": dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    ),
}
BLOCK_LISTS = {
    "gpt2": "transformer.h",
    "llama": "model.layers",
    "mistral": "model.layers",
    "opt": "model.decoder.layers",
    "qwen2": "model.layers",
}


def write_config(directory, fields: dict):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(fields, indent=2))
    return directory


@pytest.fixture(scope="module")
def cfg_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: write_config(root / arch, fields) for arch, fields in CONFIGS.items()}


# ---------------------------------------------------------------------------- zoo parity


def zoo_twin(arch: str):
    """The zoo's tiny model and an HF model of the same shape holding the same weights."""
    if arch == "gpt2":
        # gelu_pytorch_tanh is F.gelu(approximate="tanh"), the zoo's kernel (see the
        # gelu_new test below for GPT-2's own activation).
        fields = dict(
            model_type="gpt2",
            architectures=["GPT2LMHeadModel"],
            vocab_size=256,
            n_embd=64,
            n_layer=2,
            n_head=2,
            n_positions=128,
            activation_function="gelu_pytorch_tanh",
            bos_token_id=0,
            eos_token_id=0,
        )
        zoo = build("gpt2-tiny", seed=7)
    else:
        fields = dict(
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            vocab_size=256,
            hidden_size=64,
            intermediate_size=172,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
        )
        zoo = build("llama-tiny", seed=7)
    return zoo, fields


def load_zoo_weights(hf_model, zoo: nn.Module) -> None:
    """Copy the zoo's state dict into the HF model; GPT-2's Conv1D stores weights as (in, out)."""
    from transformers.pytorch_utils import Conv1D

    conv = {f"{n}.weight" for n, m in hf_model.named_modules() if isinstance(m, Conv1D)}
    sd = {k: (v.t().contiguous() if k in conv else v) for k, v in zoo.state_dict().items()}
    result = hf_model.load_state_dict(sd, strict=True)
    assert not result.missing_keys and not result.unexpected_keys


def grads_by_hf_name(hf_model, zoo: nn.Module):
    from transformers.pytorch_utils import Conv1D

    conv = {f"{n}.weight" for n, m in hf_model.named_modules() if isinstance(m, Conv1D)}
    ours = dict(hf_model.named_parameters())
    for name, p in zoo.named_parameters():
        yield name, ours[name].grad, (p.grad.t() if name in conv else p.grad)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_loss_and_grads_equal_the_zoo_model_exactly(hf, arch, tmp_path):
    zoo, fields = zoo_twin(arch)
    model = hf.build(write_config(tmp_path / arch, fields), seed=0)
    load_zoo_weights(model, zoo)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 256, (4, 32), generator=g), torch.randint(0, 256, (4, 32), generator=g)
    loss_zoo, loss_hf = zoo(x, y), model(x, y)
    # Exact: the same kernels in the same order (our registered attention makes the
    # zoo's SDPA call; Conv1D's addmm on the transposed weight rounds like nn.Linear here).
    torch.testing.assert_close(loss_hf, loss_zoo, rtol=0, atol=0)
    loss_zoo.backward()
    loss_hf.backward()
    for name, ours, theirs in grads_by_hf_name(model, zoo):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=name)


def test_gpt2_gelu_new_is_close_to_the_zoo(hf, tmp_path):
    zoo, fields = zoo_twin("gpt2")
    fields["activation_function"] = "gelu_new"  # GPT-2's released config
    model = hf.build(write_config(tmp_path / "g", fields), seed=0)
    load_zoo_weights(model, zoo)
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(4))
    loss_zoo, loss_hf = zoo(x, x), model(x, x)
    loss_zoo.backward()
    loss_hf.backward()
    # NewGELUActivation spells the tanh formula out in separate elementwise ops where
    # the zoo calls the fused F.gelu(approximate="tanh") kernel: a few fp32 ulps apart
    # (measured: loss equal, gradients within 3e-8).
    torch.testing.assert_close(loss_hf, loss_zoo, rtol=1e-6, atol=1e-6)
    for name, ours, theirs in grads_by_hf_name(model, zoo):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_our_attention_matches_transformers_eager(hf, cfg_dirs, arch):
    import transformers

    model = hf.build(cfg_dirs[arch], seed=1)
    config, cls = hf.load_config(cfg_dirs[arch])
    config._attn_implementation = "eager"
    ref = getattr(transformers, cls)(config).eval()
    ref.load_state_dict(model.state_dict())
    x = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours, theirs = model(x), ref(input_ids=x).logits
        # transformers' own loss shifts labels itself: ours on tokens[:-1] -> tokens[1:].
        own = model.hf(input_ids=x, labels=x).loss
        shifted = model(x[:, :-1].contiguous(), x[:, 1:].contiguous())
    # Eager attention is matmul + softmax + matmul; ours is the fused SDPA kernel:
    # different accumulation order (measured: logits within 4e-7).
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=2e-6)
    # transformers reduces the loss as a sum / count, we as a mean (measured: 1e-6).
    torch.testing.assert_close(shifted, own, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- executor parity

MATRIX = (
    PARITY_MATRIX  # (persistent, n_buffer, policies): tests/harness.py, shared with test_parity
)


@pytest.mark.parametrize("case", list(MATRIX))
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_executor_matrix_is_exact(hf, cfg_dirs, arch, case):
    persistent, n_buffer, policies = MATRIX[case]
    if arch == "gpt2" and n_buffer == 1:
        n_buffer = 2  # the tied head uses the embedding chunk and ln_f's at once
    name = f"hf:{cfg_dirs[arch]}"
    # The harness builds `name` with dropout 0.1 (every dropout of the config) and
    # restores the RNG around each side, so checkpointed recomputation must replay it.
    plan = harness_plan(name, persistent=persistent, n_buffer=n_buffer, policies=policies)
    run = lockstep(name, plan, steps=8)
    assert run.losses == run.ref_losses
    assert_same_state(run)


class KwBlock(nn.Module):
    """A block called as HF calls its layers: hidden states by keyword, extra tensors, a tuple
    out."""

    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)

    def forward(
        self, hidden_states, *, scale, cache=None
    ):  # (B, T, C), (T, C) -> ((B, T, C), None)
        return hidden_states + self.drop(torch.tanh(self.fc(self.ln(hidden_states)))) * scale, cache


class KwModel(nn.Module):
    def __init__(self, d: int = 32, n: int = 4):
        super().__init__()
        self.embed = nn.Embedding(256, d)
        self.layers = nn.ModuleList(KwBlock(d) for _ in range(n))
        self.head = nn.Linear(d, 256)

    def forward(self, idx, targets):
        x = self.embed(idx)
        # Computed once outside the blocks and without gradient, like RoPE's cos/sin.
        scale = torch.linspace(0.5, 1.5, idx.size(1), device=idx.device)[:, None].expand(
            -1, x.size(-1)
        )
        for layer in self.layers:
            x = layer(hidden_states=x, scale=scale, cache=None)[0]
        return lm_loss(self.head(x), targets)


@pytest.mark.parametrize(
    "policies", ["checkpoint swap keep checkpoint", "swap swap checkpoint keep"]
)
def test_keyword_blocks_train_exactly(policies):
    torch.manual_seed(0)
    model = KwModel()
    with torch.device("meta"):
        meta = KwModel()
    blocks = block_paths(meta)
    assert blocks == [f"layers.{i}" for i in range(4)]
    training = P.Training(
        micro_batch=2,
        seq_len=16,
        compute_dtype="float32",
        master_dtype="float32",
        world_size=1,
        grad_accum=1,
    )
    plan = emit(
        meta,
        name="kw",
        blocks=blocks,
        training=training,
        chunk_numel=16384,
        persistent=[0],
        n_buffer=2,
        policies=policies.split(),
    )
    ref = copy.deepcopy(model)
    config = AdamWConfig(lr=1e-2)
    engine = wrap(model, plan, config, device="cpu")
    opt = torch.optim.AdamW(
        ref.parameters(),
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=True,
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = (
            torch.randint(0, 256, (2, 16), generator=g),
            torch.randint(0, 256, (2, 16), generator=g),
        )
        rng = torch.get_rng_state()
        ours = engine.step((x, y)).loss
        torch.set_rng_state(rng)
        opt.zero_grad(set_to_none=True)
        loss = ref(x, y)
        loss.backward()
        opt.step()
        assert ours == loss.item()
    sd = engine.state_dict()["model"]
    for n, p in ref.named_parameters():
        torch.testing.assert_close(sd[n], p.detach(), rtol=0, atol=0, msg=n)


# ---------------------------------------------------------------------------- discovery and errors


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_blocks_are_found_on_every_architecture(hf, cfg_dirs, arch):
    model = build(f"hf:{cfg_dirs[arch]}", device="meta")
    n = CONFIGS[arch].get("n_layer") or CONFIGS[arch]["num_hidden_layers"]
    expected = [f"{BLOCK_LISTS[arch]}.{i}" for i in range(n)]
    assert block_paths(model) == expected
    assert all(p.device.type == "meta" for p in model.parameters())
    # Names are transformers' own (no wrapper prefix), so checkpoints and plans agree.
    assert set(dict(model.named_parameters())) == set(dict(model.hf.named_parameters()))
    override = build(f"hf:{cfg_dirs[arch]}#{BLOCK_LISTS[arch]}.*", device="meta")
    assert block_paths(override) == expected
    info = models.describe(f"hf:{cfg_dirs[arch]}")
    assert (info.family, info.n_blocks, info.hidden, info.vocab_size) == (arch, n, 64, 256)
    assert info.n_params == sum(p.numel() for p in model.parameters())


def test_block_override_errors_name_the_choices(hf, cfg_dirs):
    with pytest.raises(ConfigError, match=r"did you mean 'model.layers'") as e:
        build(f"hf:{cfg_dirs['llama']}#model.layer", device="meta")
    assert "model.layers" in e.value.hint
    with pytest.raises(ConfigError, match="has no child modules"):
        build(f"hf:{cfg_dirs['llama']}#model.norm", device="meta")


def test_config_errors_name_the_file_and_the_fix(hf, tmp_path):
    with pytest.raises(ConfigError, match="holds no config.json") as e:
        build(f"hf:{tmp_path}", device="meta")
    assert "hf:PATH" in e.value.hint
    with pytest.raises(ConfigError, match="no such file"):
        models.check_name(f"hf:{tmp_path / 'missing.json'}")
    bad = tmp_path / "garbled"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,,}')
    with pytest.raises(ConfigError, match=r"config.json: not valid JSON .* line 1") as e:
        build(f"hf:{bad}", device="meta")
    assert str(bad / "config.json") in str(e.value)
    # A masked-LM checkpoint is not silently given a causal-LM head (the hint names this
    # model type's causal class, never another model type: tests/test_hf_families.py).
    bert = write_config(
        tmp_path / "bert", dict(model_type="bert", architectures=["BertForMaskedLM"])
    )
    with pytest.raises(
        ConfigError, match=r"'BertForMaskedLM', which is not a causal LM of model_type 'bert'"
    ) as e:
        build(f"hf:{bert}", device="meta")
    assert "from_model" in e.value.hint and '["BertLMHeadModel"]' in e.value.hint
    odd = write_config(
        tmp_path / "odd", {**CONFIGS["llama"], "architectures": ["LlamaForSequenceClassification"]}
    )
    with pytest.raises(
        ConfigError, match="'LlamaForSequenceClassification', which is not a causal LM"
    ):
        build(f"hf:{odd}", device="meta")
    with pytest.raises(
        ConfigError, match="unknown model 'gpt2-tiyn'.*did you mean 'gpt2-tiny'"
    ) as e:
        models.check_name("gpt2-tiyn")
    assert "hf:PATH" in e.value.hint


def test_names_and_cli_option_pair(hf):
    assert hf.hf_model_name("cfg/llama", "model.layers") == "hf:cfg/llama#model.layers"
    assert hf.parse_hf_name("hf:cfg/llama#model.layers") == ("cfg/llama", "model.layers")
    assert hf.parse_hf_name("hf:cfg/config.json") == ("cfg/config.json", None)
    # Paths from the command line are made absolute: a plan names its model from any directory.
    assert hf.model_name_option(None, "cfg", None) == f"hf:{Path.cwd() / 'cfg'}"
    assert (
        hf.model_name_option("hf:cfg#model.layers", None, None)
        == f"hf:{Path.cwd() / 'cfg'}#model.layers"
    )
    assert hf.model_name_option("gpt2", None, None) == "gpt2"
    with pytest.raises(ConfigError, match="both name the model"):
        hf.model_name_option("gpt2", "cfg", None)
    with pytest.raises(ConfigError, match="needs --hf-config"):
        hf.model_name_option("gpt2", None, "model.layers")


def test_training_settings_and_sliding_window(hf, cfg_dirs):
    model = build(f"hf:{cfg_dirs['opt']}", seed=0)
    c = model.config
    assert (c.dropout, c.attention_dropout, c.layerdrop, c.use_cache) == (0.0, 0.0, 0.0, False)
    assert c._attn_implementation == hf.ATTENTION
    x = torch.randint(2, 256, (2, 16))
    assert torch.isfinite(model(x, x))  # OPT has a pad token (1): no padding check on our batches
    mistral = build(f"hf:{cfg_dirs['mistral']}", device="meta")
    # Past the window (32) the family's own SDPA runs with transformers' sliding mask
    # (tests/test_hf_families.py checks the values); on meta, so nothing reads data.
    assert mistral(torch.zeros(1, 33, dtype=torch.long, device="meta")).shape == (1, 33, 256)
    with pytest.raises(ConfigError, match="max_position_embeddings=64"):
        mistral(torch.zeros(1, 65, dtype=torch.long, device="meta"))


def test_seeded_init_leaves_the_global_rng_alone(hf, cfg_dirs):
    name = f"hf:{cfg_dirs['llama']}"
    state = torch.get_rng_state()
    a, b, c = build(name, seed=5), build(name, seed=5), build(name, seed=6)
    assert torch.equal(state, torch.get_rng_state())
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), n
        assert not torch.equal(p, r) or p.eq(1).all(), n  # norms are ones under any seed
    # RoPE's inv_freq buffer is recomputed on materialisation and kept in fp32.
    import transformers

    config, _ = hf.load_config(cfg_dirs["llama"])
    expected = transformers.LlamaForCausalLM(config).model.rotary_emb.inv_freq
    half = build(name, dtype=torch.bfloat16)
    assert half.model.rotary_emb.inv_freq.dtype == torch.float32
    torch.testing.assert_close(half.model.rotary_emb.inv_freq, expected, rtol=0, atol=0)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


def test_from_model_adapts_a_user_model(hf, cfg_dirs):
    import transformers

    config, cls = hf.load_config(cfg_dirs["qwen2"])
    user = getattr(transformers, cls)(config)
    model = hf.from_model(user, blocks="model.layers")
    assert model.blocks == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert user.config._attn_implementation == hf.ATTENTION and user.config.use_cache is False
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(x), user(input_ids=x).logits, rtol=0, atol=0)
    with pytest.raises(ConfigError, match="needs a transformers PreTrainedModel"):
        hf.from_model(nn.Linear(2, 2))
    config, cls = hf.load_config(cfg_dirs["opt"])
    config.layerdrop = 0.1
    with pytest.raises(ConfigError, match="layerdrop=0.1"):
        hf.from_model(getattr(transformers, cls)(config))


# ---------------------------------------------------------------------------- weights


def test_safetensors_checkpoints_load(hf, cfg_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    source = build(f"hf:{cfg_dirs['gpt2']}", seed=11)
    ckpt = tmp_path / "ckpt"
    source.hf.save_pretrained(ckpt)  # config.json + model.safetensors (the tied head is not stored)
    loaded = build(
        f"hf:{ckpt}", seed=0
    )  # a directory with a checkpoint: its weights, not the seed's
    for (n, p), q in zip(source.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), n
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert loaded.weights_loaded_from == [ckpt / "model.safetensors"]
    # Naming the config.json of a checkpoint directory loads the same weights (it used to
    # mean a random init while the directory meant the checkpoint, and neither said which).
    same = build(f"hf:{ckpt / 'config.json'}", seed=0)
    assert torch.equal(same.transformer.wte.weight, source.transformer.wte.weight)
    assert same.weights_loaded_from == [ckpt / "model.safetensors"]
    assert (
        build(f"hf:{cfg_dirs['gpt2']}", seed=0).weights_loaded_from == []
    )  # a config alone: the seed's init

    # GPT-2's original checkpoints: no "transformer." prefix and causal-mask buffers.
    tensors = {
        k.removeprefix("transformer."): v for k, v in load_file(ckpt / "model.safetensors").items()
    }
    tensors["h.0.attn.bias"] = torch.ones(1, 1, 64, 64)
    # ... in two shards with an index, as large checkpoints come.
    shard = tmp_path / "sharded"
    shard.mkdir()
    (shard / "config.json").write_text((ckpt / "config.json").read_text())
    keys = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": keys[::2],
        "model-00002-of-00002.safetensors": keys[1::2],
    }
    for file, names in halves.items():
        save_file({k: tensors[k] for k in names}, shard / file)
    index = {"weight_map": {k: f for f, names in halves.items() for k in names}}
    (shard / "model.safetensors.index.json").write_text(json.dumps(index))
    resharded = build(f"hf:{shard}")
    for (n, p), q in zip(source.named_parameters(), resharded.parameters()):
        assert torch.equal(p, q), n

    del tensors["wte.weight"]
    tensors["extra.weight"] = torch.ones(3)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((ckpt / "config.json").read_text())
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(
        ConfigError, match=r"missing: transformer.wte.weight\n  unexpected: extra.weight"
    ):
        build(f"hf:{bad}")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((ckpt / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not opened")
    with pytest.raises(ConfigError, match="safetensors only") as e:
        build(f"hf:{pickled}")
    assert "config.json" in e.value.hint
    with pytest.raises(ConfigError, match=".safetensors files only"):
        hf.build(ckpt, weights=pickled / "pytorch_model.bin")


# ---------------------------------------------------------------------------- planner


def test_a_7b_config_plans_without_allocating(hf, tmp_path):
    from protrain.planner.hardware.spec import find_spec
    from protrain.planner.profiling.analytic import analytic_profile

    fields = dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    )
    name = f"hf:{write_config(tmp_path / 'llama-7b', fields)}"
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    model = build(name, device="meta")
    zoo = build("llama-7b", device="meta")
    assert models.count_params(model) == models.count_params(zoo) == 6_738_415_616
    # Same names, shapes and blocks as the zoo's LLaMA, so a plan for one fits the other.
    assert model_fingerprint(model, block_paths(model)) == model_fingerprint(zoo, block_paths(zoo))
    profile = analytic_profile(
        model,
        name=name,
        blocks=block_paths(model),
        micro_batch=1,
        seq_len=256,
        compute_dtype="bfloat16",
        spec=find_spec("a100-80g"),
    )
    assert len(profile.segments) == 34
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    assert grown < 2**30, f"peak RSS grew by {grown / 2**30:.1f} GiB; a 7B model in fp32 is 25 GiB"


def test_cli_profiles_plans_and_trains_an_hf_config(hf, cfg_dirs, tmp_path):
    from click.testing import CliRunner

    from protrain.planner.commands.cli import main

    name = f"hf:{cfg_dirs['llama']}"
    runner = CliRunner()
    prof, plan = tmp_path / "profile.json", tmp_path / "plan.json"
    r = runner.invoke(
        main,
        [
            "profile",
            "--model",
            name,
            "--batch",
            "2",
            "--seq",
            "16",
            "--analytic",
            "--hardware",
            "cpu",
            "-o",
            str(prof),
        ],
    )
    assert r.exit_code == 0, r.output
    r = runner.invoke(
        main,
        ["plan", "--profile", str(prof), "--model", name, "--budget", "400KiB", "-o", str(plan)],
    )
    assert r.exit_code == 0, r.output
    p = plans.load(plan)
    assert p.model.name == name and p.model.blocks == [f"model.layers.{i}" for i in range(4)]
    assert "model.layers.0.self_attn.q_proj.weight" in {
        q.name for c in p.chunks.items for q in c.params
    }
    r = runner.invoke(
        main,
        [
            "plan",
            "--model",
            f"{name}#model.layers",
            "--hardware",
            "cpu",
            "--batch",
            "2",
            "--seq",
            "16",
            "-o",
            str(tmp_path / "direct.json"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert plans.load(tmp_path / "direct.json").model.fingerprint == p.model.fingerprint
    r = runner.invoke(main, ["train", "--plan", str(plan), "--model", name, "--steps", "3"])
    assert r.exit_code == 0, r.output
    assert "trained 3 steps" in r.output
