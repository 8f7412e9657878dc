"""Lock-step training harness: protrain's engine against plain PyTorch on the same data.

Both sides start from bit-identical weights (``copy.deepcopy``), see the same
batches (two ``batches`` iterators with one seed) and the same dropout masks (the
global RNG is saved and restored around each side's step), and use
``torch.optim.AdamW(fused=True)`` — the kernel the engine runs on CPU chunks.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from protrain.executor import AdamWConfig, wrap
from protrain.planner.models.data import batches, load_tokens
from protrain.planner.models.zoo import (
    GPT2,
    GPT2Config,
    Llama,
    LlamaConfig,
    block_paths,
    build,
    materialize,
)
from protrain.planner.search.emit import emit
from protrain.plans import plan as P

MICRO_BATCH, SEQ_LEN, CHUNK = 4, 32, 65536

# Four-block models, so that policy strips like S C K S can be tested; the zoo's
# tiny models have two blocks.
CONFIGS = {
    "gpt2-4": GPT2Config(
        n_layer=4, n_head=2, n_embd=64, vocab_size=256, block_size=64, dropout=0.1
    ),
    "llama-4": LlamaConfig(
        n_layer=4,
        n_head=4,
        n_kv_head=2,
        dim=64,
        ffn_dim=172,
        vocab_size=256,
        max_seq_len=64,
        dropout=0.1,
    ),
}


def make_model(name: str, seed: int = 1, device: str = "cpu", lora=None) -> nn.Module:
    """``lora``: a ``planner.lora.LoraSpec`` to inject (peft), freezing the base."""
    if lora is not None:
        from protrain.planner.models.lora import inject

        return inject(make_model(name, seed, device), lora, seed=seed)
    if name in CONFIGS:
        cfg = CONFIGS[name]
        with torch.device("meta"):
            m = GPT2(cfg) if isinstance(cfg, GPT2Config) else Llama(cfg)
        return m if device == "meta" else materialize(m, device=device, seed=seed)
    return build(name, dropout=0.1, seed=seed, device=device)


def make_plan(
    name: str,
    *,
    persistent,
    n_buffer: int,
    policies,
    grad_accum: int = 1,
    compute_dtype: str = "float32",
    chunk_numel: int = CHUNK,
    cpu_adam: str | None = None,
    homeless=(),
    device_homed=(),
    nvme=(),
    lora=None,
) -> P.Plan:
    meta = (
        make_model(name, device="meta", lora=lora)
        if name in CONFIGS or lora
        else build(name, device="meta")
    )
    blocks = block_paths(meta)
    if isinstance(policies, str):
        policies = (
            [policies] * len(blocks)
            if policies in ("keep", "swap", "checkpoint")
            else policies.split()
        )
    training = P.Training(
        micro_batch=MICRO_BATCH,
        seq_len=SEQ_LEN,
        compute_dtype=compute_dtype,
        master_dtype="float32",
        world_size=1,
        grad_accum=grad_accum,
    )
    if "all" in (persistent, homeless, device_homed, nvme):  # every chunk / every offloaded chunk
        n = len(
            emit(
                meta,
                name=name,
                blocks=blocks,
                training=training,
                chunk_numel=chunk_numel,
                persistent=[],
                n_buffer=64,
                policies=policies,
            ).chunks.items
        )
        persistent = list(range(n)) if persistent == "all" else persistent
        homeless = (
            [c for c in range(n) if c not in set(persistent)] if homeless == "all" else homeless
        )
        device_homed = (
            [c for c in range(n) if c not in set(persistent)]
            if device_homed == "all"
            else device_homed
        )
        nvme = [c for c in range(n) if c not in set(persistent)] if nvme == "all" else nvme
    return emit(
        meta,
        name=name,
        blocks=blocks,
        training=training,
        chunk_numel=chunk_numel,
        persistent=persistent,
        n_buffer=n_buffer,
        policies=policies,
        cpu_adam=cpu_adam,
        homeless=homeless,
        device_homed=device_homed,
        nvme=nvme,
    )


@dataclass
class Run:
    losses: list[float]
    ref_losses: list[float]
    engine: object
    ref: nn.Module
    ref_opt: torch.optim.Optimizer
    results: list


def sleeper(
    before_copy: float = 0.0,
    before_cpu_adam: float = 0.0,
    before_weights_return: float = 0.0,
    before_grad_land: float = 0.0,
):
    """An ``Engine.on_event`` listener that sleeps at the named points (seconds), to make races
    visible on a CPU box: before every copy is queued; in the CPU
    AdamW worker before a chunk's step, before its new weights return to the chunk's home,
    and before a downloaded gradient is accumulated."""
    seconds = {
        ("begin", k): before_copy for k in ("fetch", "prefetch", "swap_in", "offload", "swap_out")
    }
    seconds |= {
        ("begin", "cpu_step"): before_cpu_adam,
        ("end", "cpu_step"): before_weights_return,
        ("mark", "land"): before_grad_land,
    }

    def listener(ev) -> None:
        s = seconds.get((ev.edge, ev.kind))
        if s:
            time.sleep(s)

    return listener


TRAIN_CONFIG = AdamWConfig(lr=1e-2, weight_decay=0.1)
"""``train_engine``'s optimizer unless given: large enough steps that a wrong update shows."""


class Trained(NamedTuple):
    """What ``train_engine`` returns (indexable as ``(losses, state, host_bytes, device_peak)``)."""

    losses: list[float]
    state: dict
    host_bytes: int
    device_peak: int


def train_engine(
    model: nn.Module,
    plan: P.Plan,
    steps: int = 4,
    data=None,
    nvme_dir=None,
    config: AdamWConfig | None = None,
) -> Trained:
    """Train ``model`` under ``plan`` for ``steps`` steps (``grad_accum`` micro-batches each) from
    a fixed seed (dropout draws the same masks in every run); the losses, the state dict and
    the ledger's host bytes and device peak."""
    torch.manual_seed(1234)
    engine = wrap(model, plan, config or TRAIN_CONFIG, device="cpu", nvme_dir=nvme_dir)
    data = data or batches(load_tokens(), 4, 32, 0)
    k = plan.training.grad_accum
    try:
        losses = [engine.step([next(data) for _ in range(k)]).loss for _ in range(steps)]
        return Trained(
            losses, engine.state_dict(), engine.ledger.host_bytes, engine.ledger.device_peak_bytes()
        )
    finally:
        engine.close()


# (persistent, n_buffer, policies) of the parity matrix: chunk ids per 4-block model are 0
# (embeddings), one per block, and the head's; see make_plan. tests/test_parity.py runs it
# on the zoo, tests/test_hf.py on Hugging Face models.
PARITY_MATRIX = {
    "all-persistent": ("all", 0, "keep"),
    "offloaded-buf1": ([], 1, "keep"),
    "offloaded-buf2": ([], 2, "keep"),
    "mixed": ([0, 2], 2, "keep"),
    "all-checkpoint": ([], 2, "checkpoint"),
    "all-swap": ([], 2, "swap"),
    "interleaved": ([0], 2, "swap checkpoint keep swap"),
    "interleaved-2": ([1, 3], 3, "checkpoint swap checkpoint keep"),
}


def lockstep(
    name: str,
    plan: P.Plan,
    steps: int = 20,
    config: AdamWConfig | None = None,
    seed: int = 0,
    on_event=None,
    nvme_dir=None,
    lora=None,
    lrs: list[float] | None = None,
) -> Run:
    """``on_event``: a listener for the engine (``Engine.on_event``), e.g. a ``sleeper``.
    ``lora``: train a peft LoRA model (``make_model``'s); the reference steps its adapters.
    ``lrs``: the rate of each step, set right before it (``Engine.set_lr``; the reference's
    param group, as a ``LambdaLR`` sets it)."""
    config = config or AdamWConfig(lr=2e-3, weight_decay=0.1)
    model = make_model(name, lora=lora)
    ref = copy.deepcopy(model)
    engine = wrap(model, plan, config, device="cpu", nvme_dir=nvme_dir)
    if on_event is not None:
        engine.on_event(on_event)
    opt = torch.optim.AdamW(
        ref.parameters(),
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=True,
    )
    src = load_tokens()
    k = plan.training.grad_accum
    b, t = plan.training.micro_batch, plan.training.seq_len
    ours_data = batches(src, b, t, seed)
    ref_data = batches(src, b, t, seed)
    torch.manual_seed(1234)
    rng_ours = rng_ref = torch.get_rng_state()
    losses, ref_losses, results = [], [], []
    for i in range(steps):
        if lrs is not None:
            engine.set_lr(lrs[i])
            opt.param_groups[0]["lr"] = lrs[i]
        torch.set_rng_state(rng_ours)
        res = engine.step([next(ours_data) for _ in range(k)])
        rng_ours = torch.get_rng_state()
        results.append(res)
        losses.append(res.loss)

        torch.set_rng_state(rng_ref)
        opt.zero_grad(set_to_none=True)
        micro = []
        for _ in range(k):
            x, y = next(ref_data)
            loss = ref(x, y)
            (loss if k == 1 else loss / k).backward()
            micro.append(loss.detach())
        if config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), config.max_grad_norm)
        opt.step()
        rng_ref = torch.get_rng_state()
        ref_losses.append(micro[0].item() if k == 1 else torch.stack(micro).float().mean().item())
    return Run(losses, ref_losses, engine, ref, opt, results)


def assert_same_state(run: Run, atol: float = 0.0, rtol: float = 0.0) -> None:
    """Final parameters and AdamW moments equal plain PyTorch's (names as the model's)."""
    sd = run.engine.state_dict()
    for name, p in run.ref.named_parameters():
        torch.testing.assert_close(sd["model"][name], p.detach(), rtol=rtol, atol=atol, msg=name)
        if not p.requires_grad:  # frozen (a LoRA base): no optimizer state on either side
            assert p not in run.ref_opt.state and name not in sd["optim"], name
            continue
        st = run.ref_opt.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                sd["optim"][name][key], st[key], rtol=rtol, atol=atol, msg=f"{name} {key}"
            )
        assert float(sd["optim"][name]["step"]) == float(st["step"])


def assert_same_training(a, b) -> None:
    """Two ``(losses, state_dict, ...)`` runs: the same losses, parameters and moments, bit for
    bit."""
    assert a[0] == b[0]
    for name, t in a[1]["model"].items():
        assert torch.equal(t, b[1]["model"][name]), name
    for name, st in a[1]["optim"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key], b[1]["optim"][name][key]), (name, key)


def stop_and_resume(
    first: P.Plan,
    second: P.Plan,
    root,
    config: AdamWConfig,
    *,
    name: str = "gpt2-4",
    stop_at: int = 2,
    steps: int = 4,
    nvme_dir=None,
) -> tuple[list[float], dict]:
    """Train ``stop_at`` steps under ``first``, checkpoint under ``root``, resume a model of another
    init under ``second`` to ``steps`` in all: the losses and the final state dict (the same
    data and dropout RNG as one uninterrupted run from ``torch.manual_seed(1234)``)."""
    torch.manual_seed(1234)
    data = batches(load_tokens(), 4, 32, 0)
    e = wrap(make_model(name), first, config, device="cpu", nvme_dir=nvme_dir)
    losses = [e.step(next(data)).loss for _ in range(stop_at)]
    e.save(root)
    e.close()
    e = wrap(make_model(name, seed=7), second, config, device="cpu", nvme_dir=nvme_dir)
    e.load(root)
    losses += [e.step(next(data)).loss for _ in range(steps - stop_at)]
    sd = e.state_dict()
    e.close()
    return losses, sd


def packed_micro_batch(
    seed: int, micro_batch: int = MICRO_BATCH, seq_len: int = SEQ_LEN, vocab: int = 256
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(idx, targets, position_ids)`` of rows packed as the data side packs them: examples of 3
    to 12 tokens whose prompts (a random share) carry no loss, then a padding tail of its own
    (position ids 0.., targets -100). ``targets[b, t]`` is the next token of the same example,
    -100 at an example's last token: no example's first token is the previous one's target."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (micro_batch, seq_len), generator=g)  # (B, T)
    targets = torch.full((micro_batch, seq_len), -100)  # (B, T)
    pos = torch.empty((micro_batch, seq_len), dtype=torch.long)  # (B, T)
    for b in range(micro_batch):
        t = 0
        while True:
            n = int(torch.randint(3, 13, (), generator=g))
            if t + n > seq_len - 2:  # the rest is padding (at least 2 positions)
                break
            prompt = int(torch.randint(1, n, (), generator=g))  # tokens 0..prompt-1 are prompt
            pos[b, t : t + n] = torch.arange(n)
            targets[b, t + prompt - 1 : t + n - 1] = idx[b, t + prompt : t + n]
            t += n
        pos[b, t:] = torch.arange(seq_len - t)
    return idx, targets, pos
