"""A built wheel installs like a library: not editable, in a fresh virtual environment, away
from the source tree, it plans for a shipped card, fits a shipped config, and runs quickstart.

Before the wheel shipped ``plans/`` as package data, ``--hardware rtx3090`` failed here with
``unknown hardware 'rtx3090'; known:`` (an empty list): the specs lived only in the checkout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def run(cmd: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    )
    return p


def offline_backend() -> bool:
    """Whether this environment builds a wheel without fetching anything: setuptools 70.1 or
    later (``bdist_wheel`` built in), or an older one beside the ``wheel`` package."""
    try:
        from importlib.metadata import version

        major, minor = (int(x) for x in version("setuptools").split(".")[:2])
    except Exception:  # not installed, or a version string we do not read
        return False
    return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A virtual environment with the wheel built from this checkout installed (not editable).

    It sees the system's site-packages for torch and the other dependencies; the wheel's
    ``protrain`` comes first on its path, which the test checks."""
    tmp = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools writes build/ and protrain.egg-info/ beside the sources, and
    # in the checkout a half-written egg-info is what importlib.metadata finds for `protrain`
    # in every other test process meanwhile (a plan's generator version read as null).
    src = tmp / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", "build", "*.egg-info", "__pycache__", ".venv", "runs"
        ),
    )
    # Offline when this environment has the build backend; else pip fetches it, as any install does.
    isolation = ["--no-build-isolation"] if offline_backend() else []
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            *isolation,
            str(src),
            "-w",
            str(tmp / "dist"),
        ],
        cwd=tmp,
    )
    wheel = next((tmp / "dist").glob("protrain-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "protrain/plans/hardware/rtx3090.json" in names, "the wheel ships no hardware specs"
    assert "protrain/plans/configs/gemma-3-1b/config.json" in names, "the wheel ships no configs"
    # Issue 39: the plan library and the example plan the README's Python snippet loads.
    assert "protrain/plans/gpt2-tiny/example.json" in names, "the wheel ships no example plan"
    library = {n.split("/")[2] for n in names if n.count("/") == 3 and n.endswith(".json")}
    shipped = {d.name for d in (ROOT / "plans").iterdir() if list(d.glob("*-w[0-9]*.json"))}
    assert shipped and shipped <= library, f"the wheel lacks the plans of {shipped - library}"
    env = tmp / "venv"
    run([sys.executable, "-m", "venv", "--system-site-packages", str(env)], cwd=tmp)
    run(
        [str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
        cwd=tmp,
    )
    where = run(
        [
            str(env / "bin" / "python"),
            "-c",
            "import protrain.planner as p, protrain.planner.hardware.spec as s; "
            "print(p.__file__); print(s.HARDWARE_DIR)",
        ],
        cwd=tmp,
    ).stdout.split()
    assert all(w.startswith(str(env)) for w in where), f"the venv imports {where}, not the wheel"
    return env


def test_plan_for_a_shipped_card(venv, tmp_path):
    out = tmp_path / "p.json"
    run(
        [
            str(venv / "bin" / "protrain"),
            "plan",
            "--model",
            "gpt2",
            "--hardware",
            "rtx3090",
            "--batch",
            "2",
            "--seq",
            "256",
            "-o",
            str(out),
        ],
        cwd=tmp_path,
    )
    plan = json.loads(out.read_text())
    assert plan["hardware"]["name"] == "rtx3090"


def test_fit_a_shipped_config_by_name(venv, tmp_path):
    p = run(
        [
            str(venv / "bin" / "protrain"),
            "fit",
            "--hf-config",
            "gemma-3-1b",
            "--hardware",
            "rtx4090",
            "--seq",
            "512",
        ],
        cwd=tmp_path,
    )
    assert "gemma-3-1b" in p.stdout + p.stderr
    assert "verdict" in p.stdout


def test_quickstart(venv, tmp_path):
    p = run([str(venv / "bin" / "protrain"), "quickstart"], cwd=tmp_path)
    assert "trained" in p.stdout


def test_the_readme_python_snippet_runs_from_the_wheel(venv, tmp_path):
    # The README's "Python API" block, up to its training loop, run away from the checkout:
    # its example plan must come from the installed wheel.
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("## Python API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    head = block.split("for x, y in batches", 1)[0]
    assert "plans_dir()" in head and "engine = wrap(" in head
    p = run([str(venv / "bin" / "python"), "-c", head + "print(plan.model.name)"], cwd=tmp_path)
    assert p.stdout.strip().endswith("gpt2-tiny")
