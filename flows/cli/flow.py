"""Running a flow command (run, sft, replay, eval, and resume's replay of one): the run record, the run lock, the
logging, then the flow (flows/run.py)."""

from __future__ import annotations

from pathlib import Path

from sluiceway.flows import slime
from sluiceway.flows.config import RunConfig

RUN_DIR: list[Path] = []  # the run directory of the flow command, once known: where a fault's message looks
CONSOLE: list[bool] = []  # set by `entry`: this process is the sluiceway command, not a test calling main()


def dispatch(command: str, cfg: RunConfig) -> int:
    """Run a flow command; the run record written first is what `sluiceway resume` replays."""
    from sluiceway.flows.precision import resolve_precision
    from sluiceway.flows.preflight import preflight
    from sluiceway.flows.resume import RESUMABLE, save_run_record
    from sluiceway.flows.run import configure_logging, send_native_stderr_to_log
    from sluiceway.storage import run_lock
    from sluiceway.storage.integrity import check_tables
    from sluiceway.storage.maintenance import RUN_TABLES

    preflight(cfg, command)  # file mistakes are one line here, before logging, engines or Prefect start
    if CONSOLE:
        send_native_stderr_to_log(cfg)
    configure_logging(cfg)
    slime.log_pending()  # slime flags not applicable here, once in the run's log
    # Resolved before the run record is written (a resumed run keeps the precision it started with) and before
    # the engines start; the flow logs the choice once everything is checked.
    cfg = resolve_precision(cfg, announce=False)
    RUN_DIR[:] = [Path(cfg.storage.output_dir).resolve()]  # where a fault's message looks for a full disk
    # One live process per run directory and run tables (storage/run_lock.py), taken before the run record is
    # written or anything starts: a second run is refused with one line naming the first.
    store = run_store(cfg)
    with run_lock.hold(Path(cfg.storage.output_dir).resolve(), store, cfg.run_id, command):
        check_tables(store, RUN_TABLES)  # a damaged table is one line, not a run on unreadable data
        if command in RESUMABLE:
            save_run_record(cfg, command, store)
        if command == "sft":
            from sluiceway.flows.run import run_sft

            run_sft(cfg)
        elif command in ("replay", "eval"):
            from sluiceway.flows.run import run_eval, run_replay

            (run_replay if command == "replay" else run_eval)(cfg)
        else:
            from sluiceway.flows.run import run

            run(cfg)
    return 0


def run_store(cfg: RunConfig):
    from sluiceway.storage.object_store import ObjectStore

    return ObjectStore.from_uri(cfg.tables_uri, cfg.storage.s3_endpoint_url, cfg.storage.s3_region)
