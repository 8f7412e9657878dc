"""Coverage-guided fuzzing of the loaders with atheris (optional: `pip install atheris`).

    python tools/fuzz_loaders.py plan|profile|manifest [atheris/libFuzzer flags, e.g. -runs=200000]

Seeds are the committed example plan, a committed profile and a manifest; any
exception other than the loader's own error (``PlanError``, ``ProfileError``,
``CheckpointError``) is a finding and stops the run with the input saved by
libFuzzer. tests/test_fuzz.py runs the hypothesis version of this in CI.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["protrain"]):
    from protrain.executor.checkpoint import decode_manifest
    from protrain.planner.profiling.profile import load_profile
    from protrain.plans import load as load_plan
    from protrain.plans.errors import CheckpointError, PlanError, ProfileError

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {
    "plan": (load_plan, PlanError, [ROOT / "plans/gpt2-tiny/example.json"]),
    "profile": (
        load_profile,
        ProfileError,
        sorted((ROOT / "plans/profiles/gpt2-xl").glob("*.json"))[:1],
    ),
    "manifest": (decode_manifest, CheckpointError, []),
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: {sys.argv[0]} {'|'.join(TARGETS)} [libFuzzer flags]")
    loader, error, seeds = TARGETS[sys.argv[1]]

    def one(data: bytes) -> None:
        try:
            loader(bytes(data))
        except error:
            pass

    corpus = Path(tempfile.mkdtemp(prefix=f"fuzz-{sys.argv[1]}-"))
    for i, seed in enumerate(seeds):
        (corpus / f"seed{i}").write_bytes(seed.read_bytes())
    atheris.Setup([sys.argv[0], *sys.argv[2:], str(corpus)], one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
