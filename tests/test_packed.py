"""Packed rows with loss masks (issue 40): (idx, targets, position_ids) micro-batches.

A step's loss is the sum of its token losses over the step's supervised targets (every
micro-batch, every rank), as transformers' Trainer normalises with ``num_items_in_batch``;
packed examples never attend to each other. See executor/engine.py [Note: supervised
tokens] and planner/models/hf_attention.py [Note: packed rows].
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from harness import MICRO_BATCH, SEQ_LEN, make_model, make_plan, packed_micro_batch

from protrain.executor import AdamWConfig, wrap
from protrain.planner.models import zoo
from protrain.planner.search.emit import emit
from protrain.plans import plan as P
from protrain.plans.errors import ConfigError

CONFIG = AdamWConfig(lr=2e-3, weight_decay=0.1)


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    c = CONFIG
    return torch.optim.AdamW(
        model.parameters(), lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay,
        fused=True,
    )  # fmt: skip


def _supervised(mb) -> int:
    return int((mb[1] != -100).sum())


def _steps(empty_at: tuple[int, int] = (1, 1)) -> list[list[tuple]]:
    """Three steps of two packed micro-batches; micro-batch ``empty_at`` trains no token."""
    steps = [[packed_micro_batch(10 * s + i) for i in range(2)] for s in range(3)]
    s, i = empty_at
    x, y, p = steps[s][i]
    steps[s][i] = (x, torch.full_like(y, -100), p)
    return steps


@pytest.mark.parametrize("case", ["persistent", "offloaded-iterator"])
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_packed_steps_equal_plain_pytorch(name, case):
    # (a) every chunk persistent, micro-batches as a list; (b) every chunk offloaded, one block
    # swapped and one checkpointed (its recomputation must see the same mask), drawn from an
    # iterator with the step's count given. Exact on CPU fp32: the same kernels in the same
    # order as the plain loop, which computes sum_i mean_i * n_i / N with weights n_i / N.
    if case == "persistent":
        plan = make_plan(name, persistent="all", n_buffer=0, policies="keep", grad_accum=2)
    else:
        plan = make_plan(name, persistent=[], n_buffer=2, policies="swap checkpoint", grad_accum=2)
    model = make_model(name)  # dropout 0.1: the same masks on both sides (RNG restored)
    ref = copy.deepcopy(model)
    engine = wrap(model, plan, CONFIG, device="cpu")
    opt = _adamw(ref)
    torch.manual_seed(1234)
    rng_ours = rng_ref = torch.get_rng_state()
    losses, ref_losses, naive = [], [], []
    for mbs in _steps():
        counts = [_supervised(mb) for mb in mbs]
        torch.set_rng_state(rng_ours)
        if case == "persistent":
            losses.append(engine.step(mbs).loss)
        else:
            losses.append(engine.step(iter(mbs), num_items=sum(counts)).loss)
        rng_ours = torch.get_rng_state()

        torch.set_rng_state(rng_ref)
        opt.zero_grad(set_to_none=True)
        total, parts, means = sum(counts), [], []
        for (x, y, p), n in zip(mbs, counts):
            loss = ref(x, y, position_ids=p)
            (loss * (n / total) if n else loss.nan_to_num() * 0.0).backward()
            parts.append(loss.detach().float().nan_to_num() * n)
            means.append(loss.detach())
        opt.step()
        rng_ref = torch.get_rng_state()
        ref_losses.append(torch.stack(parts).sum().item() / total)
        naive.append(torch.stack(means).mean().item())
    assert losses == ref_losses
    assert losses != naive  # (the micro-batches' counts differ: the weighting shows)
    sd = engine.state_dict()
    for pname, param in ref.named_parameters():
        torch.testing.assert_close(sd["model"][pname], param.detach(), rtol=0, atol=0, msg=pname)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                sd["optim"][pname][key], opt.state[param][key], rtol=0, atol=0, msg=pname
            )
    # evaluate takes triples too: the eval-mode loss of the reference, exactly
    mb = packed_micro_batch(99)
    ref.eval()
    with torch.no_grad():
        want = ref(*mb[:2], position_ids=mb[2]).item()
    assert engine.evaluate(mb) == want
    engine.close()


def _packed_row(lengths: list[int], T: int, vocab: int, seed: int = 0):
    """One row of examples of ``lengths`` and a padding tail: (idx (1, T), position_ids (1, T),
    the examples' ids)."""
    g = torch.Generator().manual_seed(seed)
    examples = [torch.randint(0, vocab, (1, n), generator=g) for n in lengths]
    pad = T - sum(lengths)
    idx = torch.cat([*examples, torch.zeros(1, pad, dtype=torch.long)], 1)  # (1, T)
    pos = torch.cat([torch.arange(n) for n in [*lengths, pad]])[None]  # (1, T)
    return idx, pos, examples


def _assert_isolated(model, vocab: int) -> None:
    # Within 1e-5, not bitwise: the packed row runs SDPA with a (1, 1, T, T) mask over T keys,
    # each example alone runs the is_causal kernel over its own length, so the softmax sums
    # are taken over other shapes (differences seen: ~2e-7).
    idx, pos, examples = _packed_row([5, 7, 4], 20, vocab)
    with torch.no_grad():
        packed = model(idx, position_ids=pos)  # (1, T, V)
        at = 0
        for e in examples:
            alone = model(e)  # (1, n, V)
            torch.testing.assert_close(
                packed[:, at : at + e.size(1)], alone, rtol=0, atol=1e-5
            )  # fmt: skip
            at += e.size(1)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_packed_examples_attend_only_to_themselves_in_the_zoo(name):
    _assert_isolated(zoo.build(name, seed=1).eval(), 256)


def _hf_tiny(family: str = "llama", **extra):
    import transformers

    cls, config = {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
        "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig),
    }[family]
    cfg = config(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **extra,
    )  # fmt: skip
    torch.manual_seed(3)
    return cls(cfg)


@pytest.mark.parametrize(
    "family,extra", [("llama", {}), ("mistral", {"sliding_window": 4})], ids=["llama", "window4"]
)
def test_packed_examples_attend_only_to_themselves_in_hf_models(family, extra):
    # Mistral with a window of 4 < the examples' lengths: the window applies within each example.
    pytest.importorskip("transformers")
    from protrain.planner.models import hf

    _assert_isolated(hf.from_model(_hf_tiny(family, **extra)).eval(), 256)


def test_hf_packed_losses_equal_transformers_with_each_example_alone():
    # protrain's Hugging Face path against transformers' own model (its own attention), each
    # packed example run alone, the step's loss the sum of token losses over N, fused AdamW.
    # Within 1e-4 relative: other attention kernels and shapes (masked SDPA over the row vs
    # causal over each example) and another summation order of the token losses.
    pytest.importorskip("transformers")
    from protrain.planner.models import hf

    raw = _hf_tiny()
    ref = copy.deepcopy(raw)
    model = hf.from_model(raw)
    with torch.device("meta"):
        meta = hf.from_model(_hf_tiny())
    training = P.Training(
        micro_batch=MICRO_BATCH, seq_len=SEQ_LEN, compute_dtype="float32",
        master_dtype="float32", world_size=1, grad_accum=2,
    )  # fmt: skip
    plan = emit(
        meta, name="llama-hf", blocks=meta.protrain_blocks(), training=training,
        chunk_numel=65536, persistent=[0], n_buffer=2, policies=["checkpoint", "swap"],
    )  # fmt: skip
    engine = wrap(model, plan, CONFIG, device="cpu")
    opt = _adamw(ref)
    losses, want = [], []
    for mbs in _steps():
        losses.append(engine.step(mbs).loss)
        total = sum(_supervised(mb) for mb in mbs)
        opt.zero_grad(set_to_none=True)
        summed = torch.zeros(())
        for x, y, p in mbs:
            for b in range(x.size(0)):
                starts = [*(p[b] == 0).nonzero().flatten().tolist(), x.size(1)]
                for s, e in zip(starts, starts[1:]):
                    if (y[b, s:e] != -100).any():
                        logits = ref(input_ids=x[b : b + 1, s:e]).logits[0]  # (n, V)
                        summed = summed + F.cross_entropy(logits, y[b, s:e], reduction="sum")
        (summed / total).backward()
        opt.step()
        want.append(summed.item() / total)
    engine.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-4, atol=0)


class NoPositions(zoo.Llama):
    """A model whose forward takes no position_ids: it cannot keep packed examples apart."""

    def forward(self, idx, targets=None):
        return super().forward(idx, targets)


def test_packed_micro_batches_are_refused_by_name_when_wrong():
    plan = make_plan("llama-tiny", persistent=[0], n_buffer=2, policies="keep", grad_accum=2)
    engine = wrap(make_model("llama-tiny"), plan, CONFIG, device="cpu")
    x, y, p = packed_micro_batch(0)
    with pytest.raises(ConfigError, match=r"micro-batch 1: position_ids has shape \(4, 31\)"):
        engine.step([(x, y, p), (x, y, p[:, :-1])])
    with pytest.raises(ConfigError, match="micro-batch 0 is a tuple of 4 tensors"):
        engine.step([(x, y, p, p), (x, y, p)])
    with pytest.raises(ConfigError, match="has no supervised target") as e:
        engine.step([(x, torch.full_like(y, -100), p)] * 2)
    assert "drop the examples" in e.value.hint
    with pytest.raises(ConfigError, match="num_items=5, but its micro-batches hold"):
        engine.step([(x, y, p)] * 2, num_items=5)
    # An iterator is drawn one micro-batch at a time: with masked targets it needs the count.
    with pytest.raises(ConfigError, match="micro-batch 0 has .* supervised targets of 128") as e:
        engine.step(iter([(x, y, p)] * 2))
    assert "num_items=N" in e.value.hint
    engine.close()
    engine = wrap(make_model("llama-tiny"), plan, CONFIG, device="cpu")
    with pytest.raises(ConfigError, match=r"micro-batches 0 to 1 hold \d+ supervised"):
        engine.step(iter([(x, y, p)] * 2), num_items=_supervised((x, y)) * 2 + 1)
    engine.close()

    model = NoPositions(zoo.ZOO["llama-tiny"])
    engine = wrap(model, plan, CONFIG, device="cpu")
    with pytest.raises(ConfigError, match="NoPositions.forward takes no position_ids") as e:
        engine.step([(x, y, p)] * 2)
    assert "forward(idx, targets, position_ids=None)" in e.value.hint
    engine.step([(x, y)] * 2)  # pairs still train it (targets -100 where masked)
    engine.close()


def test_hf_family_with_its_own_attention_refuses_packed_rows():
    # BLOOM computes attention in its own code (ALiBi, no attention interface): a mask of ours
    # would not reach it, so packed rows are refused naming the family.
    transformers = pytest.importorskip("transformers")
    from protrain.planner.models import hf

    cfg = transformers.BloomConfig(vocab_size=256, hidden_size=32, n_layer=2, n_head=4)
    model = hf.from_model(transformers.BloomForCausalLM(cfg))
    idx, pos, _ = _packed_row([5, 7], 16, 256)
    with pytest.raises(ConfigError, match="'bloom' cannot train on packed rows"):
        model(idx, position_ids=pos)


def test_rope_angles_at_position_ids_are_the_table_rows_bit_for_bit():
    # RoPE is relative (q·k depends on position differences), so the isolation tests cannot
    # see an example rotated at its offset in the row; its angles must still be its own.
    _, pos, _ = _packed_row([5, 7, 4], 20, 256)
    cos, sin = zoo.rope_cos_sin(20, 16, 1e4, torch.device("cpu"))  # (T, hs)
    cos_p, sin_p = zoo.rope_cos_sin(20, 16, 1e4, torch.device("cpu"), pos)  # (1, 1, T, hs)
    assert cos_p.shape == (1, 1, 20, 16)
    torch.testing.assert_close(cos_p[0, 0], cos[pos[0]], rtol=0, atol=0)
    torch.testing.assert_close(sin_p[0, 0], sin[pos[0]], rtol=0, atol=0)


def test_a_micro_batch_without_supervised_targets_has_loss_zero_and_zero_gradients():
    logits = torch.randn(2, 5, 7, requires_grad=True)
    loss = zoo.lm_loss(logits, torch.full((2, 5), -100))
    loss.backward()
    assert loss.item() == 0.0 and not logits.grad.any()  # (cross_entropy alone: 0/0 = NaN)


class PlainLoss(zoo.Llama):
    """A user model's loss: cross_entropy's mean, NaN over zero supervised targets."""

    def forward(self, idx, targets=None, position_ids=None):
        logits = super().forward(idx, None, position_ids)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_a_nan_mean_over_no_target_is_weighted_zero_not_refused():
    # Its forward and backward still run (every block, as the schedule expects), adding zeros.
    plan = make_plan("llama-tiny", persistent=[], n_buffer=2, policies="checkpoint", grad_accum=2)
    model = PlainLoss(zoo.ZOO["llama-tiny"])
    zoo.materialize(model, seed=1)
    ref = copy.deepcopy(model)
    engine = wrap(model, plan, CONFIG, device="cpu")
    x, y, p = packed_micro_batch(0)
    empty = (x, torch.full_like(y, -100), p)
    loss = engine.step([(x, y, p), empty]).loss
    opt = _adamw(ref)
    want = ref(x, y, position_ids=p)  # all the step's targets are micro-batch 0's
    want.backward()
    opt.step()
    assert loss == pytest.approx(want.item(), rel=1e-6)  # (mean * n / n, in float32)
    sd = engine.state_dict()
    for pname, param in ref.named_parameters():
        torch.testing.assert_close(sd["model"][pname], param.detach(), rtol=0, atol=0, msg=pname)
    engine.close()


@pytest.mark.dist
def test_two_ranks_normalise_over_both_ranks_supervised_targets(tmp_path):
    # Unequal counts per rank: each rank's backward weighs n_r * W / N, the gradient
    # reduction averages, and the loss is sum_r mean_r * n_r / N on every rank. Against
    # one process on both ranks' rows; tolerances of tests/test_dist.py (gloo's sums, the
    # factor W / W in another order).
    import json

    from distworker import LR, MICRO, SEQ, train_packed
    from test_dist import spawn

    spawn(train_packed, 2, str(tmp_path), "llama-tiny", 4)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["losses"] == ranks[1]["losses"]
    ref = zoo.build("llama-tiny", seed=1)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1, fused=True)
    want, counts = [], set()
    for s in range(4):
        mbs = [packed_micro_batch(10 * s + r, MICRO, SEQ) for r in range(2)]
        total = sum(_supervised(mb) for mb in mbs)
        counts.add(tuple(_supervised(mb) for mb in mbs))
        loss = sum(ref(x, y, position_ids=p) * _supervised((x, y)) for x, y, p in mbs) / total
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(loss.item())
    assert all(a != b for a, b in counts)  # (the ranks' counts differ in every step)
    for a, b in zip(ranks[0]["losses"], want):
        assert abs(a - b) <= 1e-5 * abs(b)
    sd = torch.load(tmp_path / "state.pt", weights_only=True)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(sd["model"][n], p.detach(), rtol=0, atol=1e-4, msg=n)
