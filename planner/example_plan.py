"""Write the example plan for gpt2-tiny and the plan JSON Schema (until the planner's search
exists).

The configuration is chosen by hand (one persistent chunk, two offloaded chunks
sharing two device buffers, the first block checkpointed, the second kept); the
schedule, fingerprint and layout come from ``protrain.planner.search.emit``, exactly as
the planner will write them. ``--check`` regenerates in memory and fails on any
byte difference, so a change to the format or the emitter shows up as a plan diff.

    python -m protrain.planner.example_plan     # (re)write the files
    python -m protrain.planner.example_plan --check   # exit 1 if a committed file is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec

from protrain.planner.models.zoo import block_paths, build
from protrain.planner.search.emit import emit
from protrain.plans import homes
from protrain.plans import plan as P

ROOT = Path(__file__).resolve().parent.parent


def example_plan() -> bytes:
    model = build("gpt2-tiny", device="meta")
    blocks = block_paths(model)
    training = P.Training(
        micro_batch=4,
        seq_len=64,
        compute_dtype="float32",
        master_dtype="float32",
        world_size=1,
        grad_accum=1,
    )
    plan = emit(
        model,
        name="gpt2-tiny",
        blocks=blocks,
        training=training,
        chunk_numel=65536,
        persistent=[0],
        n_buffer=2,
        policies=[homes.CHECKPOINT.name, homes.KEEP.name],
        request=P.Request(
            model="gpt2-tiny",
            hardware="cpu",
            micro_batch=4,
            seq_len=64,
            compute_dtype="float32",
            world_size=1,
            grad_accum=1,
        ),
        hardware=P.Hardware(name="cpu"),
    )
    return P.dump(plan)


def schema() -> bytes:
    doc = msgspec.json.schema(P.Plan)
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


FILES = {
    "plans/gpt2-tiny/example.json": example_plan,
    f"plans/schema/plan-v{P.SCHEMA_VERSION}.schema.json": schema,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if a committed file differs")
    args = ap.parse_args()
    stale = []
    for rel, make in FILES.items():
        path, data = ROOT / rel, make()
        if args.check:
            if not path.exists() or path.read_bytes() != data:
                stale.append(rel)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            print(f"wrote {rel}")
    if stale:
        print(
            "stale (run python -m protrain.planner.example_plan):\n  " + "\n  ".join(stale),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
