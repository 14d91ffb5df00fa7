"""Before a run writes to its tables: every table opens at its latest version and every file it references exists
with the size it was written with. A damaged table is one line naming the table and how to recover, never a
run that "resumes" over data it can no longer read (issue 20: a deleted parquet file went unnoticed).

One listing per table (a recursive LIST on S3); the file count is bounded by upkeep (storage/maintenance.py).
"""

from __future__ import annotations

import os
import re
from urllib.parse import unquote

import pyarrow as pa
from deltalake import DeltaTable

from sluiceway.infra.errors import Fault
from sluiceway.storage.object_store import ObjectStore


def _newest_commit(store: ObjectStore, name: str) -> str:
    fs = store.filesystem()
    log_dir = store.join(name, "_delta_log").removeprefix("s3://")
    fs.invalidate_cache(log_dir)
    commits = sorted(p for p in fs.ls(log_dir, detail=False) if re.fullmatch(r"\d{20}\.json", p.rsplit("/", 1)[-1]))
    return commits[-1] if commits else log_dir


def check_table(store: ObjectStore, name: str) -> None:
    """Raise a Fault saying what is wrong with table `name` and how to recover; nothing if it is sound or absent."""
    uri = store.table_uri(name)
    with store.redacting():
        if not DeltaTable.is_deltatable(uri, storage_options=store.storage_options):
            return
        try:
            table = DeltaTable(uri, storage_options=store.storage_options)
            files = pa.table(table.get_add_actions(flatten=True)).select(["path", "size_bytes"]).to_pydict()
            files["path"] = [unquote(p) for p in files["path"]]  # the log percent-encodes partition values
        except Exception as e:  # deltalake's errors carry Rust backtraces: the first line says it
            newest = _newest_commit(store, name)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise Fault(
                f"table {uri} cannot be read ({first}). Its newest commit {newest} is likely cut short (a crash "
                f"or a full disk while it was written): move that file away to roll the table back one version "
                f"(what that commit wrote is lost; steps after the last checkpoint are redone), then resume; "
                f"docs/reliability.md"
            ) from e
        fs = store.filesystem()
        root = uri.removeprefix("s3://")
        if store.is_s3:
            fs.invalidate_cache(root)
            sizes = {p.removeprefix(root + "/"): info["size"] for p, info in fs.find(root, detail=True).items()}
        else:
            sizes = {}
            for path in files["path"]:
                full = os.path.join(root, path)
                if os.path.exists(full):
                    sizes[path] = os.path.getsize(full)
    missing = [p for p in files["path"] if p not in sizes]
    wrong = [p for p, n in zip(files["path"], files["size_bytes"]) if p in sizes and sizes[p] != n]
    if missing or wrong:
        what = f"{len(missing)} missing" if missing else f"{len(wrong)} changed in size"
        example = (missing or wrong)[0]
        raise Fault(
            f"table {uri} (version {table.version()}) references files that are gone or damaged ({what}, e.g. "
            f"{example}): their rows are lost. Restore them from a copy, or drop them from the table with "
            f"DeltaTable('{uri}').repair() and resume; docs/reliability.md"
        )


def check_tables(store: ObjectStore, names: list[str]) -> None:
    for name in names:
        check_table(store, name)
