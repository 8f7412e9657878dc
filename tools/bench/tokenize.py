"""Peak RSS and throughput of ``protrain tokenize`` through a Hugging Face BPE tokenizer.

Issue 39 item 9: a tokenizer holds ~230 bytes of RAM per byte of what it encodes, and a
one-line file used to reach it whole. This measures, each in a process of its own:

- the tokenizer alone: extra peak RSS per byte of text for one ``encode`` of a piece of
  each size (``--pieces``), and its MB/s;
- ``protrain tokenize --tokenizer DIR`` end to end on each generated corpus (``--corpora``):
  ``line:SIZE``, one line of SIZE bytes (words and spaces, no newline, some multi-byte
  characters), or ``text:SIZE``, sentences of 5-25 words one per line; its peak RSS
  (``ru_maxrss`` from ``wait4``) and MB/s of text.

The tokenizer is a byte-level BPE trained here, offline, as tests/test_data.py's (300
ids: ~0.4 tokens per byte of the corpus, more tokens per byte than a real vocabulary,
so more memory per byte). Corpora are written under ``--dir`` and deleted after.

    python -m tools.bench tokenize --corpora line:64MiB text:1GiB --dir /tmp/tok-bench [--write]
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.bench import harness

WORDS = (
    "the planner writes a plan and executor replays it on every rank chunks of parameters move "
    "between host device as says activations are kept swapped to or recomputed in backward small "
    "model learns these sentences quickly when sees them again héllo wörld €uro"
).split()

_PIECE = """
import json, random, resource, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
n = int(sys.argv[2])
words = json.loads(sys.argv[3])
rng = random.Random(0)
text = " ".join(rng.choice(words) for _ in range(n // 4))
text = text.encode()[:n].decode("utf-8", "ignore")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
ids = tok.encode(text, add_special_tokens=False).ids
dt = time.perf_counter() - t
grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
print(json.dumps({"bytes": n, "tokens": len(ids), "grew": grew, "s": dt}))
"""


def parse_size(text: str) -> int:
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9}
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def make_tokenizer(directory: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(
        ["the planner writes a plan", "chunks move between host and device"], trainer
    )
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return directory


def generate(path: Path, kind: str, size: int, seed: int = 0) -> None:
    """``size`` bytes: one line of words (``line``) or sentences one per line (``text``)."""
    rng = random.Random(seed)
    if kind == "line":
        block = " ".join(rng.choice(WORDS) for _ in range(1 << 16)) + " "
    else:
        block = "".join(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 25))) + "\n"
            for _ in range(4096)
        )
    data = block.encode()
    with open(path, "wb") as f:
        written = 0
        while written < size:
            piece = data[: size - written]
            if len(piece) < len(data):  # the end: never stop inside a character
                piece = piece.decode("utf-8", "ignore").encode()
                piece += b" " * (size - written - len(piece))
            f.write(piece)
            written += len(piece)


def run(cmd: list[str]) -> tuple[int, float, float, str]:
    """(peak RSS in bytes, wall seconds, CPU seconds, output) of ``cmd``; raises if it fails."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({code}):\n{out[-3000:]}")
    cpu = usage.ru_utime + usage.ru_stime
    return usage.ru_maxrss * 1024, time.perf_counter() - t0, cpu, out


def main(argv: list[str] | None = None, name: str = "tokenize") -> int:
    ap = harness.parser(name, __doc__, rounds=1, what="runs of each command (one process each)")
    ap.add_argument("--pieces", nargs="*", default=["64KiB", "1MiB", "4MiB"])
    ap.add_argument("--corpora", nargs="*", default=["line:64MiB", "text:64MiB"])
    ap.add_argument("--dir", default=None, help="where corpora go [default: a temporary one]")
    args = ap.parse_args(argv)
    harness.no_baseline(ap, args)
    if args.rounds != 1:
        ap.error("--rounds: each command runs once per piece and corpus")
    directory = Path(args.dir or tempfile.mkdtemp(prefix="protrain-tok-"))
    directory.mkdir(parents=True, exist_ok=True)
    mib = 1 << 20
    pieces = [
        "| piece | tokens | tokenizer's extra peak RSS | bytes of RAM per byte of text | MB/s |",
        "|---:|---:|---:|---:|---:|",
    ]
    corpora = [
        "| corpus | tokens | `protrain tokenize` peak RSS | wall (CPU) | MB/s of wall (of CPU) |",
        "|---|---:|---:|---:|---:|",
    ]
    try:
        tok = make_tokenizer(directory / "tok")
        for size in map(parse_size, args.pieces):
            *_, out = run(
                [sys.executable, "-c", _PIECE, str(tok / "tokenizer.json"), str(size),
                 json.dumps(WORDS)]
            )  # fmt: skip
            r = json.loads(out)
            pieces.append(
                f"| {size / 1024:,.0f} KiB | {r['tokens']:,} | {r['grew'] / mib:,.1f} MiB "
                f"| {r['grew'] / size:,.0f} | {size / r['s'] / 1e6:.2f} |"
            )
            print(pieces[-1], file=sys.stderr, flush=True)
        for spec in args.corpora:
            kind, size_text = spec.split(":")
            size = parse_size(size_text)
            text, tokens = directory / f"{kind}-{size}.txt", directory / f"{kind}-{size}.tokens"
            generate(text, kind, size)
            try:
                rss, wall, cpu, out = run(
                    [sys.executable, "-m", "protrain.planner", "tokenize", "--data", str(text),
                     "--tokenizer", str(tok), "-o", str(tokens)]
                )  # fmt: skip
                n = (tokens.stat().st_size - 32) // 2  # uint16 ids after a 32-byte header
            finally:
                text.unlink(missing_ok=True)
                tokens.unlink(missing_ok=True)
            label = "one line" if kind == "line" else "lines"
            corpora.append(
                f"| {size / mib:,.0f} MiB, {label} | {n:,} | {rss / mib:,.0f} MiB | {wall:,.0f} s "
                f"({cpu:,.0f} s) | {size / wall / 1e6:.2f} ({size / cpu / 1e6:.2f}) |"
            )
            print(corpora[-1], file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(directory / "tok", ignore_errors=True)
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
            f"Date: {harness.now()}. Each figure is a process of its own; peak RSS is its "
            "`ru_maxrss` from `wait4`. Tokenizer: a byte-level BPE trained offline (300 ids).",
            "",
            "The tokenizer alone, one `Tokenizer.encode` of a piece:",
            "",
            *pieces,
            "",
            "`protrain tokenize --data CORPUS --tokenizer DIR -o CORPUS.tokens` end to end:",
            "",
            *corpora,
            "",
        ]
    )
    return harness.emit(name, text, args.write)
