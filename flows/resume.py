"""`sluiceway resume RUN`: run a failed or killed run again, from its first unfinished stage.

Every run writes its command and resolved config to OUTPUT_DIR/sluiceway-run.yaml before its flow starts (the
config holds no secrets: credentials come from the environment). Resuming re-runs that command with that config
and the same run id; the flow then starts from the checkpoint and skips every group, reward and filter decision
already in the tables.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from sluiceway.flows.config import RunConfig, build_config
from sluiceway.infra.errors import UserError

RECORD = "sluiceway-run.yaml"
RESUMABLE = ("run", "sft", "replay")


def save_run_record(cfg: RunConfig, command: str) -> Path:
    run_dir = Path(cfg.storage.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RECORD
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"command": command, "config": cfg.model_dump(mode="json")}, sort_keys=False))
    tmp.replace(path)
    return path


def find_run_record(ref: str, runs_root: str = "runs") -> Path:
    """RUN is a run's output directory, or a run id looked up as RUNS_ROOT/RUN."""
    for candidate in (Path(ref), Path(runs_root) / ref):
        if (candidate / RECORD).is_file():
            return candidate / RECORD
    raise UserError(f"resume: no run {ref!r}: neither {ref}/{RECORD} nor {runs_root}/{ref}/{RECORD} exists")


def load_run_record(ref: str, runs_root: str = "runs") -> tuple[str, RunConfig]:
    path = find_run_record(ref, runs_root)
    try:
        record = yaml.safe_load(path.read_text())
        command, config = record["command"], record["config"]
    except (yaml.YAMLError, KeyError, TypeError) as e:
        raise UserError(f"resume: {path} is not a run record ({type(e).__name__})") from None
    if command not in RESUMABLE:
        raise UserError(f"resume: {path}: command {command!r} cannot be resumed (one of {', '.join(RESUMABLE)})")
    return command, build_config(config, {}, source=str(path))
