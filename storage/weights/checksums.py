"""Checksums of a weight version directory that engines load: a run's `OUTPUT_DIR/weights/vNNNNNN` (full
weights or a LoRA adapter, tasks/sync/disk.py) and a pool's materialized copy of a store version (materialize.py).

    <dir>/checksums.json    {"weight_version": N, "files": {name: {"bytes": size, "sha256": hex}}}

The record is the one a checkpoint's meta.json keeps (storage/digests.py), over every file of the directory
(weights, config, tokenizer, the store's manifest): written last, before the directory is renamed into place, so
a version directory this build wrote always has it. Versions on the weight store itself need none: their
manifest holds the sha256 of every tensor and file, and `materialize` checks them all.

Checked where a version is trusted without being written again, not on every engine load (a sync loads the
directory it has just written): once when a run resumes (tasks/sync/disk.py `settle_versions`), when a pool agent
starts on the copy it holds (infra/pool_agent.py), and when `sluiceway eval` loads a run's weights. A record
must be of the version the directory is named for and list every file of it: an emptied record, or one copied
with another version's files, is damage like a changed byte.

checksums.json lies beside what it describes, so it can be lost or emptied with it. A run therefore keeps its own
record of what it published, outside the version directories (tasks/sync/disk.py writes it):

    <root>.published.json   {"versions": {"N": {"weight_version": N, "files": {...}}}}   (root: a run's weights/)

one entry per version on disk, the same record as the version's checksums.json, written (through a temporary file
and a rename) before the version's directory is renamed into place, so every version this build renamed into
place has one. `version_problem` checks a version against it first: a version directory whose files, or whose
checksums.json, are not what the run recorded for that version is damaged. Only a version the run's record has no
entry for and that has no checksums.json either (a build before both) is not checked: it loads as it did.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from sluiceway.storage.digests import digests_problem, file_digests

CHECKSUMS = "checksums.json"


def _listed_names(model_dir: Path) -> list[str]:
    """The files a record covers: every file of `model_dir` but hidden ones and checksums.json itself."""
    return sorted(
        f.name for f in Path(model_dir).iterdir() if f.is_file() and f.name != CHECKSUMS and not f.name.startswith(".")
    )


def write_checksums(model_dir: Path, version: int, known: dict[str, dict] | None = None) -> dict:
    """Record every file of `model_dir` (but hidden ones and this record); `known` gives digests computed while a
    file was written (the model file: `safetensors_raw.write` returns its sha256), which are not read again.
    Returns the record written."""
    model_dir = Path(model_dir)
    known = known or {}
    names = _listed_names(model_dir)
    files = file_digests(model_dir, [n for n in names if n not in known])
    files.update({n: d for n, d in known.items() if n in names})
    record = {"weight_version": version, "files": dict(sorted(files.items()))}
    (model_dir / CHECKSUMS).write_text(json.dumps(record, indent=1))
    return record


def has_checksums(model_dir: Path) -> bool:
    return (Path(model_dir) / CHECKSUMS).is_file()


def _read_record(text: str | dict) -> dict:
    """A record ({"weight_version", "files"}), parsed from `text`, with its fields checked; ValueError, KeyError,
    TypeError or AttributeError when it is not one."""
    record = json.loads(text) if isinstance(text, str) else text
    files = record["files"]
    for d in files.values():
        int(d["bytes"]), str(d["sha256"])
    if "weight_version" in record and not isinstance(record["weight_version"], int):
        raise TypeError("weight_version")
    return record


def _record_problem(model_dir: Path, record: dict, version: int | None, what: str) -> str | None:
    """What is wrong with `model_dir` against `record` (`what` names where the record is), or None."""
    if version is not None and record.get("weight_version", version) != version:
        return (
            f"{what} is weight version {record['weight_version']}'s, not v{version}'s (another version's directory "
            f"copied over this one?)"
        )
    files = record["files"]
    if not files:
        return f"{what} lists no files"
    unlisted = [n for n in _listed_names(model_dir) if n not in files]
    if unlisted:
        return f"{unlisted[0]} is not in {what} (every file of a version is recorded when it is written)"
    return digests_problem(Path(model_dir), files)


def checksums_problem(model_dir: Path, version: int | None = None) -> str | None:
    """What is wrong with `model_dir` (a file missing, truncated, changed or added since its version was written,
    an unreadable or empty checksums.json, or with `version`, a record of another version), or None when every
    file matches, or when it has no checksums.json to check."""
    path = Path(model_dir) / CHECKSUMS
    if not path.is_file():
        return None
    try:
        record = _read_record(path.read_text())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{CHECKSUMS} is unreadable ({type(e).__name__})"
    return _record_problem(Path(model_dir), record, version, CHECKSUMS)


def published_path(root: Path) -> Path:
    """The run's record of the versions it published under `root` (beside `root`, not in it)."""
    root = Path(root).absolute()  # "." has no name to put the record beside
    return root.with_name(root.name + ".published.json")


class UnreadableRecord(Exception):
    pass


def _published(root: Path) -> dict[str, dict]:
    path = published_path(root)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise UnreadableRecord(f"{path.name} is unreadable ({type(e).__name__})") from e
    try:
        versions = json.loads(text)["versions"]
        for key, record in versions.items():
            int(key), _read_record(record)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UnreadableRecord(f"{path.name} is unreadable ({type(e).__name__})") from e
    return versions


def record_published(root: Path, version: int, record: dict, on_disk: set[int]) -> None:
    """Enter `record` (write_checksums's) as `version`'s in the run's record beside `root`, keeping the entries of
    the versions `on_disk`; written through a temporary file and a rename. An unreadable record is started anew
    (the versions it covered are then checked against their checksums.json only)."""
    try:
        versions = _published(root)
    except UnreadableRecord:
        versions = {}
    versions = {k: r for k, r in versions.items() if int(k) in on_disk and int(k) != version}
    versions[str(version)] = {"weight_version": version, "files": record["files"]}
    path = published_path(root)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"versions": dict(sorted(versions.items(), key=lambda kv: int(kv[0])))}, indent=1))
    os.replace(tmp, path)


def version_problem(model_dir: Path, version: int) -> str | None:
    """What is wrong with version `version`'s directory `model_dir` (a run's `weights/vNNNNNN`), checked against
    the run's record of what it published when it has an entry for the version, else against checksums.json;
    None when it matches. A version neither records (a build before both) is None too: `recorded` says which."""
    model_dir = Path(model_dir)
    try:
        entry = _published(model_dir.parent).get(str(version))
    except UnreadableRecord as e:
        return f"../{e} (the run's record of the versions it published)"
    if entry is None:
        return checksums_problem(model_dir, version)
    what = f"../{published_path(model_dir.parent).name} (the run's record of v{version})"
    own = model_dir / CHECKSUMS
    if own.is_file():  # another version's directory shows in its own record first: name that, not a digest
        try:
            copied = _read_record(own.read_text()).get("weight_version", version) != version
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            copied = False
        if copied:
            return checksums_problem(model_dir, version)
    problem = _record_problem(model_dir, entry, version, what)
    if problem is not None:
        return problem
    if not own.is_file():
        return f"{CHECKSUMS} is missing (the run recorded v{version} with one)"
    try:
        files = _read_record(own.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{CHECKSUMS} is unreadable ({type(e).__name__})"
    if files != entry["files"]:
        return f"{CHECKSUMS} differs from {what}"
    return None


def has_record(model_dir: Path, version: int) -> bool:
    """Whether version `version`'s directory has a record to be checked against (the run's or its own)."""
    model_dir = Path(model_dir)
    try:
        if str(version) in _published(model_dir.parent):
            return True
    except UnreadableRecord:
        return True
    return has_checksums(model_dir)
