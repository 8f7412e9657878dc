"""The plan library (planner/regen.py, ``python -m protrain.planner.regen``): committed plans are
what the planner makes, byte for byte.

``--check`` regenerates every plan and the index from the committed profiles; here it
must pass on the tree as committed and name each file once a copy of the tree is
damaged (the copy lives in tmp_path: the real plans/ is never touched).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from protrain import plans
from protrain.planner import regen
from protrain.planner.views.show import policy_strip
from protrain.plans import plan as P

ROOT = Path(__file__).resolve().parent.parent
PLANS = sorted(p for m in regen.SHAPES for p in (ROOT / "plans" / m).glob("*.json"))


def _check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "protrain.planner.regen", "--check", "--root", str(root)],
        capture_output=True,
        text=True,
    )


@pytest.mark.slow
def test_check_names_every_stale_missing_and_extra_file(tmp_path):
    """The check on a copy of the committed plans with three files broken names exactly those
    three: every other plan, the index and the schema are what the planner makes (so this is
    also the committed tree's check, which .ci/run runs directly before the tests)."""
    shutil.copytree(ROOT / "plans", tmp_path / "plans")
    changed = tmp_path / "plans" / "llama-7b" / "h100-w1.json"
    data = bytearray(changed.read_bytes())
    i = data.index(b'"iter_time_us": ') + len(b'"iter_time_us": ')
    data[i] = ord("9") if data[i] != ord("9") else ord("8")  # one byte: a digit of the prediction
    changed.write_bytes(bytes(data))
    (tmp_path / "plans" / "gpt2-xl" / "rtx3090-w4.json").unlink()
    (tmp_path / "plans" / "mistral-7b" / "tpu-w1.json").write_bytes(b"{}\n")

    r = _check(tmp_path)
    assert r.returncode == 1, r.stdout
    stale = [line.strip() for line in r.stderr.splitlines() if line.startswith("  ")]
    assert stale == [
        "plans/gpt2-xl/rtx3090-w4.json: missing",
        "plans/llama-7b/h100-w1.json: differs",
        "plans/mistral-7b/tpu-w1.json: extra (no longer generated)",
    ], r.stderr
    assert "python -m protrain.planner.regen" in r.stderr  # the fix


def test_library_is_complete():
    # Every (model, hardware, world size) cell has a plan or a "does not fit" line.
    index = (ROOT / "plans" / "README.md").read_text()
    cells = len(regen.ENTRIES) * len(regen.WORLD_SIZES)
    assert len(PLANS) + index.count("does not fit |") == cells
    assert len(PLANS) > 0


@pytest.mark.parametrize("path", PLANS, ids=lambda p: str(p.relative_to(ROOT / "plans")))
def test_committed_plan_round_trips_byte_for_byte(path):
    data = path.read_bytes()
    assert P.dump(plans.load(data)) == data


def test_index_mentions_every_plan_file():
    index = (ROOT / "plans" / "README.md").read_text()
    missing = [p for p in PLANS if f"]({p.parent.name}/{p.name})" not in index]
    assert not missing, missing


def _expand(abbreviated: str) -> str:
    """Inverse of ``abbreviate``: ``(S×1 C×2)×2 K×1`` → ``S C C S C C K``."""
    out: list[str] = []
    tokens = abbreviated.replace("(", " ( ").replace(")×", " )× ").split()
    stack: list[list[str]] = [out]
    for tok in tokens:
        if tok == "(":
            stack.append([])
        elif tok == ")×":
            continue
        elif tok.startswith("×") or tok.isdigit():
            group = stack.pop()
            stack[-1].extend(group * int(tok.lstrip("×")))
        else:
            letter, n = tok.split("×")
            stack[-1].extend([letter] * int(n))
    return " ".join(out)


def test_abbreviated_strips_expand_to_the_plans_strips():
    assert regen.abbreviate("C " * 79 + "K") == "C×79 K×1"
    assert regen.abbreviate("S C S C S C K K") == "(S×1 C×1)×3 K×2"
    for path in PLANS:
        strip = policy_strip(plans.load(path))
        assert _expand(regen.abbreviate(strip)) == strip, path


def test_a_measured_profile_takes_precedence(tmp_path):
    shutil.copytree(ROOT / "plans", tmp_path / "plans")
    entry = next(e for e in regen.ENTRIES if e.model == "gpt2-xl" and e.hardware == "h100")
    analytic = (tmp_path / entry.profile_rel()).read_bytes()
    measured = analytic.replace(b'"source": "analytic"', b'"source": "measured"', 1)
    (tmp_path / entry.profile_rel(measured=True)).write_bytes(measured)
    (tmp_path / "plans" / "profiles" / "gpt2-xl" / "stray.json").write_bytes(analytic)

    chosen, problems = regen.choose_profiles(tmp_path)
    assert chosen[entry].source == "measured" and chosen[entry].data == measured
    assert all(c.source == "analytic" for e, c in chosen.items() if e != entry)
    assert problems == [
        "plans/profiles/gpt2-xl/stray.json: misnamed; this analytic profile belongs "
        f"at {entry.profile_rel()}"
    ]
