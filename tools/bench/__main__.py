"""``python -m tools.bench NAME [options]``: run one benchmark; ``--list`` names them all."""

from __future__ import annotations

import sys

from tools.bench import BENCHMARKS, run


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "--list"):
        width = max(map(len, BENCHMARKS))
        print("python -m tools.bench NAME [--rounds N] [--baseline REF] [--write] [options]\n")
        for name, b in BENCHMARKS.items():
            extra = "" if b.section else "  (no section: JSON lines / figures)"
            print(f"  {name:{width}}  {b.title}{extra}")
        print("\npython -m tools.bench NAME --help: that benchmark's options")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(
            f"unknown benchmark {name!r}; python -m tools.bench --list names them", file=sys.stderr
        )
        return 2
    return run(name, rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
