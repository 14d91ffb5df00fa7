"""`sluiceway resume RUN_DIR_OR_ID`: run a failed or killed run again from where it stopped (flows/resume.py)."""

from __future__ import annotations

from sluiceway.flows.cli.flow import FlowCommand


def add_parser(sub) -> None:
    res = sub.add_parser("resume", help="run a failed or killed run again from its first unfinished stage")
    res.add_argument("run", help="the run's output directory, or its run id (looked up under --runs-root)")
    res.add_argument("--runs-root", default="runs", help="where run ids are looked up (default ./runs)")


def run(args) -> FlowCommand:
    from sluiceway.flows.resume import load_run_record

    command, cfg = load_run_record(args.run, args.runs_root)
    return FlowCommand(command, cfg)
