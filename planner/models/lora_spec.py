"""LoRA's settings as plain data (no torch, no peft): what ``--lora`` and its companions
ask for. The CLI's options (commands/lora_options.py) build it and import fast;
models/lora.py injects the adapters it describes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoraSpec:
    """``protrain plan/train --lora``'s settings (peft's ``LoraConfig`` fields)."""

    r: int = 16
    alpha: float = 32
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None
    """Module names (the last part of a path) to adapt; None: the family's attention projections."""

    def describe(self) -> str:
        targets = self.targets or ("the attention projections",)
        return (
            f"LoRA r={self.r} alpha={self.alpha:g} dropout={self.dropout:g} on {', '.join(targets)}"
        )
