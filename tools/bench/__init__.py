"""The benchmarks, on one harness (tools/bench/harness.py), run as ``python -m tools.bench NAME``.

``python -m tools.bench --list`` names them; ``python -m tools.bench NAME --help`` gives a
benchmark's options (the common ones: ``--rounds N``, ``--baseline REF``, ``--write``).
Each writes the section ``## NAME: TITLE`` of BENCHMARKS.md and no other.

Modules are imported when their benchmark runs, not here: a baseline tree's ``protrain``
(``--baseline``) may lack what another benchmark imports.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    module: str  # under tools.bench
    title: str  # the section's heading after the name
    preset: tuple[str, ...] = ()  # arguments the name stands for (one module, two sections)
    section: bool = True  # whether it writes a section (else: JSON lines, or figures to copy)


BENCHMARKS: dict[str, Benchmark] = {
    "executor": Benchmark("executor", "Executor step time on CPU against plain PyTorch"),
    "planner": Benchmark(
        "planner",
        "Planner on CPU: peak-memory consistency, time against wall clock",
        ("--only", "fidelity"),
    ),
    "search": Benchmark("planner", "Search time", ("--only", "search")),
    "plan-speed": Benchmark("plan_speed", "Planning speed against a baseline commit"),
    "milp": Benchmark("milp", "MILP plan choice"),
    "dist": Benchmark("dist", "Communication on CPU with gloo"),
    "train": Benchmark("train", "Training throughput against FSDP2 and DeepSpeed offload"),
    "fit": Benchmark(
        "fit",
        "The largest model and micro-batch each back-end trains under a budget",
        section=False,
    ),
    "host": Benchmark("host", "Host bytes per offloaded parameter"),
    "host-lora": Benchmark("host", "Host bytes per frozen parameter, LoRA", ("--lora",)),
    "paper-sizes": Benchmark("paper_sizes", "Paper Table 2 sizes"),
    "corpus": Benchmark("corpus", "Corpus size against peak RSS"),
    "tokenize": Benchmark("tokenize", "Tokenising memory through a BPE tokenizer"),
    "sft": Benchmark("sft", "Supervised tokens per second on chat data, packed against unpacked"),
    "trainer": Benchmark(
        "trainer", "SFTTrainer script with protrain against without, tokens per second"
    ),
    "sft-memory": Benchmark("sft_memory", "Peak RSS of training on a large chat file"),
    "finite": Benchmark("finite", "Finite-state guard: step time with and without it"),
    "moe-cpu": Benchmark(
        "moe_cpu",
        "CPU host costs of a mixture-of-experts block (analytic.py's constants)",
        section=False,
    ),
    "moe-spread": Benchmark("moe_spread", "Probed-CPU timing checks, run to run"),
}


def load(name: str):
    """The module of benchmark ``name``."""
    import importlib

    return importlib.import_module(f"tools.bench.{BENCHMARKS[name].module}")


def run(name: str, argv: list[str]) -> int:
    """Benchmark ``name`` with ``argv`` (after its preset): its module's ``main``."""
    bench = BENCHMARKS[name]
    return load(name).main([*bench.preset, *argv], name=name) or 0
