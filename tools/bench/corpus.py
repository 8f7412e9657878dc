"""Peak RSS of ``protrain tokenize`` and ``protrain train`` against the size of the corpus.

Generates a text corpus of each size (words drawn from a fixed list with a fixed seed,
one sentence per line), then runs, each in a process of its own, whose peak RSS
(``ru_maxrss`` from ``wait4``) is reported:

- ``protrain tokenize --data corpus.txt -o corpus.tokens`` (byte-level, uint16);
- ``protrain train --data corpus.tokens`` (the token file memory-mapped);
- ``protrain train --data corpus.txt`` (the text file memory-mapped, byte-level);

each training run a few steps of gpt2-tiny under plans/gpt2-tiny/example.json.
data.py [Note: bounded memory] is why the figures should not grow with the corpus.

    python -m tools.bench corpus --sizes 20MB 2GB --dir /tmp/corpus-bench [--write]
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tools.bench import harness

ROOT = harness.ROOT
PLAN = ROOT / "plans" / "gpt2-tiny" / "example.json"
WORDS = (
    "the planner writes a plan and executor replays it on every rank chunks of parameters move "
    "between host device as says activations are kept swapped to or recomputed in backward small "
    "model learns these sentences quickly when sees them again"
).split()


def parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9}
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            return int(float(text[:-2]) * factor)
    return int(text)


def generate(path: Path, size: int, seed: int = 0) -> None:
    """``size`` bytes of text: the same lines for the same seed, cut at ``size``."""
    rng = random.Random(seed)
    lines = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 25))) + "\n" for _ in range(4096)
    ]
    block = "".join(lines).encode()
    with open(path, "wb") as f:
        written = 0
        while written < size:
            piece = block[: size - written]
            f.write(piece)
            written += len(piece)


def peak_rss(cmd: list[str]) -> tuple[int, float, str]:
    """(peak RSS in bytes, wall seconds, output) of ``cmd`` run to its end; raises if it fails."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out}")
    return usage.ru_maxrss * 1024, time.perf_counter() - t0, out  # Linux: ru_maxrss is in KiB


def measure(directory: Path, size: int, steps: int = 3) -> dict[str, float]:
    """Generate a corpus of ``size`` bytes under ``directory`` and measure the three commands."""
    protrain = [sys.executable, "-m", "protrain.planner"]
    text, tokens = directory / f"corpus-{size}.txt", directory / f"corpus-{size}.tokens"
    generate(text, size)
    row: dict[str, float] = {"bytes": size}
    row["tokenize_rss"], row["tokenize_s"], _ = peak_rss(
        [*protrain, "tokenize", "--data", str(text), "-o", str(tokens)]
    )
    train = [
        *protrain,
        "train",
        "--plan",
        str(PLAN),
        "--model",
        "gpt2-tiny",
        "--steps",
        str(steps),
        "--log-every",
        "1",
    ]
    row["train_tokens_rss"], row["train_tokens_s"], _ = peak_rss([*train, "--data", str(tokens)])
    row["train_text_rss"], row["train_text_s"], _ = peak_rss([*train, "--data", str(text)])
    text.unlink()
    tokens.unlink()
    return row


def main(argv: list[str] | None = None, name: str = "corpus") -> int:
    ap = harness.parser(name, __doc__, rounds=1, what="runs of each command (one process each)")
    ap.add_argument("--sizes", nargs="+", default=["20MB", "2GB"])
    ap.add_argument(
        "--dir",
        default=None,
        help="where the corpora are generated [default: a temporary directory]",
    )
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    harness.no_baseline(ap, args)
    if args.rounds != 1:
        ap.error("--rounds: each command runs once per corpus size")
    import tempfile

    directory = Path(args.dir or tempfile.mkdtemp(prefix="protrain-corpus-"))
    directory.mkdir(parents=True, exist_ok=True)
    rows = [
        "| corpus | `protrain tokenize` | `train --data corpus.tokens` | `train --data corpus.txt` "
        "|",
        "|---:|---:|---:|---:|",
    ]
    try:
        for size in map(parse_size, args.sizes):
            r = measure(directory, size, args.steps)
            mib = 1 << 20
            rows.append(
                f"| {size / 1e6:,.0f} MB | {r['tokenize_rss'] / mib:.0f} MiB "
                f"({r['tokenize_s']:.1f} s) | {r['train_tokens_rss'] / mib:.0f} MiB "
                f"({r['train_tokens_s']:.1f} s) | {r['train_text_rss'] / mib:.0f} MiB "
                f"({r['train_text_s']:.1f} s) |"
            )
            print(rows[-1], file=sys.stderr, flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    text = "\n".join(
        [
            harness.heading(name),
            "",
            f"Command: `{harness.command(name, argv)}`",
            "",
            f"Machine: {harness.machine()}.",
            "",
            f"Date: {harness.now()}. Each command is a process of its own; the figure is its "
            "`ru_maxrss` from `wait4` (peak resident set, file-backed pages of the mapped corpus "
            "included). Corpus: generated text (words from a fixed list, one sentence per line); "
            "tokenize is byte-level (uint16 token file, twice the text's size on disk); each train "
            f"is {args.steps} steps of gpt2-tiny under plans/gpt2-tiny/example.json.",
            "",
            *rows,
            "",
        ]
    )
    return harness.emit(name, text, args.write)
