"""`sluiceway serve [CONFIG.yaml] [flags] [--cron X]`: deployments of the flows (flows/deploy.py); the config's
flags are the deployments' default parameters."""

from __future__ import annotations

from sluiceway.flows.cli.parser import USAGE, add_field_arguments, resolve_config


def add_parser(sub) -> None:
    dep = sub.add_parser("serve", help="register deployments of the flows; their parameter form is the run config",
                         usage=USAGE)  # fmt: skip
    dep.add_argument("config_file", nargs="?", help="YAML run config: the deployments' default parameters")
    dep.add_argument("--name", default="default", help="deployment name (sluiceway-rl/NAME, sluiceway-sft/NAME)")
    dep.add_argument("--cron", default=None, help="schedule: a cron expression, e.g. '0 3 * * *'")
    dep.add_argument("--interval", type=float, default=None, help="schedule: every this many seconds")
    dep.add_argument("--pool", default=None, help="register on this Prefect work pool and exit (else serve here)")
    dep.add_argument("--flow", action="append", default=None, help="only this flow (rl, sft, eval, replay; repeatable)")
    dep.add_argument("--api-url", default=None, help="the Prefect API (default $PREFECT_API_URL or 127.0.0.1:4200)")
    dep.add_argument("--home", default=".sluiceway/prefect", help="PREFECT_HOME of this client process")
    add_field_arguments(dep)


def run(args) -> int:
    from sluiceway.flows.deploy import serve

    given = args.config_file or any("." in k for k in vars(args))
    base = resolve_config(args).model_dump(mode="json") if given else None
    serve(base, name=args.name, cron=args.cron, interval=args.interval, pool=args.pool,
          api_url=args.api_url, home=args.home, only=args.flow)  # fmt: skip
    return 0
