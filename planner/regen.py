"""Regenerate the plan library: analytic profiles, plans per (model, card, world size), and its
index.

Generated files, each made from the one before (the schema from the plan Structs):

    plans/profiles/<model>/<model>-<hardware>-b<B>-s<S>.json  analytic profiles (~3 s each)
    plans/<model>/<hardware>-w<W>.json                        plans, from the committed profiles
    plans/README.md                                           the index of the plans
    plans/schema/plan-v<N>.schema.json                        the current version's JSON Schema

Profiles are regenerated only when asked (``--profiles``), because estimating one
takes seconds and they change only when the analytic model or a hardware spec
does. A measured profile committed next to them (``source: measured``, e.g.
``<model>-<hardware>-b<B>-s<S>-measured.json``) replaces the analytic one of the
same (model, hardware, micro-batch, seq len): a measurement beats an estimate.
Plans and the index are always regenerated, from whatever profiles are committed.

    python -m protrain.planner.regen               # rewrite plans and the index
    python -m protrain.planner.regen --profiles    # re-estimate profiles first, then as above
    python -m protrain.planner.regen --check       # exit 1 if a plan or the index is stale (CI)
    python -m protrain.planner.regen --check-profiles   # exit 1 if a profile is stale (slow)

``--check`` regenerates in memory and lists every file that differs, is missing or
is extra; it never writes. ``--root DIR`` points the tool at another checkout's
``plans/`` (the tests use a copy). Same profiles, same planner → same bytes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The library: one training shape per model, the batch people run at this size
# (bf16 compute, fp32 master weights and Adam state).
#   gpt2-xl / gpt2-10b: micro-batch 8 at GPT-2's full context (1024), as the
#     ZeRO-Offload and ProTrain papers train GPT-2 variants;
#   7B-13B: micro-batch 4 × 2048, the usual fine-tuning shape at this size;
#   34B / 70B: one sequence of 4096 (LLaMA-2's context), the most a single
#     card could be asked to hold.
SHAPES: dict[str, tuple[int, int]] = {
    "gpt2-xl": (8, 1024),
    "gpt2-10b": (8, 1024),
    "llama-7b": (4, 2048),
    "mistral-7b": (4, 2048),
    "llama-13b": (4, 2048),
    "llama-34b": (1, 4096),
    "llama-70b": (1, 4096),
    "llama-3.1-8b": (4, 2048),
    "mixtral-8x7b": (1, 4096),
    "llama-3.1-8b-lora": (4, 2048),
    "llama-70b-lora": (1, 4096),
}
# Library models that are Hugging Face config.json files under plans/configs/ (no weights):
# one dense, one mixture of experts. Their profiles and plans carry the library name.
HF_CONFIGS = {
    "llama-3.1-8b": "plans/configs/llama-3.1-8b",
    "mixtral-8x7b": "plans/configs/mixtral-8x7b",
}
# LoRA fine-tuning (peft; planner/models/lora.py): a library model with `protrain plan --lora`'s
# defaults (r 16, alpha 32, the attention projections), its base frozen (Param.frozen).
LORA = {"llama-3.1-8b-lora": "llama-3.1-8b", "llama-70b-lora": "llama-70b"}
HARDWARE = ["rtx3090", "rtx4090", "a100-40g", "a100-80g", "h100", "h200"]
WORLD_SIZES = (1, 4)
COMPUTE_DTYPE = "bfloat16"


@dataclass(frozen=True)
class Entry:
    """One (model, hardware) cell of the library: one profile, one plan per world size."""

    model: str
    hardware: str
    micro_batch: int
    seq_len: int

    @property
    def key(self) -> tuple[str, str, int, int]:
        return (self.model, self.hardware, self.micro_batch, self.seq_len)

    def profile_rel(self, measured: bool = False) -> str:
        # One folder per model: plans/<dir>/*.json is where plans live (and what the
        # schema tests round-trip), so profiles sit one level deeper.
        stem = f"{self.model}-{self.hardware}-b{self.micro_batch}-s{self.seq_len}"
        return f"plans/profiles/{self.model}/{stem}{'-measured' if measured else ''}.json"

    def plan_rel(self, world_size: int) -> str:
        return f"plans/{self.model}/{self.hardware}-w{world_size}.json"


ENTRIES = [Entry(m, h, *SHAPES[m]) for m in SHAPES for h in HARDWARE]


def _pool_map(fn, jobs: list[tuple], n_workers: int) -> list:
    """``[fn(*job) for job in jobs]``, over ``n_workers`` processes when more than one.

    Spawned, not forked: each worker imports torch itself, and results come back in
    job order, so the output never depends on which worker finished first.
    """
    if n_workers <= 1 or len(jobs) <= 1:
        return [fn(*job) for job in jobs]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(n_workers, len(jobs)), mp_context=ctx) as pool:
        futures = [pool.submit(fn, *job) for job in jobs]
        return [f.result() for f in futures]


# ---------------------------------------------------------------------------- profiles


def analytic_profile_bytes(entry: Entry, spec_path: str) -> bytes:
    """The analytic profile of one entry, estimated for the spec file at ``spec_path``."""
    from protrain.planner.commands.profile_plan import build_profile
    from protrain.planner.profiling.profile import dump_profile

    base = LORA.get(entry.model, entry.model)
    if (
        base in HF_CONFIGS or entry.model in LORA
    ):  # named by its library name, not by a machine's path
        from protrain.planner.hardware.spec import find_spec
        from protrain.planner.models.lora import LoraSpec, build_model
        from protrain.planner.models.zoo import block_paths
        from protrain.planner.profiling.analytic import analytic_profile

        root = Path(spec_path).resolve().parents[2]
        model = build_model(
            f"hf:{root / HF_CONFIGS[base]}" if base in HF_CONFIGS else base,
            LoraSpec() if entry.model in LORA else None,
            device="meta",
        )
        profile = analytic_profile(
            model,
            name=entry.model,
            blocks=block_paths(model),
            micro_batch=entry.micro_batch,
            seq_len=entry.seq_len,
            compute_dtype=COMPUTE_DTYPE,
            spec=find_spec(spec_path),
        )
        return dump_profile(profile)
    profile = build_profile(
        model_name=entry.model,
        batch=entry.micro_batch,
        seq=entry.seq_len,
        dtype=COMPUTE_DTYPE,
        device=None,
        analytic=True,
        hardware=spec_path,
        echo=lambda _line: None,
    )
    return dump_profile(profile)


def expected_profiles(root: Path, n_workers: int) -> dict[str, bytes]:
    jobs = [(e, str(root / "plans" / "hardware" / f"{e.hardware}.json")) for e in ENTRIES]
    return dict(
        zip([e.profile_rel() for e in ENTRIES], _pool_map(analytic_profile_bytes, jobs, n_workers))
    )


@dataclass
class Chosen:
    """The profile a library entry is planned from."""

    rel: str
    source: str  # "measured" or "analytic"
    data: bytes


def choose_profiles(root: Path) -> tuple[dict[Entry, Chosen], list[str]]:
    """Each entry's profile (measured over analytic), and the problems found on the way.

    Problems are: an entry with no profile, a profile file that belongs to no entry
    or whose name does not say what it holds, and an analytic profile whose embedded
    hardware spec is no longer ``plans/hardware/<name>.json`` (made for a spec that
    has since changed: ``--profiles`` remakes it).
    """
    from protrain.planner.hardware.spec import load_spec
    from protrain.planner.profiling.profile import load_profile
    from protrain.plans.errors import ProtrainError

    by_key = {e.key: e for e in ENTRIES}
    chosen: dict[Entry, Chosen] = {}
    problems: list[str] = []
    specs = {}
    for path in sorted((root / "plans" / "profiles").rglob("*.json")):
        rel = path.relative_to(root).as_posix()
        data = path.read_bytes()
        try:
            profile = load_profile(data)
        except ProtrainError as e:
            problems.append(f"{rel}: unreadable profile ({e.message})")
            continue
        t = profile.training
        key = (profile.model.name, profile.hardware.name, t.micro_batch, t.seq_len)
        entry = by_key.get(key)
        if entry is None or t.compute_dtype != COMPUTE_DTYPE:
            problems.append(
                f"{rel}: extra (a profile of {key}, {t.compute_dtype}: not in the "
                "library table SHAPES × HARDWARE of planner/regen.py)"
            )
            continue
        measured = profile.source == "measured"
        if rel != entry.profile_rel(measured):
            problems.append(
                f"{rel}: misnamed; this {profile.source} profile belongs at "
                f"{entry.profile_rel(measured)}"
            )
            continue
        if not measured:
            if entry.hardware not in specs:
                specs[entry.hardware] = load_spec(
                    root / "plans" / "hardware" / f"{entry.hardware}.json"
                )
            if profile.hardware != specs[entry.hardware]:
                problems.append(
                    f"{rel}: stale (made for an older plans/hardware/{entry.hardware}.json; "
                    "run python -m protrain.planner.regen --profiles)"
                )
        if entry not in chosen or measured:
            chosen[entry] = Chosen(rel, profile.source, data)
    for e in ENTRIES:
        if e not in chosen:
            problems.append(
                f"{e.profile_rel()}: missing (run python -m protrain.planner.regen --profiles)"
            )
    return chosen, problems


# ---------------------------------------------------------------------------- plans


def plan_bytes(profile_data: bytes, world_size: int) -> tuple[bytes | None, str]:
    """The plan ``make_plan`` writes for this profile at the spec's usable memory, or
    ``(None, why)`` when nothing fits (the BudgetError's message, without its hint)."""
    from protrain.planner.profiling.profile import load_profile
    from protrain.planner.search.planning import make_plan
    from protrain.plans import plan as P
    from protrain.plans.errors import BudgetError

    profile = load_profile(profile_data)
    try:
        plan, _ = make_plan(profile, profile.hardware.usable_memory_bytes, world_size=world_size)
    except BudgetError as e:
        return None, e.message
    return P.dump(plan), ""


@dataclass
class Row:
    """One line of the index: a plan, or the record that none fits."""

    entry: Entry
    world_size: int
    profile: Chosen
    plan: object | None  # protrain.plans.plan.Plan, when one fits
    why: str  # BudgetError message when none fits


def expected_library(root: Path, n_workers: int) -> tuple[dict[str, bytes], list[str]]:
    """Every plan file and the index, as they should be, from the committed profiles."""
    from protrain import plans
    from protrain.planner import example_plan

    chosen, problems = choose_profiles(root)
    cells = [(e, w) for e in ENTRIES if e in chosen for w in WORLD_SIZES]
    results = _pool_map(plan_bytes, [(chosen[e].data, w) for e, w in cells], n_workers)
    files: dict[str, bytes] = {}
    rows = []
    for (e, w), (data, why) in zip(cells, results):
        if data is not None:
            files[e.plan_rel(w)] = data
        rows.append(Row(e, w, chosen[e], plans.load(data) if data is not None else None, why))
    files["plans/README.md"] = render_index(rows).encode()
    files[schema_rel()] = example_plan.schema()
    return files, problems


def schema_rel() -> str:
    """The JSON Schema of the current plan version (older versions' files stay as committed;
    its bytes are planner/example_plan.py's, the one writer of the schema file)."""
    from protrain.plans import plan as P

    return f"plans/schema/plan-v{P.SCHEMA_VERSION}.schema.json"


# ---------------------------------------------------------------------------- the index


def run_length(letters: list[str]) -> str:
    """``["C", "C", "C", "K"]`` → ``C×3 K×1``."""
    runs: list[list] = []
    for letter in letters:
        if runs and runs[-1][0] == letter:
            runs[-1][1] += 1
        else:
            runs.append([letter, 1])
    return " ".join(f"{letter}×{n}" for letter, n in runs)


def abbreviate(strip: str, max_period: int = 12) -> str:
    """A policy strip, short: runs of one letter and repeated groups counted.

    ``S C S C S C K K`` → ``(S×1 C×1)×3 K×2``. Greedy from the left: at each
    position take the unit (up to ``max_period`` blocks) whose back-to-back repeats
    cover the most blocks, the shorter unit on a tie. The search's layouts (swap
    early, checkpoints interleaved, keep last) come out in a few groups.
    """
    letters = strip.split()
    out, i = [], 0
    while i < len(letters):
        best_p, best_k = 1, 1
        for p in range(1, max_period + 1):
            unit = letters[i : i + p]
            if len(unit) < p:
                break
            k = 1
            while letters[i + k * p : i + (k + 1) * p] == unit:
                k += 1
            if (p == 1 or k > 1) and p * k > best_p * best_k:
                best_p, best_k = p, k
        unit = letters[i : i + best_p]
        if best_p == 1:
            out.append(f"{unit[0]}×{best_k}")
        else:
            out.append(f"({run_length(unit)})×{best_k}")
        i += best_p * best_k
    return " ".join(out)


def tokens_per_s(plan) -> float:
    t = plan.training
    return (
        t.micro_batch
        * t.seq_len
        * t.grad_accum
        * t.world_size
        / (plan.prediction.iter_time_us / 1e6)
    )


def render_index(rows: list[Row]) -> str:
    from protrain.planner.hardware.units import human_bytes, human_count
    from protrain.planner.views.show import policy_strip

    n_params = {r.entry.model: r.plan.model.n_params for r in rows if r.plan is not None}
    shapes = "\n".join(f"| {m} | {b} × {s} |" for m, (b, s) in SHAPES.items())
    lines = [
        "# Plan library",
        "",
        "<!-- Generated by planner/regen.py from plans/profiles/; do not edit by hand. -->",
        "",
        "Ready-made plans for common models on common cards, made by the planner from",
        "committed profiles. Pick the file for your model, card and number of GPUs and pass",
        "it to `protrain train --plan`.",
        "",
        "## Naming",
        "",
        "- `plans/<model>/<hardware>-w<W>.json`: the plan for `<model>` on `W` ranks of the card",
        "  described by `plans/hardware/<hardware>.json`, with that card's usable memory as the",
        "  budget, micro-batch and sequence length as below, bf16 compute, grad accumulation 1.",
        "- `plans/profiles/<model>/<model>-<hardware>-b<B>-s<S>.json`: the analytic profile it was",
        "  made from (`protrain profile --analytic`). A measured profile of the same model, card",
        "  and shape, committed as `…-b<B>-s<S>-measured.json` (`source: measured`), takes",
        "  precedence over the analytic one.",
        "",
        "| model | micro-batch × seq |",
        "|---|---|",
        shapes,
        "",
        "## Regenerating",
        "",
        "```",
        "python -m protrain.planner.regen               # plans and this index, from the committed "
        "profiles",
        "python -m protrain.planner.regen --profiles    # re-estimate the analytic profiles first "
        "(slow)",
        "python -m protrain.planner.regen --check       # CI: fail if a plan or this index is "
        "stale",
        "python -m protrain.planner.regen --check-profiles   # fail if an analytic profile is "
        "stale (slow)",
        "```",
        "",
        "A plan is **stale** when its bytes differ from what the current planner makes from",
        "its stored profile (a cost-model, search or format change, or a new profile). `--check`",
        "regenerates every plan and this index in memory and fails, naming each file that",
        "differs, is missing or is extra; the fix is to run the tool and commit the diff, which",
        "shows what the change did to every plan. A profile is stale when the analytic model or",
        "its hardware spec changed: rerun with `--profiles`.",
        "",
        "## Largest model per card",
        "",
        "The largest model in the library with a plan that fits (predicted peak within the",
        "card's usable memory, offloaded states and swapped activations within the host budget:",
        "the spec's host RAM less 10% and 2 GiB), and its predicted throughput. Full training;",
        "the LoRA plans (`-lora`: a frozen base, planner/models/lora.py) are in the index below.",
        "",
        "| hardware | one GPU | four GPUs (ZeRO-3) |",
        "|---|---|---|",
    ]
    for hw in HARDWARE:
        cells = []
        for w in WORLD_SIZES:
            fits = [
                r
                for r in rows
                if r.entry.hardware == hw
                and r.world_size == w
                and r.plan
                and r.entry.model not in LORA
            ]
            best = max(fits, key=lambda r: n_params[r.entry.model], default=None)
            cells.append(
                "none"
                if best is None
                else f"{best.entry.model} ({human_count(n_params[best.entry.model])} parameters, "
                f"{tokens_per_s(best.plan):,.0f} tokens/s)"
            )
        lines.append(f"| {hw} | {' | '.join(cells)} |")
    lines += [
        "",
        "## Index",
        "",
        "Predicted by the planner's cost model (not measured). Tokens/s counts all ranks:",
        "micro-batch × seq × grad accumulation × world size / iteration time. Peak is per rank.",
        "Activations: one letter per block in execution order (K keep, S swap, C checkpoint),",
        "abbreviated: `C×3` is three blocks in a row, `(S×2 C×1)×4` a group repeated four times;",
        "`protrain show PLAN` prints the full strip.",
        "Chunks: persistent of total, and the device buffers for offloaded ones.",
        "",
        "| plan | model | hardware | W | B × S | tokens/s | peak / budget | activations | chunks | "
        "profile |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = sorted(
        rows,
        key=lambda r: (
            n_params.get(r.entry.model, 0),
            r.entry.model,
            HARDWARE.index(r.entry.hardware),
            r.world_size,
        ),
    )
    not_fitting = []
    for r in order:
        e = r.entry
        head = f"| {e.model} | {e.hardware} | {r.world_size} | {e.micro_batch} × {e.seq_len} |"
        profile = r.profile.source
        if r.plan is None:
            lines.append(f"| — {head} does not fit | — | — | — | {profile} |")
            not_fitting.append(f"- {e.model} on {e.hardware}, W={r.world_size}: {r.why}")
            continue
        p = r.plan
        name = e.plan_rel(r.world_size).removeprefix("plans/")
        peak, budget = p.prediction.peak_memory_bytes, p.hardware.budget_bytes
        pl = p.placement
        lines.append(
            f"| [{name}]({name}) {head} {tokens_per_s(p):,.0f} | "
            f"{human_bytes(peak)} / {human_bytes(budget)} ({100 * peak / budget:.0f}%) | "
            f"{abbreviate(policy_strip(p))} | {pl.n_persist}/{len(p.chunks.items)}, "
            f"{pl.n_buffer} buf | {profile} |"
        )
    if not_fitting:
        lines += [
            "",
            "## Does not fit",
            "",
            "No configuration fits the card's usable memory or, where it says `host memory`, the",
            "host budget (the planner's BudgetError / HostMemoryError):",
            "",
        ]
        lines += not_fitting
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- compare and write


def managed_files(root: Path) -> set[str]:
    """Committed files this tool owns: every plan in a library model's folder, the index and
    the current plan schema."""
    found = {f"plans/{m}/{p.name}" for m in SHAPES for p in (root / "plans" / m).glob("*.json")}
    if (root / schema_rel()).exists():
        found.add(schema_rel())
    if (root / "plans" / "README.md").exists():
        found.add("plans/README.md")
    return found


def stale_files(root: Path, expected: dict[str, bytes], present: set[str]) -> list[str]:
    out = []
    for rel in sorted(set(expected) | present):
        path = root / rel
        if rel not in expected:
            out.append(f"{rel}: extra (no longer generated)")
        elif not path.exists():
            out.append(f"{rel}: missing")
        elif path.read_bytes() != expected[rel]:
            out.append(f"{rel}: differs")
    return out


def write_files(root: Path, expected: dict[str, bytes], present: set[str]) -> int:
    written = 0
    for rel in sorted(present - set(expected)):
        (root / rel).unlink()
        print(f"removed {rel}")
    for rel, data in sorted(expected.items()):
        path = root / rel
        if path.exists() and path.read_bytes() == data:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written += 1
        print(f"wrote {rel}")
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--check",
        action="store_true",
        help="regenerate plans and the index in memory; exit 1 if any committed file differs",
    )
    mode.add_argument(
        "--check-profiles",
        action="store_true",
        help="re-estimate the analytic profiles in memory; exit 1 if any differs (slow)",
    )
    mode.add_argument(
        "--profiles",
        action="store_true",
        help="re-estimate and rewrite the analytic profiles before the plans (slow)",
    )
    ap.add_argument(
        "--root",
        type=Path,
        default=ROOT,
        help="checkout whose plans/ is read and written [default: this one]",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="worker processes [default: all cores]",
    )
    args = ap.parse_args(argv)
    root: Path = args.root.resolve()
    t0 = time.perf_counter()

    if args.check_profiles or args.profiles:
        profiles = expected_profiles(root, args.jobs)
        # Analytic files only: a measured profile is never rewritten or removed here.
        present = {
            p.relative_to(root).as_posix()
            for p in (root / "plans" / "profiles").rglob("*.json")
            if b'"source": "measured"' not in p.read_bytes()
        }
        if args.check_profiles:
            return _report(stale_files(root, profiles, present), t0, "--profiles")
        write_files(root, profiles, present)

    files, problems = expected_library(root, args.jobs)
    present = managed_files(root)
    if args.check:
        return _report(problems + stale_files(root, files, present), t0, "")
    n = write_files(root, files, present)
    for p in problems:
        print(f"warning: {p}", file=sys.stderr)
    print(
        f"{len(files) - 2} plans, the index and the schema up to date ({n} written) in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    return 1 if problems else 0


def _report(stale: list[str], t0: float, flag: str) -> int:
    if stale:
        fix = f"python -m protrain.planner.regen {flag}".rstrip()
        print(f"stale (run {fix} and commit the diff):\n  " + "\n  ".join(stale), file=sys.stderr)
        return 1
    print(f"up to date ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
