"""The ``protrain models`` table, without building each model whole.

``models.describe`` counts parameters on a meta-built model: cheap per model, but
the zoo's 70B model alone has 80 blocks of meta tensors, and the whole table took
seconds. Here each zoo model is built on meta with one block and with two: the
difference is one block's parameters, and ``one + (n_layer - 1) × block`` is the
count ``describe`` gives (every block of a zoo model has the same shape; tied
parameters live outside the blocks). ``tests/test_cli.py`` checks the rows equal
``describe``'s.
"""

from __future__ import annotations

import dataclasses

from .zoo import GPT2, ZOO, GPT2Config, Llama, ModelInfo, count_params


class _BareGPT2(GPT2):
    def reset_parameters(self, generator=None) -> None:  # counting needs no values
        pass


class _BareLlama(Llama):
    def reset_parameters(self, generator=None) -> None:
        pass


def _count(cfg) -> int:
    from unittest import mock

    import torch

    def built(n_layer: int) -> int:
        # nn.Embedding's own init calls normal_, whose first call on meta loads torch's
        # decompositions (~1.5 s, most of the table's time); a count needs no values.
        with (
            torch.device("meta"),
            mock.patch.object(torch.nn.Embedding, "reset_parameters", lambda self: None),
        ):
            c = dataclasses.replace(cfg, n_layer=n_layer)
            return count_params(_BareGPT2(c) if isinstance(c, GPT2Config) else _BareLlama(c))

    one = built(1)
    return one + (cfg.n_layer - 1) * (built(2) - one)


def row(name: str) -> ModelInfo:
    """``models.describe(name)`` for a zoo model, counted from a one- and a two-block build."""
    cfg = ZOO[name]
    if isinstance(cfg, GPT2Config):
        family, hidden, n_kv_head, max_seq_len = "gpt2", cfg.n_embd, cfg.n_head, cfg.block_size
    else:
        family, hidden, n_kv_head, max_seq_len = "llama", cfg.dim, cfg.n_kv_head, cfg.max_seq_len
    return ModelInfo(
        name=name,
        family=family,
        n_params=_count(cfg),
        n_blocks=cfg.n_layer,
        hidden=hidden,
        n_head=cfg.n_head,
        n_kv_head=n_kv_head,
        vocab_size=cfg.vocab_size,
        max_seq_len=max_seq_len,
    )


def rows_for(names) -> list[ModelInfo]:
    return [row(n) for n in names]
