"""Models and the measured loop shared by tools/bench/train.py's back-ends (and fit.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable


def log(msg: str) -> None:
    print(f"[bench_train] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Models: zoo names, reduced-depth zoo models, ladder rungs (for bench_fit)

TINY_LADDERS = {
    # Tiny shapes for CPU rehearsals of bench_fit: byte vocabulary, a few layers,
    # widths doubling, so the ladder spans ~25x in parameters and builds in milliseconds.
    "gpt2": [(2, 2, 32), (2, 2, 64), (3, 4, 96), (4, 4, 128), (4, 4, 192), (6, 4, 256)],
    "llama": [(2, 2, 32), (2, 4, 64), (3, 4, 96), (4, 4, 128), (4, 4, 192), (6, 4, 256)],
}


def resolve_config(name: str, layers: int | None, seq_len: int):
    """``(label, config)`` for a zoo name, ``ladder:FAMILY:I`` or ``tiny:FAMILY:I``.

    ``layers`` replaces the depth (a reduced-depth model of the same width, e.g. a
    llama-7b with 8 of its 32 blocks); the label then says so (``llama-7b[8L]``).
    """
    from protrain.planner.commands.fit import ladder
    from protrain.planner.models.zoo import ZOO, GPT2Config, LlamaConfig

    if name.startswith(("ladder:", "tiny:")):
        kind, family, index = name.split(":")
        if kind == "ladder":
            rungs = ladder(family, seq_len)
        else:
            if family not in TINY_LADDERS:
                raise ValueError(f"unknown tiny ladder {family!r}; choose gpt2 or llama")
            rungs = [
                GPT2Config(
                    n_layer=n, n_head=h, n_embd=w, vocab_size=256, block_size=max(128, seq_len)
                )
                if family == "gpt2"
                else LlamaConfig(
                    n_layer=n,
                    n_head=h,
                    n_kv_head=h,
                    dim=w,
                    ffn_dim=int(2.75 * w) // 4 * 4,
                    vocab_size=256,
                    max_seq_len=max(128, seq_len),
                )
                for n, h, w in TINY_LADDERS[family]
            ]
        cfg = rungs[int(index)]
    elif name in ZOO:
        cfg = ZOO[name]
    else:
        from protrain.plans.errors import did_you_mean

        raise ValueError(
            f"unknown model {name!r}{did_you_mean(name, ZOO)}; zoo: {', '.join(ZOO)}, "
            "or ladder:gpt2:I, ladder:llama:I, tiny:gpt2:I, tiny:llama:I"
        )
    label = name
    if layers is not None:
        cfg = dataclasses.replace(cfg, n_layer=layers)
        label = f"{name}[{layers}L]"
    return label, dataclasses.replace(cfg, dropout=0.0)  # dropout off: same math on every back-end


def build_model(cfg, seed: int):
    """The model on the CPU in fp32, initialised from ``seed`` (identical for every back-end)."""
    import torch

    from protrain.planner.models.zoo import GPT2, GPT2Config, Llama, materialize

    with torch.device("meta"):
        model = GPT2(cfg) if isinstance(cfg, GPT2Config) else Llama(cfg)
    return materialize(model, device="cpu", seed=seed)


def hidden_size(cfg) -> int:
    return getattr(cfg, "n_embd", None) or cfg.dim


# ---------------------------------------------------------------------------
# The measured loop, shared by every back-end


@dataclasses.dataclass
class Measured:
    step_s: list[float] = dataclasses.field(default_factory=list)  # measured steps only
    losses: list[float] = dataclasses.field(default_factory=list)  # every step, warm-up included


def run_steps(step: Callable[[list], float], data, args, sync: Callable[[], None]) -> Measured:
    """Run ``args.steps`` steps of ``args.grad_accum`` micro-batches; time those after warm-up."""
    out = Measured()
    for i in range(args.steps):
        micro = [next(data) for _ in range(args.grad_accum)]
        sync()
        t0 = time.perf_counter()
        loss = step(micro)  # ends in loss.item(): a host sync for every back-end alike
        sync()
        dt = time.perf_counter() - t0
        out.losses.append(loss)
        if i >= args.warmup:
            out.step_s.append(dt)
        tag = " (warm-up)" if i < args.warmup else ""
        log(f"  step {i + 1}/{args.steps}{tag}: loss {loss:.4f}, {dt * 1e3:.1f} ms")
    return out


def spread(values: list[float]) -> dict:
    # inclusive: quartiles stay within [min, max] however few the steps
    q = (
        statistics.quantiles(values, n=4, method="inclusive")
        if len(values) >= 2
        else [values[0]] * 3
    )
    return {
        "min": min(values),
        "q1": q[0],
        "median": statistics.median(values),
        "q3": q[2],
        "max": max(values),
    }


def accumulate_step(model, opt, dev, micro: list, ctx: Callable = contextlib.nullcontext) -> float:
    """One optimizer step of a plain-PyTorch-style back-end over ``micro`` micro-batches
    (mean loss, as the engine's ``grad_accum``); ``ctx()`` wraps each forward (autocast)."""
    total = 0.0
    for x, y in micro:
        with ctx():
            loss = model(x.to(dev), y.to(dev)) / len(micro)
        loss.backward()
        total += loss.item()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total
