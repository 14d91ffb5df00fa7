"""Checksums of a weight version directory that engines load: a run's `OUTPUT_DIR/weights/vNNNNNN` (full
weights or a LoRA adapter, tasks/sync/disk.py) and a pool's materialized copy of a store version (materialize.py).

    <dir>/checksums.json    {"weight_version": N, "files": {name: {"bytes": size, "sha256": hex}}}

The record is the one a checkpoint's meta.json keeps (storage/digests.py), over every file of the directory
(weights, config, tokenizer, the store's manifest): written last, before the directory is renamed into place, so
a version directory this build wrote always has it. Versions on the weight store itself need none: their
manifest holds the sha256 of every tensor and file, and `materialize` checks them all.

Checked where a version is trusted without being written again, not on every engine load (a sync loads the
directory it has just written): once when a run resumes (tasks/sync/disk.py `settle_versions`), when a pool agent
starts on the copy it holds (infra/pool_agent.py), and when `sluiceway eval` loads a run's weights. A directory
without checksums.json (written by a build before them) is not checked: it loads as it did.
"""

from __future__ import annotations

import json
from pathlib import Path

from sluiceway.storage.digests import digests_problem, file_digests

CHECKSUMS = "checksums.json"


def write_checksums(model_dir: Path, version: int, known: dict[str, dict] | None = None) -> None:
    """Record every file of `model_dir` (but hidden ones and this record); `known` gives digests computed while a
    file was written (the model file: `safetensors_raw.write` returns its sha256), which are not read again."""
    model_dir = Path(model_dir)
    known = known or {}
    names = [f.name for f in model_dir.iterdir() if f.is_file() and f.name != CHECKSUMS and not f.name.startswith(".")]
    files = file_digests(model_dir, [n for n in names if n not in known])
    files.update({n: d for n, d in known.items() if n in names})
    record = {"weight_version": version, "files": dict(sorted(files.items()))}
    (model_dir / CHECKSUMS).write_text(json.dumps(record, indent=1))


def has_checksums(model_dir: Path) -> bool:
    return (Path(model_dir) / CHECKSUMS).is_file()


def checksums_problem(model_dir: Path) -> str | None:
    """What is wrong with `model_dir` (a file missing, truncated or changed since its version was written, or an
    unreadable checksums.json), or None when every file matches, or when it has no checksums.json to check."""
    path = Path(model_dir) / CHECKSUMS
    if not path.is_file():
        return None
    try:
        recorded = json.loads(path.read_text())["files"]
        for d in recorded.values():
            int(d["bytes"]), str(d["sha256"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{CHECKSUMS} is unreadable ({type(e).__name__})"
    return digests_problem(Path(model_dir), recorded)
