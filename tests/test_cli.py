"""The command line: --help of every command, exit codes, messages, the frozen option set."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from protrain.planner.cli import main

EXAMPLE = Path(__file__).resolve().parent.parent / "plans" / "gpt2-tiny" / "example.json"

# Adding, removing or renaming an option is a visible diff here (torchtitan's
# test_no_new_cli_options): the CLI is an interface users script against.
FROZEN_OPTIONS = {
    "": ["--debug", "--help", "--version"],
    "models": ["--help"],
    "quickstart": ["--data", "--help", "--model", "--out", "--seed", "--steps"],
    "show": ["--help"],
    "validate": ["--help", "--model"],
}


def _options(cmd: click.Command) -> list[str]:
    ctx = click.Context(cmd)
    return sorted(o for p in cmd.get_params(ctx) for o in p.opts if o.startswith("--"))


def test_option_set_is_frozen():
    got = {"": _options(main)}
    got.update({name: _options(cmd) for name, cmd in main.commands.items()})
    assert got == FROZEN_OPTIONS


@pytest.mark.parametrize("command", ["", *sorted(FROZEN_OPTIONS.keys() - {""})])
def test_help_of_every_command(command):
    result = CliRunner().invoke(main, [*command.split(), "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_models_lists_every_size():
    from protrain.planner.models import ZOO

    result = CliRunner().invoke(main, ["models"])
    assert result.exit_code == 0, result.output
    for name in ZOO:
        assert f"\n{name} " in result.output
    assert "124.44M" in result.output and "68.98B" in result.output


def test_show_summarises_the_plan():
    result = CliRunner().invoke(main, ["show", str(EXAMPLE)])
    assert result.exit_code == 0, result.output
    assert "gpt2-tiny" in result.output and "C K" in result.output
    assert "1 persistent [0], 2 offloaded, 2 device buffers" in result.output


def test_validate_accepts_the_example_and_checks_the_fingerprint():
    result = CliRunner().invoke(main, ["validate", str(EXAMPLE)])
    assert result.exit_code == 0, result.output
    assert "fingerprint matches gpt2-tiny" in result.output


def test_validate_refuses_another_model_with_the_differences():
    result = CliRunner().invoke(main, ["validate", str(EXAMPLE), "--model", "llama-tiny"])
    assert result.exit_code == 1
    assert "made for another model" in result.output and "missing in the model" in result.output
    assert "Traceback" not in result.output


def test_bad_plan_is_one_paragraph_and_exit_1(tmp_path):
    doc = json.loads(EXAMPLE.read_bytes())
    doc["placement"]["n_buffer"] = "two"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    result = CliRunner().invoke(main, ["show", str(bad)])
    assert result.exit_code == 1
    assert result.output.startswith("error: ") and "$.placement.n_buffer" in result.output
    assert "HINT:" in result.output and "Traceback" not in result.output


def test_debug_shows_the_exception(tmp_path):
    result = CliRunner().invoke(main, ["--debug", "show", str(tmp_path / "missing.json")])
    assert result.exit_code != 0 and result.exception is not None


def test_unknown_model_suggests_a_name():
    result = CliRunner().invoke(main, ["validate", str(EXAMPLE), "--model", "gpt2-tinyy"])
    assert result.exit_code == 1 and "did you mean 'gpt2-tiny'?" in result.output


def test_usage_error_exits_2():
    assert CliRunner().invoke(main, ["show"]).exit_code == 2


def test_quickstart_plans_checks_and_trains(tmp_path):
    result = CliRunner().invoke(main, ["quickstart", "--steps", "20", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "fingerprint matches" in result.output
    assert (tmp_path / "gpt2-tiny.json").exists()
    first, last = result.output.split("done: loss ")[1].split(" in ")[0].split(" → ")
    assert float(last) < float(first)


def test_quickstart_missing_data_file(tmp_path):
    result = CliRunner().invoke(main, ["quickstart", "--data", str(tmp_path / "none.txt")])
    assert result.exit_code == 1 and "none.txt" in result.output
