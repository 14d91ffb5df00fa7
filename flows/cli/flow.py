"""Running a flow command (run, sft, replay, eval, and resume's replay of one): the preflight, the run's logging,
the run opened (its lock and tables, flows/live_run.py), the run record, then the flow (flows/run.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sluiceway.flows.config import RunConfig


@dataclass(frozen=True)
class FlowCommand:
    """What a flow command's `run(args)` returns: the command and its config, which `main` runs (`dispatch`)."""

    command: str
    cfg: RunConfig


@dataclass
class Invocation:
    """One `sluiceway` command in this process, made by `main`."""

    console: bool = False  # the process is the sluiceway command (flows/cli/main.py `entry`), not a test's main()
    run_dir: Path | None = None  # the flow command's run directory once known: where a fault's message looks


def dispatch(fc: FlowCommand, inv: Invocation) -> int:
    """Run a flow command; the run record written first is what `sluiceway resume` replays."""
    from sluiceway.flows.live_run import open_run
    from sluiceway.flows.precision import resolve_precision
    from sluiceway.flows.preflight import preflight
    from sluiceway.flows.resume import RESUMABLE, save_run_record
    from sluiceway.flows.run import configure_logging, run_flow, send_native_stderr_to_log

    command, cfg = fc.command, fc.cfg
    preflight(cfg, command)  # file mistakes are one line here, before logging, engines or Prefect start
    if inv.console:
        send_native_stderr_to_log(cfg)
    configure_logging(cfg)
    # Resolved before the run record is written (a resumed run keeps the precision it started with) and before
    # the engines start; the line saying why is logged once everything is checked (infra/held_lines.py).
    cfg = resolve_precision(cfg, announce=False)
    inv.run_dir = Path(cfg.storage.output_dir).resolve()  # where a fault's message looks for a full disk
    # One live process per run directory and run tables (storage/run_lock.py), taken before the run record is
    # written or anything starts: a second run is refused with one line naming the first.
    with open_run(cfg, command) as live:
        if command in RESUMABLE:
            save_run_record(cfg, command, live.store)
        run_flow(live)
    return 0
