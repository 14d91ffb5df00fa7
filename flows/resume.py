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


# Where a run is, not what it is: the same run may be continued from another directory or endpoint.
LOCATION = {"storage.output_dir", "storage.s3_endpoint_url", "storage.s3_region"}
STORE_RECORDS = "_runs"  # STORE/_runs/RUN_ID.yaml: the record beside the run's tables


def save_run_record(cfg: RunConfig, command: str, store=None) -> Path:
    """Write the record in the run directory and, given the run's table store, beside its tables; a directory or
    tables that hold another run (another command or config) are refused, so a new run never silently continues an
    old one (from its directory or from its tables in a shared store) or overwrites what `resume` would replay."""
    run_dir = Path(cfg.storage.output_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RECORD
    config = cfg.model_dump(mode="json")
    config["storage"]["output_dir"] = str(run_dir)  # `runs/a` and `$PWD/runs/a` are one directory
    old = _read_record(path.read_text()) if path.is_file() else None
    _refuse_another_run(old, config, command, f"--output-dir {cfg.storage.output_dir}", f"sluiceway resume {run_dir}")
    record = yaml.safe_dump({"command": command, "config": config}, sort_keys=False)
    if store is not None:
        fs, where = store.filesystem(), store.join(STORE_RECORDS, f"{cfg.run_id}.yaml").removeprefix("s3://")
        with store.redacting():
            try:
                stored = _read_record(fs.cat_file(where).decode())
            except FileNotFoundError:
                stored = None
            _refuse_another_run(stored, config, command, f"run {cfg.run_id!r} in {store.join()}",
                                "the same config (its run directory's sluiceway-run.yaml)")  # fmt: skip
            if not store.is_s3:
                Path(where).parent.mkdir(parents=True, exist_ok=True)
            fs.pipe_file(where, record.encode())
    tmp = path.with_suffix(".tmp")
    tmp.write_text(record)
    tmp.replace(path)
    return path


def _read_record(text: str) -> dict:
    try:
        old = yaml.safe_load(text)
    except yaml.YAMLError:
        old = None
    return old if isinstance(old, dict) else {"damaged": True}


def _refuse_another_run(old: dict | None, config: dict, command: str, where: str, continue_with: str) -> None:
    """One line naming the fields in which `config` is another run than the `old` record (sft and replay pin their
    own inputs, data and table version, so only `run` is compared)."""
    if old is None or command != "run":
        return
    changed = ["record"] if old.get("damaged") else _differences(_current(old.get("config")), config)
    if old.get("command") not in (None, command) and not old.get("damaged"):
        changed.insert(0, "command")
    changed = [c for c in changed if c not in CONTINUABLE | LOCATION and not c.startswith(("logging.", "eval."))]
    if changed:
        raise UserError(f"{where}: holds another run ({', '.join(changed[:3])} differ); `{continue_with}` "
                        "continues it, or choose another " + ("--output-dir" if "output-dir" in where else "--run-id"))


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
    if isinstance(config, dict) and isinstance(config.get("storage"), dict):
        config["storage"]["output_dir"] = str(path.parent.resolve())  # the run is where its record is
    return command, build_config(config, {}, source=str(path))
