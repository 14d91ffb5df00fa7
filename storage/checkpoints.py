"""Trainer checkpoints on the object store, so a run resumes on a machine that never saw its local disk.

Layout under the store root:

    checkpoints/<run_id>/step_000012/{meta.json, tp0.pt, ...}   one directory per saved step
    checkpoints/<run_id>/latest.json                            {"step": 12, "dir": "step_000012"}

An object store has no atomic directory rename, so a step's files are uploaded first and the `latest.json`
pointer is written last: a reader following the pointer never sees a half-uploaded checkpoint. Older steps
beyond `keep` are deleted after the pointer moves.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from sluiceway.infra.errors import Fault
from sluiceway.storage.digests import digests_problem
from sluiceway.storage.object_store import ObjectStore

log = logging.getLogger("sluiceway")


def _fs_path(store: ObjectStore, *parts: str) -> str:
    path = store.join(*parts)
    return path.removeprefix("s3://")


def upload_checkpoint(store: ObjectStore, run_id: str, local_dir: Path, step: int, keep: int = 2) -> str:
    """Copy the checkpoint directory `local_dir` (written by the trainer's `save`) to the store; return its URI."""
    fs = store.filesystem()
    name = f"step_{step:06d}"
    with store.redacting():
        target = _fs_path(store, "checkpoints", run_id, name)
        fs.makedirs(target, exist_ok=True)
        for f in sorted(Path(local_dir).iterdir()):
            fs.put_file(str(f), f"{target}/{f.name}")
        pointer = json.dumps({"step": step, "dir": name})
        with fs.open(_fs_path(store, "checkpoints", run_id, "latest.json"), "w") as out:
            out.write(pointer)
        # The step just written counts even if the store's listing does not show it yet.
        for old in sorted(set(_step_dirs(store, run_id)) | {name})[:-keep]:
            path = _fs_path(store, "checkpoints", run_id, old)
            fs.invalidate_cache(path)  # a cached (stale) listing would make the recursive delete miss files
            fs.rm(path, recursive=True)
    return store.join("checkpoints", run_id, name)


def _step_dirs(store: ObjectStore, run_id: str) -> list[str]:
    fs = store.filesystem()
    base = _fs_path(store, "checkpoints", run_id)
    fs.invalidate_cache(base)  # s3fs caches listings; steps come and go under this prefix
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(base, detail=False)]
    return sorted(n for n in names if n.startswith("step_"))


def latest_checkpoint_step(store: ObjectStore, run_id: str) -> int | None:
    """The step of the newest complete checkpoint on the store, or None."""
    fs = store.filesystem()
    pointer = _fs_path(store, "checkpoints", run_id, "latest.json")
    with store.redacting():
        fs.invalidate_cache(pointer)
        if not fs.exists(pointer):
            return None
        with fs.open(pointer) as f:
            return int(json.loads(f.read())["step"])


def download_checkpoint(store: ObjectStore, run_id: str, local_dir: Path) -> int | None:
    """Fetch the newest complete checkpoint into `local_dir` (replacing it); its step, or None if there is none."""
    fs = store.filesystem()
    pointer = _fs_path(store, "checkpoints", run_id, "latest.json")
    with store.redacting():
        fs.invalidate_cache(pointer)
        if not fs.exists(pointer):
            return None
        with fs.open(pointer) as f:
            info = json.loads(f.read())
        source = _fs_path(store, "checkpoints", run_id, info["dir"])
        fs.invalidate_cache(source)
        tmp = local_dir.with_name(local_dir.name + ".download")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for remote in fs.ls(source, detail=False):
            fs.get_file(remote, str(tmp / remote.rstrip("/").rsplit("/", 1)[-1]))
    verified(tmp)  # a damaged copy on the store must not replace a local checkpoint
    shutil.rmtree(local_dir, ignore_errors=True)
    tmp.rename(local_dir)
    return int(info["step"])


def save_checkpoint(trainer, local_dir: Path, step: int, store: ObjectStore | None, run_id: str) -> str:
    """Checkpoint `trainer` (anything with `save(dir, step)`) after `step` into `local_dir`; with a `store` the
    checkpoint also goes to it. Returns where it is: the store's URI, else the local directory."""
    trainer.save(local_dir, step)
    if store is not None:
        return upload_checkpoint(store, run_id, local_dir, step)
    return str(local_dir)


def fetch_newer_checkpoint(store: ObjectStore, run_id: str, local_dir: Path) -> int | None:
    """A run resumed elsewhere (or after losing its disk) takes the store's checkpoint if it is newer than the
    one in `local_dir`; returns the fetched step, or None when the local one stays."""
    settle_checkpoint_dir(local_dir)
    remote = latest_checkpoint_step(store, run_id)
    try:
        local = json.loads((local_dir / "meta.json").read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):  # none, or damaged: the store's copy is checked instead
        local = None
    if remote is not None and (local is None or remote > local):
        download_checkpoint(store, run_id, local_dir)
        log.info("fetched the step %d checkpoint from the object store", remote)
        return remote
    return None


def checkpoint_problem(path: str | Path) -> str | None:
    """What is wrong with the checkpoint directory `path` (unreadable meta.json, a file missing, truncated or
    changed since it was written), or None when every file matches what the save recorded. Checkpoints written
    before the digests were recorded are checked for their meta.json only."""
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
        recorded = meta.get("files")
        int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"meta.json is unreadable ({type(e).__name__})"
    if recorded is None:
        return None
    return digests_problem(path, recorded)


def settle_checkpoint_dir(local_dir: Path) -> None:
    """Finish or undo a local save that a kill interrupted (tasks/train/checkpoint.py writes DIR.tmp, moves DIR to
    DIR.old, DIR.tmp to DIR, then deletes DIR.old): afterwards only DIR is left, the newest complete one."""
    tmp, old = local_dir.with_name(local_dir.name + ".tmp"), local_dir.with_name(local_dir.name + ".old")
    if not local_dir.exists():
        if (tmp / "meta.json").exists():  # meta.json is written last: the new checkpoint is complete
            tmp.rename(local_dir)
        elif old.exists():
            old.rename(local_dir)
    for leftover in (tmp, old):
        if leftover.exists():
            shutil.rmtree(leftover)


def verified(local_dir: Path) -> Path:
    """`local_dir` if its files are what the save wrote; a damaged checkpoint is a Fault, never trained from."""
    problem = checkpoint_problem(local_dir)
    if problem is not None:
        raise Fault(
            f"checkpoint {local_dir} is damaged: {problem}. Nothing was trained from it. To recover, restore the "
            f"directory from a copy, or move it away to start again from step 0 (stored trajectories and "
            f"rewards are reused, so the run retrains without generating again)"
        )
    return local_dir


def load_checkpoint(trainer, local_dir: Path) -> int | None:
    """Load the checkpoint in `local_dir` into `trainer` (anything with `load(dir) -> step`), if there is one;
    return its step, or None. An interrupted save is settled first; a damaged checkpoint is a Fault."""
    settle_checkpoint_dir(local_dir)
    if not local_dir.exists():
        return None
    return trainer.load(verified(local_dir))
