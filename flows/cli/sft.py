"""`sluiceway sft [CONFIG.yaml] [--flag value ...]`: supervised fine-tuning on --prompt-data (flows/sft.py)."""

from __future__ import annotations

from sluiceway.flows.cli.flow import FlowCommand
from sluiceway.flows.cli.parser import add_config_command, configured


def add_parser(sub) -> None:
    add_config_command(sub, "sft", "supervised fine-tuning on a data file (slime's SFT format)",
                       hidden=("reward", "replay"))  # fmt: skip


def run(args) -> FlowCommand:
    return FlowCommand("sft", configured(args))  # `configured` sets --loss-type sft_loss unless given
