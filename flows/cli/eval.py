"""`sluiceway eval [CONFIG.yaml] --hf-checkpoint M --eval-prompt-data ...`: evaluate a model, no training
(flows/eval.py)."""

from __future__ import annotations

from sluiceway.flows.cli.flow import FlowCommand
from sluiceway.flows.cli.parser import add_config_command, configured


def add_parser(sub) -> None:
    add_config_command(sub, "eval", "evaluate a model (zoo name, HF directory, or a run's weights) on the eval sets",
                       hidden=("algorithm", "replay"))  # fmt: skip


def run(args) -> FlowCommand:
    return FlowCommand("eval", configured(args))
