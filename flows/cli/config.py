"""`sluiceway config [CONFIG.yaml] [flags]`: print the resolved config as YAML."""

from __future__ import annotations

import yaml

from sluiceway.flows.cli.parser import add_config_command, add_slime_script_flag, configured


def add_parser(sub) -> None:
    p = add_config_command(sub, "config", "print the resolved config as YAML")
    add_slime_script_flag(p)


def run(args) -> int:
    cfg = configured(args)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return 0
