"""The largest model, and the largest micro-batch, each back-end trains under a budget.

For every back-end (``--backend``, repeatable, the names of tools/bench/train.py)
and family (``--family gpt2|llama``), bisect over a ladder of model sizes for the
largest rung that trains at all: a probe is a short bench_train run (``--steps``
steps, default 2) of that rung at ``--micro-batch``, and it fits when the run ends
with ``"fits": true`` (protrain: the planner finds a plan under the budget and
the executor trains it; the others: no out-of-memory error under the CUDA memory
cap). Then, for ``--mb-model`` (default: the largest fitting rung), bisect over
``--micro-batches`` for the largest micro-batch that fits.

Ladders: ``planner/commands/fit.py``'s ``gpt2_ladder`` / ``llama_ladder`` (GPT-2 124M to
261B, LLaMA 1.1B to 405B-shaped; what ``protrain fit`` bisects analytically), or
with ``--tiny`` bench_train's six tiny shapes per family (byte vocabulary, 2-6
layers, width 32-256), for a CPU rehearsal in seconds.

On CUDA every probe runs in its own subprocess under
``torch.cuda.set_per_process_memory_fraction(budget / total)``, so an OOM ends the
probe, not the search. On CPU probes run in this process (``--subprocess`` to
change that) and nothing caps memory: only protrain's planner sees the budget,
every other back-end "fits" whatever ran, and the result says
``budget_enforced: false``. Bisection assumes fitting is monotone along the ladder
and in the micro-batch, as planner/commands/fit.py does.

One JSON line per probe and one per (back-end, family) result on stdout (and
``--jsonl``), progress on stderr.

    python -m tools.bench fit --device cpu --tiny --budget 2MiB \\
        --backend protrain --backend torch-plain
    python -m tools.bench fit --budget 24GiB --seq 1024 --backend protrain --backend fsdp2-offload
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tools.bench import harness
from tools.bench import train as bench_train
from tools.bench import train_report as bench_report

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)


def log(msg: str) -> None:
    print(f"[bench_fit] {msg}", file=sys.stderr, flush=True)


def ladder_size(family: str, tiny: bool, seq: int) -> int:
    if tiny:
        return len(bench_train.TINY_LADDERS[family])
    from protrain.planner.commands.fit import ladder

    return len(ladder(family, seq))


def rung_name(family: str, tiny: bool, i: int) -> str:
    return f"{'tiny' if tiny else 'ladder'}:{family}:{i}"


class Prober:
    """Runs bench_train probes and remembers them (a probe is never run twice)."""

    def __init__(self, args):
        self.args = args
        self.seen: dict[tuple, dict] = {}
        self.out = open(args.jsonl, "a") if args.jsonl else None  # noqa: SIM115

    def emit(self, rec: dict) -> None:
        line = json.dumps(rec)
        print(line, flush=True)
        if self.out:
            self.out.write(line + "\n")
            self.out.flush()

    def __call__(self, backend: str, model: str, micro_batch: int) -> dict:
        key = (backend, model, micro_batch)
        if key in self.seen:
            return self.seen[key]
        a = self.args
        argv = [
            "--model",
            model,
            "--micro-batch",
            str(micro_batch),
            "--seq",
            str(a.seq),
            "--steps",
            str(a.steps),
            "--warmup",
            str(a.steps - 1),
            "--profile-iters",
            "1",
            "--device",
            a.device,
            "--timeout",
            str(a.timeout),
        ]
        for flag, value in (
            ("--budget", a.budget),
            ("--dtype", a.dtype),
            ("--hardware", a.hardware),
            ("--threads", a.threads),
        ):
            if value is not None:
                argv += [flag, str(value)]
        t0 = time.perf_counter()
        if a.subprocess:
            rec = bench_train.spawn(bench_train.parse(argv), argv, backend)
        else:
            wargs = bench_train.parse([*argv, "--worker", backend])
            try:
                rec = bench_train.worker(wargs)
            except Exception as e:  # the probe's answer is "did not run", with why
                rec = {
                    "backend": backend,
                    "model": model,
                    "fits": None,
                    "error": bench_train.first_line(e),
                }
        rec = {
            "kind": "probe",
            "backend": backend,
            "model": rec.get("model", model),
            "n_params": rec.get("n_params"),
            "micro_batch": micro_batch,
            "fits": rec.get("fits"),
            "why": rec.get("reason") or rec.get("skipped") or rec.get("error"),
            "tokens_per_s": rec.get("tokens_per_s"),
            "peak_dev_bytes": rec.get("peak_dev_bytes"),
            "budget_enforced": rec.get("budget_enforced"),
            "seconds": round(time.perf_counter() - t0, 2),
        }
        log(
            f"{backend:24s} {rec['model']:18s} mb {micro_batch:<3d} "
            f"{ {True: 'fits', False: 'no', None: 'did not run'}[rec['fits']] }"
            + (f"  ({rec['why']})" if rec["why"] else "")
        )
        self.emit(rec)
        self.seen[key] = rec
        return rec


def bisect(n: int, fits) -> tuple[int, dict | None, dict | None]:
    """Largest i in [0, n) with fits(i) true, assuming monotone; (-1, None, first) if none.

    Returns (index, its probe, the probe of the first index that did not fit or None).
    A probe that did not run (``fits`` None) stops the search: nothing is known past it.
    """
    lo, hi, best, stop = -1, n, None, None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        rec = fits(mid)
        if rec["fits"] is None:
            return lo, best, rec
        if rec["fits"]:
            lo, best = mid, rec
        else:
            hi, stop = mid, rec
    return lo, best, stop


def fit_one(prober: Prober, backend: str, family: str, args) -> dict:
    n = ladder_size(family, args.tiny, args.seq)
    t0 = time.perf_counter()
    i, best, stop = bisect(
        n, lambda k: prober(backend, rung_name(family, args.tiny, k), args.micro_batch)
    )
    result = {
        "kind": "result",
        "backend": backend,
        "family": family,
        "device": args.device,
        "budget": args.budget,
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "ladder": "tiny" if args.tiny else "planner/commands/fit.py",
        "ladder_rungs": n,
        "largest": best["model"] if best else None,
        "largest_n_params": best["n_params"] if best else None,
        "largest_index": i if best else None,
        "limit": (stop["why"] or "does not fit") if stop else "end of the ladder",
        "budget_enforced": (best or stop or {}).get("budget_enforced"),
    }
    if stop is not None and stop["fits"] is None:
        result["limit"] = f"probe did not run: {stop['why']}"
    mb_model = args.mb_model or (best["model"] if best else None)
    if mb_model:
        mbs = sorted(set(args.micro_batches))
        j, mb_best, mb_stop = bisect(len(mbs), lambda k: prober(backend, mb_model, mbs[k]))
        result.update(
            mb_model=mb_model,
            largest_micro_batch=mbs[j] if mb_best else None,
            micro_batch_limit=(mb_stop["why"] or "does not fit")
            if mb_stop
            else f"largest candidate ({mbs[-1]})",
        )
    result["seconds"] = round(time.perf_counter() - t0, 1)
    prober.emit(result)
    return result


def main(argv: list[str] | None = None, name: str = "fit") -> int:
    ap = harness.parser(name, __doc__, rounds=1, what="searches (one: a probe's answer is kept)")
    ap.add_argument(
        "--backend",
        action="append",
        choices=bench_train.BACKENDS,
        help="back-end (repeatable; default protrain and torch-plain)",
    )
    ap.add_argument(
        "--family",
        action="append",
        choices=("gpt2", "llama"),
        help="model family (repeatable; default both)",
    )
    ap.add_argument("--tiny", action="store_true", help="the tiny ladders (CPU rehearsal)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--dtype", default=None, help="compute dtype (bench_train's default)")
    ap.add_argument("--budget", default=None, help="memory budget, e.g. 24GiB")
    ap.add_argument(
        "--seq", type=int, default=None, help="sequence length (default 1024; 32 with --tiny)"
    )
    ap.add_argument("--micro-batch", type=int, default=1, help="micro-batch of the size search")
    ap.add_argument(
        "--micro-batches",
        type=int,
        nargs="+",
        default=list(MICRO_BATCHES),
        help="candidates of the micro-batch search",
    )
    ap.add_argument(
        "--mb-model",
        default=None,
        help="model of the micro-batch search (default: the largest fitting rung)",
    )
    ap.add_argument("--steps", type=int, default=2, help="steps per probe (the last one timed)")
    ap.add_argument(
        "--hardware",
        default=None,
        help="protrain spec name or file (default: probe; --tiny defaults to cpu)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads per probe")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per probe (subprocess only)")
    ap.add_argument(
        "--subprocess",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one subprocess per probe (default: on CUDA yes, on CPU no)",
    )
    ap.add_argument("--jsonl", default=None, help="also append every line to this file")
    args = ap.parse_args(argv)
    harness.no_baseline(ap, args)
    if args.write or args.rounds != 1:
        ap.error("fit writes JSON lines (--jsonl), not a section, and searches once")

    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.subprocess is None:
        args.subprocess = args.device.startswith("cuda")
    if args.seq is None:
        args.seq = 32 if args.tiny else 1024
    if args.tiny and args.hardware is None:
        args.hardware = "cpu"  # probing the machine costs ~10 s a probe; tiny runs want seconds
    if args.steps < 2:
        ap.error("--steps must be at least 2 (one warm-up, one timed)")
    backends = list(dict.fromkeys(args.backend or ["protrain", "torch-plain"]))
    families = list(dict.fromkeys(args.family or ["gpt2", "llama"]))
    prober = Prober(args)
    results = [fit_one(prober, b, f, args) for f in families for b in backends]
    for r in results:
        log(
            f"{r['backend']:24s} {r['family']:6s} largest {r['largest']} "
            f"({bench_report.human_count(r['largest_n_params'])} params), next stopped by: "
            f"{r['limit']}; largest micro-batch of {r.get('mb_model')}: "
            f"{r.get('largest_micro_batch')}"
        )
    return 0
