"""`sluiceway replay [CONFIG.yaml] --replay-run-id RUN [--replay-version N | --replay-timestamp ISO]`: train on a
stored run's trajectories, no engines (flows/replay.py)."""

from __future__ import annotations

from sluiceway.flows.cli.flow import FlowCommand
from sluiceway.flows.cli.parser import add_config_command, configured


def add_parser(sub) -> None:
    add_config_command(
        sub,
        "replay",
        "train on a stored run's trajectories at a table version, with no engine running",
        hidden=("reward",),
    )  # fmt: skip  (the stored rewards are replayed)


def run(args) -> FlowCommand:
    return FlowCommand("replay", configured(args))
