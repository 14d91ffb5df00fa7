"""`sluiceway plan [CONFIG.yaml] [flags] [--available-gib N]`: memory per trainer rank and engine for the layout
(tasks/train/memory_plan.py); exit status 1 if it cannot fit."""

from __future__ import annotations

from sluiceway.flows.cli.parser import add_config_command, add_slime_script_flag, configured


def add_parser(sub) -> None:
    p = add_config_command(
        sub, "plan", "memory per trainer rank and engine of the layout: weights, grads, optimizer, activations, KV"
    )
    p.add_argument(
        "--available-gib",
        type=float,
        default=None,
        help="plan against this much memory (per GPU with --device cuda) instead of what is here",
    )
    add_slime_script_flag(p)


def run(args) -> int:
    cfg = configured(args)
    from sluiceway.flows.preflight import print_plan

    return print_plan(cfg, args.available_gib)
