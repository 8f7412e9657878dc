"""``python -m protrain.planner``: the ``protrain`` command, for environments without its script."""

from .commands.cli import main

main(prog_name="protrain")
