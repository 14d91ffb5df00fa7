"""What a Tinker server (flows/tinker/) did, on the object store, so it can be queried and outlives the process.

Two Delta tables, partitioned by ``server_id`` (`sluiceway tinker serve --server-id`):

- ``tinker_requests``: one row per finished request (a future's result, or a call that failed at once): its
  session, model, sequence id, type, loss function, datums and tokens, metrics (``loss`` apart, all of them as
  JSON), timing, status and error.
- ``tinker_samples``: one row per sampled sequence: prompt and output tokens, log-probs, the sampler's weights
  (its ``tinker://`` path, or the base model), seed, sampling settings.

Not the trajectories table: a Tinker sample has no reward, group or advantage of ours (the client computes them),
and inventing them would make RL queries over that table wrong.

Besides the tables, files under ``tinker/<server_id>/`` on the store: ``results/<request_id>.json`` (a finished
future's answer, read back by a restarted server's ``retrieve_future``), ``weights/<model_id>/<name>/`` (a
``save_state`` checkpoint: the trainer's checkpoint files and ``tinker.json``, what the model was created with),
``sampler_weights/<hash>.json`` (a ``tinker://`` sampler path and the directory under the server's work dir it
was saved to), ``training_runs/<model_id>.json`` (what the REST client's ``get_training_run`` answers: base model,
LoRA rank, the user's metadata, the last saved checkpoints).
"""

from __future__ import annotations

import base64
import datetime as _dt
import json
from typing import Any

import pyarrow as pa

from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.tables import append_idempotent_many, conform, read_table, table_exists

REQUESTS = "tinker_requests"
SAMPLES = "tinker_samples"
PARTITION_BY = ["server_id"]
TABLES = [REQUESTS, SAMPLES]  # compact them with storage/maintenance.py's maintain(store, TABLES)
_TS = pa.timestamp("us", tz="UTC")

REQUEST_SCHEMA = pa.schema(
    [
        pa.field("server_id", pa.string(), nullable=False),
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("request_type", pa.string(), nullable=False),  # forward_backward, forward, optim_step, asample...
        pa.field("session_id", pa.string()),
        pa.field("model_id", pa.string()),
        pa.field("seq_id", pa.int64()),
        pa.field("loss_fn", pa.string()),
        pa.field("loss_fn_config", pa.string()),  # JSON object, or null
        pa.field("num_datums", pa.int64()),  # forward/backward datums; samples asked for (asample)
        pa.field("num_tokens", pa.int64()),  # input tokens (forward/backward), prompt + sampled tokens (asample)
        pa.field("loss", pa.float64()),  # metrics["loss:sum"] where there is one
        pa.field("metrics", pa.string()),  # JSON object of every metric of the result
        pa.field("status", pa.string(), nullable=False),  # ok or error
        pa.field("error", pa.string()),
        pa.field("error_category", pa.string()),  # user or server (the SDK's RequestErrorCategory)
        pa.field("submitted_at", _TS, nullable=False),
        pa.field("finished_at", _TS, nullable=False),
        pa.field("queue_s", pa.float64(), nullable=False),  # waiting for its turn (seq_id order, the pool)
        pa.field("run_s", pa.float64(), nullable=False),  # running
    ]
)

SAMPLE_SCHEMA = pa.schema(
    [
        pa.field("server_id", pa.string(), nullable=False),
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("sequence_id", pa.string(), nullable=False),  # "<request_id>:<index>", the SDK's sample_sequence_ids
        pa.field("sample_index", pa.int64(), nullable=False),
        pa.field("session_id", pa.string()),
        pa.field("sampling_session_id", pa.string()),
        pa.field("sampler_path", pa.string(), nullable=False),  # tinker://.../sampler_weights/NAME, or the base model
        pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("output_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("stop_reason", pa.string(), nullable=False),  # stop or length
        pa.field("seed", pa.int64()),  # this sample's seed (the request's seed + index), null when unseeded
        pa.field("temperature", pa.float64(), nullable=False),
        pa.field("top_p", pa.float64(), nullable=False),
        pa.field("top_k", pa.int64(), nullable=False),
        pa.field("max_tokens", pa.int64(), nullable=False),
        pa.field("created_at", _TS, nullable=False),
    ]
)


def append_requests(store: ObjectStore, server_id: str, rows: list[dict[str, Any]]) -> None:
    """Append request rows (dicts of REQUEST_SCHEMA's fields; ``server_id`` added) in one commit; a request id
    already written is skipped (idempotent per request)."""
    _append(store, REQUESTS, REQUEST_SCHEMA, server_id, rows, lambda r: f"tinker:{server_id}:{r['request_id']}")


def append_samples(store: ObjectStore, server_id: str, rows: list[dict[str, Any]]) -> None:
    """Append sample rows (one per sampled sequence) in one commit, idempotent per sequence id."""
    _append(store, SAMPLES, SAMPLE_SCHEMA, server_id, rows, lambda r: f"tinker-sample:{server_id}:{r['sequence_id']}")


def upkeep(store: ObjectStore) -> None:
    """Compact and checkpoint the request and sample tables, and reopen their handles from the checkpoint: every
    request is a commit, and an open handle's state grew with each (about 0.2 MB a request, a server's memory
    without bound; the run's tables get the same upkeep, storage/maintenance.py)."""
    from sluiceway.storage import handles
    from sluiceway.storage.maintenance import maintain_table

    for name in (REQUESTS, SAMPLES):
        maintain_table(store, name)
        handles.forget(store, name)


def read_requests(store: ObjectStore, server_id: str) -> pa.Table:
    """Every request row of ``server_id``, in the order they finished."""
    return _read(store, REQUESTS, REQUEST_SCHEMA, server_id, "finished_at")


def read_samples(store: ObjectStore, server_id: str) -> pa.Table:
    """Every sampled sequence of ``server_id``, by time, request and index."""
    return _read(store, SAMPLES, SAMPLE_SCHEMA, server_id, "created_at", "request_id", "sample_index")


def _append(store, name, schema, server_id, rows, app_id) -> None:
    if not rows:
        return
    now = _dt.datetime.now(_dt.UTC)
    items = []
    for r in rows:
        full = {"server_id": server_id, **r}
        for ts in ("created_at", "finished_at", "submitted_at"):
            if ts in schema.names and full.get(ts) is None:
                full[ts] = now
        items.append((conform(pa.Table.from_pylist([full]), schema, what=name), app_id(full)))
    append_idempotent_many(store, name, items, partition_by=PARTITION_BY)


def _read(store, name, schema, server_id, *order) -> pa.Table:
    if not table_exists(store, name):
        return schema.empty_table()
    table = read_table(store, name, filters=[("server_id", "=", server_id)])
    return table.select(schema.names).cast(schema).sort_by([(k, "ascending") for k in order])


# -- files under tinker/<server_id>/ ---------------------------------------------------------------------------


def server_path(store: ObjectStore, server_id: str, *parts: str) -> str:
    """A path under the server's prefix, as the store's filesystem wants it (no s3:// scheme)."""
    return store.join("tinker", server_id, *parts).removeprefix("s3://")


def write_json(store: ObjectStore, path: str, value: Any) -> None:
    """Write ``value`` as JSON at ``path`` (a server_path); a local file is written whole, then renamed, so a
    kill never leaves half of one."""
    fs = store.filesystem()
    data = json.dumps(value)
    with store.redacting():
        if store.is_s3:  # an object appears whole or not at all
            fs.pipe_file(path, data.encode())
            return
        import os

        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


class DamagedRecord(ValueError):
    """A record or saved state on the store that is not what was written (its message names it)."""


def read_json(store: ObjectStore, path: str) -> Any | None:
    """The JSON at ``path``, or None when there is none; DamagedRecord naming the path when it is not JSON."""
    fs = store.filesystem()
    with store.redacting():
        fs.invalidate_cache(path)
        if not fs.exists(path):
            return None
        with fs.open(path) as f:
            raw = f.read()
    try:
        return json.loads(raw)
    except ValueError as e:
        raise DamagedRecord(f"{path} is damaged (not JSON: {e})") from None


def result_record(json_body: dict | None, proto: bytes | None, error: str | None, category: str) -> dict:
    """A finished future's answer as JSON (protobuf bytes in base64)."""
    return {
        "json": json_body,
        "proto": None if proto is None else base64.b64encode(proto).decode(),
        "error": error,
        "category": category,
    }


def record_parts(record: dict) -> tuple[dict | None, bytes | None, str | None, str]:
    proto = record.get("proto")
    return (record.get("json"), None if proto is None else base64.b64decode(proto), record.get("error"),
            record.get("category", "user"))  # fmt: skip


def upload_state(store: ObjectStore, server_id: str, model_id: str, name: str, local_dir, info: dict) -> None:
    """Copy a `save_state` checkpoint directory to ``weights/<model_id>/<name>/`` and write its ``tinker.json``
    (``info``: base model, LoRA rank, ...) last: a checkpoint without it is incomplete and never loaded."""
    from pathlib import Path

    fs = store.filesystem()
    target = server_path(store, server_id, "weights", model_id, name)
    with store.redacting():
        fs.makedirs(target, exist_ok=True)
        marker = f"{target}/tinker.json"
        if fs.exists(marker):  # an overwrite: the old state stops counting before its files are replaced
            fs.rm(marker)
        for f in sorted(Path(local_dir).iterdir()):
            fs.put_file(str(f), f"{target}/{f.name}")
    write_json(store, f"{target}/tinker.json", info)


def state_info(store: ObjectStore, server_id: str, model_id: str, name: str) -> dict | None:
    """The ``tinker.json`` of a complete `save_state` checkpoint, or None when there is none."""
    return read_json(store, server_path(store, server_id, "weights", model_id, name, "tinker.json"))


def download_state(store: ObjectStore, server_id: str, model_id: str, name: str, local_dir) -> dict:
    """Fetch a complete `save_state` checkpoint into ``local_dir`` (replaced), its files checked against the
    digests the save recorded; returns its ``tinker.json``. FileNotFoundError when there is none."""
    import shutil
    from pathlib import Path

    from sluiceway.storage.checkpoints import checkpoint_problem

    info = state_info(store, server_id, model_id, name)
    if info is None:
        raise FileNotFoundError(f"no saved state {model_id}/{name}")
    fs = store.filesystem()
    source = server_path(store, server_id, "weights", model_id, name)
    local_dir = Path(local_dir)
    shutil.rmtree(local_dir, ignore_errors=True)
    local_dir.mkdir(parents=True)
    with store.redacting():
        fs.invalidate_cache(source)
        for remote in fs.ls(source, detail=False):
            fs.get_file(remote, str(local_dir / remote.rstrip("/").rsplit("/", 1)[-1]))
    problem = checkpoint_problem(local_dir)
    if problem is not None:  # named by its tinker:// path and place on the store, not the temporary copy
        raise DamagedRecord(f"tinker://{model_id}/weights/{name} ({source}) is damaged: {problem}; nothing was "
                            "loaded from it")  # fmt: skip
    return info


def delete_json(store: ObjectStore, path: str) -> bool:
    """Remove the JSON at ``path``; False when there was none."""
    fs = store.filesystem()
    with store.redacting():
        fs.invalidate_cache(path)
        if not fs.exists(path):
            return False
        fs.rm(path)
        return True


def delete_state(store: ObjectStore, server_id: str, model_id: str, name: str) -> bool:
    """Remove a `save_state` checkpoint (the REST client's delete_checkpoint): its ``tinker.json`` first, so a
    delete that stops half-way leaves an incomplete checkpoint that is never loaded, then its files. False when
    there is no complete one."""
    target = server_path(store, server_id, "weights", model_id, name)
    if not delete_json(store, f"{target}/tinker.json"):
        return False
    fs = store.filesystem()
    with store.redacting():
        fs.invalidate_cache(target)
        if fs.exists(target):
            fs.rm(target, recursive=True)
    return True


def training_run_path(store: ObjectStore, server_id: str, model_id: str) -> str:
    return server_path(store, server_id, "training_runs", f"{model_id}.json")
