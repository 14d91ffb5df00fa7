"""`sluiceway resume RUN`: run a failed or killed run again, from its first unfinished stage.

Every run writes its command and resolved config to OUTPUT_DIR/sluiceway-run.yaml before its flow starts (the
config holds no secrets: credentials come from the environment). Resuming re-runs that command with that config
and the same run id; the flow then starts from the checkpoint and skips every group, reward and filter decision
already in the tables.

A record ends with the digest of what it says (`record_digest`: the command and the config, where the run is left
out), written atomically; one cut short, edited or unreadable is named as damaged with what to do, and `resume`
starts nothing from it (issue 40: a record cut before `training.lr` had resumed a new run from step 0 with
defaults). A record written before digests existed is taken when it has every part of the config.
"""

from __future__ import annotations

import hashlib
import json
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


def record_digest(command: str, config: dict) -> str:
    """What a record says, as one sha256: its command and config, less where the run is (LOCATION: a run moved or
    continued elsewhere is the same run) and what may change in it (CONTINUABLE: a run extended by more steps)."""
    what = {g: dict(v) if isinstance(v, dict) else v for g, v in config.items()}
    for field in LOCATION | CONTINUABLE:
        group, name = field.split(".")
        if isinstance(what.get(group), dict):
            what[group].pop(name, None)
    text = json.dumps({"command": command, "config": what}, sort_keys=True, default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def record_problem(record) -> str | None:
    """Why `record` (the parsed YAML) is not a whole run record, or None."""
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict) or "command" not in record:
        return "not a run record: no command and config"
    digest = record.get("digest")
    if digest is None:  # written before digests: every part of the config, and all of the last (the one a cut ends in)
        config, groups = record["config"], list(RunConfig.model_fields)
        missing = [g for g in groups if g not in config]
        if not missing and isinstance(config[groups[-1]], dict):
            last = RunConfig.model_fields[groups[-1]].annotation.model_fields
            missing = [f"{groups[-1]}.{f}" for f in last if f not in config[groups[-1]]]
        return f"cut short: no {', '.join(missing[:3])}" if missing else None
    if digest != record_digest(record["command"], record["config"]):
        return "its digest does not match what it says: cut short or edited"
    return None


def save_run_record(cfg: RunConfig, command: str, store=None) -> Path:
    """Write the record in the run directory and, given the run's table store, beside its tables; a directory or
    tables that hold another run (another command or config) are refused, so a new run never silently continues an
    old one (from its directory or from its tables in a shared store) or overwrites what `resume` would replay."""
    run_dir = Path(cfg.storage.output_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RECORD
    config = cfg.model_dump(mode="json")
    config["storage"]["output_dir"] = str(run_dir)  # `runs/a` and `$PWD/runs/a` are one directory
    old = _read_record(path.read_bytes()) if path.is_file() else None
    _refuse_another_run(old, config, command, f"--output-dir {cfg.storage.output_dir}", f"sluiceway resume {run_dir}",
                        str(path))  # fmt: skip
    digest = record_digest(command, config)
    record = yaml.safe_dump({"command": command, "config": config, "digest": digest}, sort_keys=False)
    if store is not None:
        fs, where = store.filesystem(), store.join(STORE_RECORDS, f"{cfg.run_id}.yaml").removeprefix("s3://")
        with store.redacting():
            try:
                stored = _read_record(fs.cat_file(where))
            except FileNotFoundError:
                stored = None
            _refuse_another_run(stored, config, command, f"run {cfg.run_id!r} in {store.join()}",
                                "the same config (its run directory's sluiceway-run.yaml)",
                                store.join(STORE_RECORDS, f"{cfg.run_id}.yaml"))  # fmt: skip
            if store.is_s3:
                fs.pipe_file(where, record.encode())  # one PUT: the object is whole or absent
            else:
                _write_atomically(Path(where), record)
    _write_atomically(path, record)
    return path


def _write_atomically(path: Path, text: str) -> None:
    """Whole or not at all: a crash mid-write leaves the previous record (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _read_record(data: bytes) -> dict:
    """The record, or {"damaged": why} for one that is not whole."""
    try:
        old = yaml.safe_load(data.decode())
    except (yaml.YAMLError, UnicodeDecodeError):
        return {"damaged": "not YAML"}
    problem = record_problem(old)
    return {"damaged": problem} if problem is not None else old


def _refuse_another_run(
    old: dict | None, config: dict, command: str, where: str, continue_with: str, record: str
) -> None:
    """One line naming the fields in which `config` is another run than the `old` record (sft and replay pin their
    own inputs, data and table version, so only `run` is compared), or saying that the record is damaged."""
    if old is None or command != "run":
        return
    if old.get("damaged"):
        raise UserError(
            f"{where}: its run record {record} is damaged ({old['damaged']}), so whether this is the same run cannot "
            f"be told; restore it (a copy is kept in the run directory and beside the tables: TABLES/{STORE_RECORDS}/"
            f"RUN_ID.yaml), or remove it to start this config on what is there, or choose another "
            + ("--output-dir" if "output-dir" in where else "--run-id")
        )
    changed = _differences(_current(old.get("config")), config)
    if old.get("command") not in (None, command):
        changed.insert(0, "command")
    changed = [c for c in changed if c not in CONTINUABLE | LOCATION and not c.startswith(("logging.", "eval."))]
    if changed:
        raise UserError(
            f"{where}: holds another run ({', '.join(changed[:3])} differ); `{continue_with}` "
            "continues it, or choose another " + ("--output-dir" if "output-dir" in where else "--run-id")
        )


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
    record = _read_record(path.read_bytes())
    if record.get("damaged"):
        raise UserError(
            f"resume: {path} is damaged ({record['damaged']}); nothing was started. Restore it from the copy beside "
            f"the run's tables (TABLES/{STORE_RECORDS}/RUN_ID.yaml), or start the run again with its command and flags"
        )
    command, config = record["command"], record["config"]
    if command not in RESUMABLE:
        raise UserError(f"resume: {path}: command {command!r} cannot be resumed (one of {', '.join(RESUMABLE)})")
    if isinstance(config.get("storage"), dict):
        config["storage"]["output_dir"] = str(path.parent.resolve())  # the run is where its record is
    return command, build_config(config, {}, source=str(path))
