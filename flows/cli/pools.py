"""`sluiceway pools up POOLS.yaml`: local inference pools that pull weight versions (development; flows/pools.py)."""

from __future__ import annotations


def add_parser(sub) -> None:
    pools = sub.add_parser("pools", help="local inference pools that pull weight versions (development)")
    pools_sub = pools.add_subparsers(dest="pools_command", required=True, parser_class=type(pools))
    up = pools_sub.add_parser("up", help="start the pools of a YAML file and serve until Ctrl-C")
    up.add_argument("pools_file", metavar="POOLS.yaml")
    up.add_argument("--work-dir", default="runs/pools", help="logs, materialized weights and status per pool")


def run(args) -> int:
    from sluiceway.flows.pools import pools_up

    return pools_up(args.pools_file, args.work_dir)
