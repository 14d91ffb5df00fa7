"""`sluiceway server [--port 4200]`: a Prefect server and its UI on loopback (flows/deploy.py)."""

from __future__ import annotations


def add_parser(sub) -> None:
    srv = sub.add_parser("server", help="run a Prefect server and its UI on loopback, home inside the project")
    srv.add_argument("--host", default="127.0.0.1", help="listen address (default loopback only)")
    srv.add_argument("--port", type=int, default=4200)
    srv.add_argument("--home", default=".sluiceway/prefect", help="PREFECT_HOME: the server's database and settings")


def run(args) -> int:
    from sluiceway.flows.deploy import run_server

    return run_server(args.host, args.port, args.home)
