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
# Fields a second `run` may change and still continue the run in the directory: more steps (a run extended
# after it finished). Logging and evaluation settings may change too (they do not change what is trained);
# anything else would mix two runs' data and weights.
CONTINUABLE = {"rollout.num_rollout", "training.num_epoch"}


def save_run_record(cfg: RunConfig, command: str) -> Path:
    """Write the record; a directory that holds another run (another command or config) is refused, so a new
    run never silently continues an old one or overwrites what `resume` would replay."""
    run_dir = Path(cfg.storage.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RECORD
    config = cfg.model_dump(mode="json")
    if path.is_file() and command == "run":  # sft and replay pin their own inputs (data, table version)
        try:
            old = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError:
            old = {}
        changed = _differences(_current(old.get("config")), config) if isinstance(old, dict) else ["record"]
        if isinstance(old, dict) and old.get("command") != command:
            changed.insert(0, "command")
        changed = [c for c in changed if c not in CONTINUABLE and not c.startswith(("logging.", "eval."))]
        if changed:
            raise UserError(
                f"--output-dir {run_dir}: holds another run ({', '.join(changed[:3])} differ); "
                f"`sluiceway resume {run_dir}` continues it, or choose another --output-dir"
            )
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"command": command, "config": config}, sort_keys=False))
    tmp.replace(path)
    return path


def _current(recorded) -> dict:
    """A recorded config as this version writes it (fields added since get their defaults), or as it was."""
    try:
        return RunConfig.model_validate(recorded).model_dump(mode="json")
    except Exception:  # noqa: BLE001 - a record from another version: compared field by field as it is
        return recorded if isinstance(recorded, dict) else {}


def _differences(old: dict, new: dict) -> list[str]:
    """`group.field` names whose values differ between two config dicts."""
    out = []
    for group in sorted(set(old) | set(new)):
        a, b = old.get(group), new.get(group)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{group}.{f}" for f in sorted(set(a) | set(b)) if a.get(f) != b.get(f)]
        elif a != b:
            out.append(group)
    return out


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
