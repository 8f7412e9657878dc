"""The model configs under plans/configs build on meta and have the size their model cards state.

plans/configs/README.md's table is the one list: each row names a directory, its
model_type and the parameter count its model card states (with the source). Every
directory must have a row and every row a directory; each config must pass protrain's
config.json path unrefused (no ``auto_map``) and count within 2% of the stated number
(the cards round: "8B" for 8.03B, "7B" for 6.92B).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from protrain.planner.models import zoo as models

CONFIGS = Path(__file__).resolve().parent.parent / "plans" / "configs"


def table() -> dict[str, tuple[str, float]]:
    """README rows: config name → (model_type, stated parameters)."""
    rows = {}
    for line in (CONFIGS / "README.md").read_text(encoding="utf-8").splitlines():
        m = re.match(r"\| ([\w.-]+) \| ([\w-]+) \| ([\d.]+)B \|", line)
        if m:
            rows[m[1]] = (m[2], float(m[3]) * 1e9)
    return rows


def test_every_config_is_in_the_table():
    dirs = sorted(p.parent.name for p in CONFIGS.glob("*/config.json"))
    assert dirs == sorted(table()), "plans/configs/README.md's table and the directories differ"
    assert len(dirs) >= 8


@pytest.mark.parametrize("name", sorted(table()))
def test_config_builds_on_meta_with_its_stated_size(name):
    pytest.importorskip("transformers")
    model_type, stated = table()[name]
    info = models.describe(f"hf:{CONFIGS / name}")  # builds on meta: nothing allocated
    assert info.family == model_type
    assert abs(info.n_params - stated) <= 0.02 * stated, (
        f"{name}: {info.n_params:,} vs stated {stated:,.0f}"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "hardware"),
    [("llama-3.1-8b", ["h100"]), ("qwen3-30b-a3b", ["h200", "--world-size", "4"])],
)
def test_readme_plan_command_works_for_a_dense_and_an_moe_config(name, hardware, tmp_path):
    """The README's
    ``protrain plan --hf-config plans/configs/NAME --hardware H ... --batch 1 --seq 4096``."""
    pytest.importorskip("transformers")
    from click.testing import CliRunner

    from protrain import plans
    from protrain.planner.commands.cli import main

    out = tmp_path / "plan.json"
    r = CliRunner().invoke(
        main,
        [
            "plan",
            "--hf-config",
            str(CONFIGS / name),
            "--hardware",
            *hardware,
            "--batch",
            "1",
            "--seq",
            "4096",
            "-o",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    assert plans.load(out).model.name == f"hf:{CONFIGS / name}"
