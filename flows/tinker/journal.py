"""The Tinker server's record on the object store (storage/tinker.py): every finished request's answer (a JSON
file a restarted server reads back for `retrieve_future`) and its summary row in `tinker_requests`, every sampled
sequence a row in `tinker_samples`. Written in the request's own thread before the client is answered, so a
request the client saw finished is on the store whatever kills the server after."""

from __future__ import annotations

import datetime as _dt
import json
import time

from sluiceway.flows.tinker.futures import Result, _Entry
from sluiceway.storage import tinker as tables
from sluiceway.storage.object_store import ObjectStore


class Journal:
    def __init__(self, store: ObjectStore, server_id: str) -> None:
        self.store, self.server_id = store, server_id

    def _result_path(self, rid: str) -> str:
        return tables.server_path(self.store, self.server_id, "results", f"{rid}.json")

    def record(self, rid: str, entry: _Entry, result: Result) -> None:
        if entry.info.get("restored"):
            return
        tables.write_json(self.store, self._result_path(rid),
                          tables.result_record(result.json, result.proto, result.error, result.category))  # fmt: skip
        tables.append_requests(self.store, self.server_id, [request_row(rid, entry, result)])
        if result.samples:
            tables.append_samples(self.store, self.server_id, result.samples)

    def lookup(self, rid: str) -> Result | None:
        record = tables.read_json(self.store, self._result_path(rid))
        if record is None:
            return None
        body, proto, error, category = tables.record_parts(record)
        return Result(json=body, proto=proto, error=error, category=category)


def request_row(rid: str, entry: _Entry, result: Result) -> dict:
    now = time.monotonic()
    info = {**entry.info, **result.summary}
    metrics = info.pop("metrics", None) or {}
    model_id = info.get("model_id")
    session = info.get("session_id") or (model_id.split(":train:")[0] if model_id and ":train:" in model_id else None)
    config = info.get("loss_fn_config")
    started = entry.started if entry.started is not None else now
    return {
        "request_id": rid,
        "request_type": info.get("type", "unknown"),
        "session_id": session,
        "model_id": model_id,
        "seq_id": info.get("seq_id"),
        "loss_fn": info.get("loss_fn"),
        "loss_fn_config": json.dumps(config, sort_keys=True) if config else None,
        "num_datums": info.get("num_datums"),
        "num_tokens": info.get("num_tokens"),
        "loss": metrics.get("loss:sum"),
        "metrics": json.dumps(metrics, sort_keys=True) if metrics else None,
        "status": "error" if result.error is not None else "ok",
        "error": result.error,
        "error_category": result.category if result.error is not None else None,
        "submitted_at": entry.submitted_at,
        "finished_at": _dt.datetime.now(_dt.UTC),
        "queue_s": max(0.0, started - entry.created),
        "run_s": max(0.0, now - started) if entry.started is not None else 0.0,
    }
