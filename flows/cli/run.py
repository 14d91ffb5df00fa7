"""`sluiceway run [CONFIG.yaml] [--flag value ...]`: the RL loop (flows/rl.py); flags override the YAML."""

from __future__ import annotations

from sluiceway.flows import slime
from sluiceway.flows.cli.flow import FlowCommand
from sluiceway.flows.cli.parser import add_config_command, add_slime_script_flag, configured


def add_parser(sub) -> None:
    p = add_config_command(sub, "run", "run the RL loop", hidden=("replay",))
    add_slime_script_flag(p)
    slime.add_help_flag(p)


def run(args) -> FlowCommand:
    return FlowCommand("run", configured(args))
