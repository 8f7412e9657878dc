"""What every benchmark shares: its command line, repeats and their spread, a baseline
measured in the same run from a git ref, and its section of BENCHMARKS.md.

- ``parser(name)``: the common options, ``--rounds N`` (repeats of the measurement; each
  benchmark says what one round is), ``--baseline REF`` (repeatable) and ``--write``.
- ``summary(xs)`` / ``spread(xs)``: median, least and greatest of repeated measurements, the
  form every table here reports them in ("median (min-max)").
- ``compare(...)``: the same-run baseline. Each REF is exported (``git archive``) into a
  temporary directory and installed there in a virtual environment that sees this one's
  packages (``pip install --no-deps -e``), so nothing of this checkout is touched. Then every
  round runs the benchmark once per tree, trees interleaved (REF, ..., this tree, REF, ...)
  so that drift and load land on all alike, each a fresh process: this checkout's
  ``tools.bench`` with that tree's ``protrain``. A benchmark that supports it hands its
  figures over as ``samples()``: ``{label: [values]}``, one value or more per round.
- ``write_section(name, markdown)``: replaces the section ``## <name>: ...`` of BENCHMARKS.md
  (appends it when missing), leaving every other section as it was. Sections are keyed by
  benchmark name, so a rerun replaces its own.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
BY_HAND = "## By hand:"  # the last section: one-off commands, which no benchmark rewrites
HEADER = """# Benchmarks

One section per benchmark of `python -m tools.bench --list`, headed `## <name>: <title>`:
`python -m tools.bench <name> --write` reruns it and replaces that section only (the last
section, *By hand*, records one-off commands no benchmark reruns). Every figure names the
command that produced it, the machine it ran on and the date, and is reported against a
baseline measured in the same run (same process or interleaved processes, same data),
because absolute times on shared CPU machines drift by more than the effects we measure.
"""


# ---------------------------------------------------------------------------- command line


def parser(
    name: str, doc: str | None, *, rounds: int = 3, what: str = "repeats"
) -> argparse.ArgumentParser:
    """The benchmark's parser with the common options; ``what`` says what one round is."""
    ap = argparse.ArgumentParser(
        prog=f"python -m tools.bench {name}",
        description=(doc or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--rounds", type=int, default=rounds, help=f"{what} (default {rounds})")
    ap.add_argument(
        "--baseline",
        action="append",
        metavar="REF",
        help="git ref to measure in the same run, interleaved with this tree (repeatable; "
        "only benchmarks with samples())",
    )
    ap.add_argument(
        "--write",
        action="store_true",
        help=f"replace this benchmark's section of {BENCHMARKS_MD.name}",
    )
    ap.add_argument("--samples-json", default=None, help=argparse.SUPPRESS)  # (compare's worker)
    return ap


def command(name: str, argv: list[str] | None) -> str:
    """The command line that reruns this measurement, for the section (``argv``: what the
    benchmark's ``main`` got, its preset first)."""
    from tools.bench import BENCHMARKS

    argv = list(sys.argv[2:] if argv is None else argv)
    preset = list(BENCHMARKS[name].preset)
    if argv[: len(preset)] == preset:
        argv = argv[len(preset) :]
    return shlex.join(["python", "-m", "tools.bench", name, *argv])


def no_baseline(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if getattr(args, "baseline", None):
        ap.error(
            "--baseline: this benchmark measures its own baseline in the same run (no samples())"
        )


# ---------------------------------------------------------------------------- repeats and spread


def summary(xs: list[float]) -> dict[str, float]:
    """Median, least, greatest, and their spread relative to the median."""
    med = statistics.median(xs)
    return {
        "median": med,
        "min": min(xs),
        "max": max(xs),
        "spread": (max(xs) - min(xs)) / med if med else 0.0,
    }


def spread(xs: list[float], fmt: str = "{:.3f}", unit: str = "") -> str:
    """``median (min-max)`` of repeated measurements."""
    s = summary(xs)
    return f"{fmt.format(s['median'])}{unit} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


def rounds(n: int, measure: Callable[[int], object], label: str = "round") -> list:
    """``[measure(0), ..., measure(n - 1)]``, each announced on stderr."""
    out = []
    for i in range(n):
        print(f"{label} {i + 1}/{n}", file=sys.stderr, flush=True)
        out.append(measure(i))
    return out


# ---------------------------------------------------------------------------- the machine


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:  # Linux names the CPU model here; platform.processor() is often empty
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out = (
        f"{platform.system()} {platform.release()} {platform.machine()}, {cpu}, "
        f"os.cpu_count()={os.cpu_count()}, Python {platform.python_version()}"
    )
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        out += f", torch {torch.__version__}, torch.set_num_threads({torch.get_num_threads()})"
    return out


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def others_running() -> int:
    """Processes running or runnable on this box now, outside this benchmark's session (the
    processes it times run in it): what shares the cores with the timed ones."""
    mine, n = os.getsid(0), 0
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if d.isdigit():
            try:
                fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            n += fields[0] == "R" and int(fields[3]) != mine  # (state, ..., session)
    return n


# ---------------------------------------------------------------------------- BENCHMARKS.md


def heading(name: str) -> str:
    from tools.bench import BENCHMARKS

    return f"## {name}: {BENCHMARKS[name].title}"


def _find(doc: str, name: str) -> tuple[int, int] | None:
    """The span of section ``name`` in ``doc`` (its heading to the next ``## ``), if any."""
    m = re.search(rf"^## {re.escape(name)}(:[^\n]*)?$", doc, flags=re.M)
    if m is None:
        return None
    end = doc.find("\n## ", m.end())
    return m.start(), len(doc) if end < 0 else end + 1


def write_section(name: str, markdown: str, path: Path | None = None) -> None:
    """Replace section ``name`` of BENCHMARKS.md with ``markdown`` (which starts with its
    heading, ``heading(name)``), or append it; create the file with its header if missing."""
    path = path or BENCHMARKS_MD
    first = markdown.lstrip().split("\n", 1)[0]
    if not re.match(rf"## {re.escape(name)}(:|$)", first):
        raise ValueError(f"section {name!r} must start with its heading, not {first!r}")
    doc = path.read_text() if path.exists() else HEADER
    text = markdown.strip("\n") + "\n"
    span = _find(doc, name)
    if span is None:  # a new section: after the others, before the record of one-off commands
        at = doc.find(f"\n{BY_HAND}")
        doc = (
            doc.rstrip("\n") + "\n\n" + text
            if at < 0
            else doc[: at + 1] + text + "\n" + doc[at + 1 :]
        )
    else:
        a, b = span
        doc = doc[:a] + text + ("\n" + doc[b:] if b < len(doc) else "")
    path.write_text(doc.rstrip("\n") + "\n")
    print(f"wrote section {name!r} of {path.name}", file=sys.stderr)


def emit(name: str, markdown: str, write: bool) -> int:
    """Print the section; with ``--write`` also put it in BENCHMARKS.md."""
    print(markdown)
    if write:
        write_section(name, markdown)
    return 0


# ---------------------------------------------------------------------------- same-run baseline


def short(rev: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", rev],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def this_tree() -> str:
    """This checkout's short commit, ``+`` when tracked files differ from it."""
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return short("HEAD") + ("+" if dirty else "")


def _clean_env() -> dict[str, str]:
    """The environment for a baseline tree's process: no PYTHONPATH, which would put another
    checkout's ``protrain`` ahead of the tree's own install."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def export_tree(rev: str, into: Path) -> Path:
    """``rev``'s tree under ``into``/tree, installed into ``into``/venv; the venv's python."""
    tree = into / "tree"
    tree.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    venv = into / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "-e", str(tree)],
        check=True,
        capture_output=True,
        env=_clean_env(),
    )
    where = subprocess.run(
        [str(py), "-c", "import protrain.planner as p; print(p.__file__)"],
        check=True,
        capture_output=True,
        text=True,
        env=_clean_env(),
    ).stdout.strip()
    if not where.startswith(str(tree)):
        raise RuntimeError(f"the baseline venv imports {where}, not {tree}")
    return py


def _without(argv: list[str], drop: dict[str, bool]) -> list[str]:
    """``argv`` less the options in ``drop`` (name -> takes a value)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        key = a.split("=", 1)[0]
        if key in drop:
            skip = drop[key] and "=" not in a
            continue
        out.append(a)
    return out


def samples_main(
    name: str,
    args: argparse.Namespace,
    argv: list[str] | None,
    samples: Callable[[], dict[str, list[float]]],
) -> dict[str, list[float]] | None:
    """In compare's worker process (``--samples-json``): write ``samples()`` and return None.
    Otherwise the figures of every tree, ``{tree: {label: values}}`` in the run's order."""
    if args.samples_json:
        Path(args.samples_json).write_text(json.dumps(samples()))
        return None
    return compare(name, args.baseline or [], args.rounds, sys.argv[2:] if argv is None else argv)


def compare(
    name: str, refs: list[str], n_rounds: int, argv: list[str]
) -> dict[str, dict[str, list[float]]]:
    """Run benchmark ``name`` in each ref's tree and this one, ``n_rounds`` interleaved rounds,
    a fresh process each; ``{tree: {label: values}}``, the baselines first, this tree last
    (under the key ``this_tree()``)."""
    passthrough = _without(argv, {"--baseline": True, "--write": False, "--rounds": True})
    revs = [short(r) for r in refs]
    current = this_tree()
    got: dict[str, dict[str, list[float]]] = {t: {} for t in [*revs, current]}
    with tempfile.TemporaryDirectory(prefix="protrain-baseline-") as tmp:
        trees = [(rev, str(export_tree(rev, Path(tmp) / rev)), _clean_env()) for rev in revs]
        trees.append((current, sys.executable, dict(os.environ)))
        out = Path(tmp) / "samples.json"
        for i in range(n_rounds):
            for tree, py, env in trees:
                print(f"round {i + 1}/{n_rounds}: {tree}", file=sys.stderr, flush=True)
                cmd = [
                    py,
                    "-m",
                    "tools.bench",
                    name,
                    *passthrough,
                    "--rounds",
                    "1",
                    "--samples-json",
                    str(out),
                ]
                proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
                if proc.returncode:
                    raise RuntimeError(f"{name} in {tree}: {proc.stderr[-3000:]}")
                for label, values in json.loads(out.read_text()).items():
                    got[tree].setdefault(label, []).extend(values)
    return got


def compare_table(
    got: dict[str, dict[str, list[float]]], fmt: str = "{:.3f}", unit: str = " s"
) -> str:
    """One row per label: each tree's ``median (min-max)``, then each baseline's median over
    this tree's (above 1: this tree is faster)."""
    names = list(got)
    *revs, current = names
    lines = [
        "| what | " + " | ".join(names) + "".join(f" | ratio {r}" for r in revs) + " |",
        "|---|" + "---|" * (len(names) + len(revs)),
    ]
    for label in got[current]:
        this = statistics.median(got[current][label])
        cells = [spread(got[n][label], fmt, unit) if got[n].get(label) else "—" for n in names]
        ratios = [
            f"{statistics.median(got[r][label]) / this:.2f}x" if got[r].get(label) and this else "—"
            for r in revs
        ]
        lines.append(f"| {label} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)
