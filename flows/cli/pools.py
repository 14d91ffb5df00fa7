"""`sluiceway pools up|drain|list`: inference pools that pull weight versions and register beside them
(flows/pools.py)."""

from __future__ import annotations


def add_parser(sub) -> None:
    pools = sub.add_parser("pools", help="inference pools that pull weight versions and register beside them")
    pools_sub = pools.add_subparsers(dest="pools_command", required=True, parser_class=type(pools))
    up = pools_sub.add_parser("up", help="start the pools of a YAML file and serve until drained (SIGTERM)")
    up.add_argument("pools_file", metavar="POOLS.yaml")
    up.add_argument("--work-dir", default="runs/pools", help="logs, materialized weights and status per pool")
    drain = pools_sub.add_parser("drain", help="ask a registered pool to finish its groups and leave")
    drain.add_argument("name", metavar="NAME")
    drain.add_argument("--weights-uri", required=True, help="the weight store the pool serves (its registry)")
    ls = pools_sub.add_parser("list", help="the pools registered beside a weight store")
    ls.add_argument("--weights-uri", required=True, help="the weight store (a local path or s3://bucket/prefix)")


def run(args) -> int:
    from sluiceway.flows import pools

    if args.pools_command == "drain":
        return pools.drain_pool(args.name, args.weights_uri)
    if args.pools_command == "list":
        return pools.list_pools(args.weights_uri)
    return pools.pools_up(args.pools_file, args.work_dir)
