"""Supervised tokens per second on chat data: packed rows (``--packing bfd``) against one
example per row (``--packing none``), same plan, same data, same run.

A tiny llama with the chat tokenizer of ``tools/chatdata.py`` trains on its chat set with
``--loss-on assistant`` under one plan (micro-batch × ``--seq``); each round runs
``protrain train`` once per packing, interleaved, and takes the median over a run's steps
(the first left out) of ``supervised_tokens_per_s`` from ``--metrics``: the targets the loss
counts per second of step time. Packing fills a row with several examples, so a step trains
more of its positions; the ratio is what that buys at the same compute per step.

    python -m tools.bench sft [--rounds 3] [--examples 400] [--seq 256] [--write]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.bench import harness


def _run(*args) -> str:
    cmd = [sys.executable, "-m", "protrain.planner", *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return r.stdout


def _model(root: Path) -> Path:
    import torch
    import transformers

    from tools.chatdata import tokenizer_dir

    d = root / "llama"
    config = transformers.LlamaConfig(
        vocab_size=448, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(d)
    tokenizer_dir(d)
    return d


def main(argv: list[str] | None = None, name: str = "sft") -> int:
    ap = harness.parser(name, __doc__, rounds=3, what="interleaved pairs of runs")
    ap.add_argument("--examples", type=int, default=400, help="chat examples (default 400)")
    ap.add_argument("--seq", type=int, default=256, help="row length (default 256)")
    ap.add_argument("--batch", type=int, default=4, help="micro-batch (default 4)")
    ap.add_argument("--steps", type=int, default=12, help="steps a run (default 12)")
    args = ap.parse_args(argv)
    harness.no_baseline(ap, args)
    from tools.chatdata import chats, write_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = _model(root)
        data = write_jsonl(root / "chats.jsonl", chats(args.examples))
        plan = root / "plan.json"
        _run(
            "plan", "--hf-config", model, "--hardware", "cpu", "--dtype", "float32",
            "--batch", args.batch, "--seq", args.seq, "--budget", "8GiB", "-o", plan,
        )  # fmt: skip
        shares = {}
        for packing in ("bfd", "none"):  # the supervised share of a row, from the header
            out = _run("data", "--hf-config", model, "--data", data, "--seq", args.seq,
                       "--packing", packing, "--loss-on", "assistant", "--limit", "0")  # fmt: skip
            shares[packing] = out.strip().rsplit(", ", 1)[-1].split(" of ")[0]

        def measure(i: int) -> dict[str, float]:
            got = {}
            for packing in ("bfd", "none") if i % 2 == 0 else ("none", "bfd"):
                metrics = root / f"m-{packing}-{i}.jsonl"
                _run(
                    "train", "--plan", plan, "--hf-config", model, "--data", data,
                    "--packing", packing, "--loss-on", "assistant", "--steps", args.steps,
                    "--log-every", 1000, "--metrics", metrics,
                )  # fmt: skip
                rows = [json.loads(line) for line in metrics.read_text().splitlines()]
                rates = [r["supervised_tokens_per_s"] for r in rows if "loss" in r][1:]
                got[packing] = statistics.median(rates)
            return got

        results = harness.rounds(args.rounds, measure)
    bfd = [r["bfd"] for r in results]
    none = [r["none"] for r in results]
    ratio = [b / n for b, n in zip(bfd, none)]
    md = "\n".join(
        [
            harness.heading(name),
            "",
            f"`{harness.command(name, argv)}` on {harness.machine()}, {harness.now()}.",
            "",
            f"Tiny llama (4 layers, hidden 128), {args.examples} chat examples, "
            f"`--loss-on assistant`, micro-batch {args.batch} × seq {args.seq}, persistent plan "
            f"(`--budget 8GiB`), {args.steps} steps a run (the first left out), "
            f"{args.rounds} interleaved rounds; medians (min-max) over rounds.",
            "",
            "| packing | supervised targets of the rows' positions | supervised tokens/s |",
            "|---|---|---|",
            f"| `bfd` | {shares['bfd']} | {harness.spread(bfd, '{:,.0f}')} |",
            f"| `none` | {shares['none']} | {harness.spread(none, '{:,.0f}')} |",
            "",
            f"Packed against one example per row: **{harness.spread(ratio, '{:.2f}', '×')}** "
            "the supervised tokens per second, same plan, same steps.",
        ]
    )
    return harness.emit(name, md, args.write)
