"""Prompt datasets in slime's format, imported into a Delta table.

slime reads a JSONL (or Parquet) file whose records hold the prompt under ``--input-key`` (plain text, or a
list of chat messages), the reference answer under ``--label-key`` and optional ``--metadata-key``; other
fields are ignored, as in slime. We validate every record up front and stop at the first bad one with a
one-line :class:`UserError` naming file and line (JSONL, 1-based) or row (Parquet, 0-based) — a dataset
that silently loses rows skews every later result. Importing the same content twice adds nothing.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from sluiceway.infra.errors import UserError
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.tables import append_idempotent, read_table, table_exists, table_version

MESSAGE_TYPE = pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())])

DATASET_SCHEMA = pa.schema(
    [
        # "{file stem}:{line}" (JSONL), "{file stem}:{row}" (Parquet), "{source}:{i}" (records): stable
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("row_index", pa.int64(), nullable=False),  # 0-based position among the file's records
        pa.field("prompt", pa.string()),  # plain-text prompt, or null when the prompt is chat messages
        pa.field("messages", pa.list_(MESSAGE_TYPE)),  # chat-message prompt, or null when it is plain text
        pa.field("label", pa.string()),  # reference answer as text (JSON scalars are stringified)
        pa.field("metadata", pa.string(), nullable=False),  # JSON object, "{}" when absent
        pa.field("source", pa.string(), nullable=False),  # file (or generator) the rows came from
    ]
)

_JSONL_SUFFIXES = (".jsonl", ".json")
_PARQUET_SUFFIXES = (".parquet",)


@dataclass(frozen=True)
class DatasetInfo:
    """What an import produced: the table, the records in the input, the table version after the import."""

    name: str
    rows: int
    version: int
    added: bool = True  # False when the same content had been imported before (nothing was written)


def import_prompts(
    path: str | Path,
    store: ObjectStore,
    name: str,
    input_key: str = "input",
    label_key: str | None = "label",
    metadata_key: str = "metadata",
) -> DatasetInfo:
    """Validate a JSONL/Parquet prompt file and append it to the dataset table ``name``."""
    rows, raw = check_prompt_file(path, input_key, label_key, metadata_key)
    digest = hashlib.sha256(raw)
    digest.update(json.dumps([input_key, label_key, metadata_key]).encode())
    return _append(store, name, rows, app_id=f"dataset:{digest.hexdigest()}")


def check_prompt_file(
    path: str | Path, input_key: str = "input", label_key: str | None = "label", metadata_key: str = "metadata"
) -> tuple[list[dict[str, Any]], bytes]:
    """The rows of a JSONL/Parquet prompt file and its bytes; the first mistake is a UserError naming its line.

    Needs no store: a run calls it before anything starts (flows/preflight.py), so a bad file costs a second.
    """
    file = Path(path)
    shown = str(path)
    suffix = file.suffix.lower()
    if file.is_dir():
        raise UserError(f"{shown}: a directory; expected a .jsonl, .json or .parquet file")
    if suffix not in _JSONL_SUFFIXES + _PARQUET_SUFFIXES:
        raise UserError(f"{shown}: unsupported file type {suffix or '(none)'!r}; expected .jsonl, .json or .parquet")
    if not file.is_file():
        raise UserError(f"{shown}: prompt file not found")
    try:
        raw = file.read_bytes()
    except OSError as e:
        raise UserError(f"{shown}: cannot read it ({e.strerror or e})") from None
    if suffix in _PARQUET_SUFFIXES:
        records = _parquet_records(file, shown)
    else:
        records = _jsonl_records(raw, shown)
    if not records:
        raise UserError(f"{shown}: empty file; expected at least one prompt record")
    stem = file.stem
    rows = [
        _to_row(rec, where, f"{stem}:{pos}", i, str(file.resolve()), input_key, label_key, metadata_key)
        for i, (where, pos, rec) in enumerate(records)
    ]
    return rows, raw


def import_records(
    records: list[dict[str, Any]],
    store: ObjectStore,
    name: str,
    source: str,
    input_key: str = "input",
    label_key: str | None = "label",
    metadata_key: str = "metadata",
) -> DatasetInfo:
    """Append in-memory records (e.g. from a procedural environment) in the same format as a prompt file.

    ``source`` names the generator (e.g. ``"env:addition?seed=0&n=512"``); errors name it and the record index.
    """
    if not records:
        raise UserError(f"{source}: no records; expected at least one prompt record")
    rows = [
        _to_row(rec, f"{source}: record {i}", f"{source}:{i}", i, source, input_key, label_key, metadata_key)
        for i, rec in enumerate(records)
    ]
    digest = hashlib.sha256(json.dumps([source, input_key, label_key, metadata_key]).encode())
    digest.update(json.dumps(rows, sort_keys=True, default=str).encode())
    return _append(store, name, rows, app_id=f"dataset:{digest.hexdigest()}")


def load_prompts(
    store: ObjectStore, name: str, version: int | None = None, source: str | None = None
) -> list[dict[str, Any]]:
    """The prompts of dataset ``name`` (only those from ``source``, if given) as dicts, in a stable order
    (source, then row)."""
    if not table_exists(store, name):
        raise UserError(f"dataset {name!r} not found in {store.root}; import it first")
    filters = [("source", "=", source)] if source is not None else None
    table = read_table(store, name, version=version, filters=filters)
    table = table.sort_by([("source", "ascending"), ("row_index", "ascending")])
    rows = table.to_pylist()
    for row in rows:
        row["metadata"] = json.loads(row["metadata"]) if row["metadata"] else {}
    return rows


# -- reading ---------------------------------------------------------------------------------------------------


def _jsonl_records(raw: bytes, shown: str) -> list[tuple[str, int, Any]]:
    """(where, line number, parsed object) per non-blank line."""
    out = []
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        where = f"{shown}:{lineno}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UserError(f"{where}: not valid UTF-8 (byte {exc.start + 1}); expected UTF-8 JSON") from None
        if lineno == 1:
            text = text.removeprefix("\ufeff")  # editors on Windows add a byte-order mark
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(
                f"{where}: malformed JSON ({exc.msg} at column {exc.colno}); expected one JSON object per line"
            ) from None
        out.append((where, lineno, obj))
    return out


def _parquet_records(file: Path, shown: str) -> list[tuple[str, int, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(file)
    except (pa.ArrowException, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{shown}: cannot read as Parquet ({first})") from None
    return [(f"{shown}: row {i}", i, rec) for i, rec in enumerate(table.to_pylist())]


# -- validating ------------------------------------------------------------------------------------------------


def _to_row(
    rec: Any,
    where: str,
    prompt_id: str,
    row_index: int,
    source: str,
    input_key: str,
    label_key: str | None,
    metadata_key: str,
) -> dict[str, Any]:
    if not isinstance(rec, dict):
        raise UserError(f"{where}: expected a JSON object, got {_kind(rec)}")
    if input_key not in rec:
        raise UserError(f"{where}: missing input key {input_key!r} (the prompt); keys present: {sorted(rec)}")
    prompt, messages = _prompt(rec[input_key], where, input_key)
    label = None
    if label_key is not None:
        if label_key not in rec:
            raise UserError(
                f"{where}: missing label key {label_key!r} (the reference answer); keys present: {sorted(rec)}"
            )
        label = _label(rec[label_key], where, label_key)
    return {
        "prompt_id": prompt_id,
        "row_index": row_index,
        "prompt": prompt,
        "messages": messages,
        "label": label,
        "metadata": _metadata(rec.get(metadata_key), where, metadata_key),
        "source": source,
    }


def _prompt(value: Any, where: str, key: str) -> tuple[str | None, list[dict[str, str]] | None]:
    if isinstance(value, str):
        if not value.strip():
            raise UserError(f"{where}: {key!r} is empty; expected prompt text or a list of chat messages")
        return value, None
    if not isinstance(value, list) or not value:
        raise UserError(
            f"{where}: {key!r} is {_kind(value)}; expected prompt text or a non-empty list of "
            '{"role": ..., "content": ...} messages'
        )
    messages = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise UserError(f'{where}: {key!r} message {i} is {_kind(msg)}; expected {{"role": ..., "content": ...}}')
        extra = sorted(set(msg) - {"role", "content"})
        if extra:
            raise UserError(f"{where}: {key!r} message {i} has unsupported keys {extra}; expected only role, content")
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or not role:
            raise UserError(f"{where}: {key!r} message {i} has role {_kind(role)}; expected a non-empty string")
        if not isinstance(content, str):
            raise UserError(f"{where}: {key!r} message {i} has content {_kind(content)}; expected a string")
        messages.append({"role": role, "content": content})
    return None, messages


def _label(value: Any, where: str, key: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)):
        return json.dumps(value)  # true / 3 / 2.5: the JSON spelling, as a verifier would compare it
    if isinstance(value, dict):  # slime's search-r1 labels: {"ground_truth": ...}; slime plugins get the dict back
        return json.dumps(value, sort_keys=True, default=str)
    raise UserError(f"{where}: {key!r} is {_kind(value)}; expected a string or number, or an object (kept as JSON)")


def _metadata(value: Any, where: str, key: str) -> str:
    if value is None:
        return "{}"
    if isinstance(value, str):  # Parquet writers often store a dict as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise UserError(f"{where}: {key!r} is a string that is not JSON; expected an object") from None
    elif isinstance(value, list) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        value = dict(value)  # a Parquet map column reads back as (key, value) pairs
    if not isinstance(value, dict):
        raise UserError(f"{where}: {key!r} is {_kind(value)}; expected an object")
    return json.dumps(value, sort_keys=True, default=str)


def _kind(value: Any) -> str:
    return {
        type(None): "null",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }.get(type(value), type(value).__name__)


# -- writing ---------------------------------------------------------------------------------------------------


def _append(store: ObjectStore, name: str, rows: list[dict[str, Any]], app_id: str) -> DatasetInfo:
    table = pa.Table.from_pylist(rows, schema=DATASET_SCHEMA)
    added = append_idempotent(store, name, table, app_id=app_id)
    version = table_version(store, name)
    assert version is not None
    return DatasetInfo(name=name, rows=len(rows), version=version, added=added)
