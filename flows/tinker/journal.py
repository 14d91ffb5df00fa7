"""The Tinker server's record on the object store (storage/tinker.py): every finished request's answer (a JSON
file a restarted server reads back for `retrieve_future`) and its summary row in `tinker_requests`, every sampled
sequence a row in `tinker_samples`. Written in the request's own thread before the client is answered, so a
request the client saw finished is on the store whatever kills the server after.

Rows are group-committed: a Delta commit costs about 30 ms whatever it holds, and a sampling client finishes many
requests at once (tinker-cookbook sends every episode of a step as its own sample request). A request whose rows
arrive while a commit is under way waits for it, then the next commit takes every row that waited, so N requests
finishing together cost a few commits, not 2N; each is still answered only after its own rows are committed."""

from __future__ import annotations

import datetime as _dt
import json
import logging
import threading
import time
from dataclasses import dataclass, field

from sluiceway.flows.tinker.futures import Result, _Entry
from sluiceway.storage import tinker as tables
from sluiceway.storage.object_store import ObjectStore

log = logging.getLogger("sluiceway")
UPKEEP_EVERY = 200  # group commits between two upkeeps of the request and sample tables (storage/tinker.py upkeep)


@dataclass
class _Rows:
    requests: list[dict]
    samples: list[dict]
    done: bool = False
    error: BaseException | None = None


@dataclass
class _GroupCommit:
    """Leader and followers: the first request to find no commit under way commits every waiting request's rows
    (its own among them) in one commit per table; the others wait to be told theirs are in (or how it failed)."""

    store: ObjectStore
    server_id: str
    cv: threading.Condition = field(default_factory=threading.Condition)
    waiting: list[_Rows] = field(default_factory=list)
    committing: bool = False
    commits: int = 0  # commits made (both tables' together count once): for tests and benchmarks

    def commit(self, requests: list[dict], samples: list[dict]) -> None:
        mine = _Rows(requests, samples)
        with self.cv:
            self.waiting.append(mine)
            while not mine.done and self.committing:
                self.cv.wait()
            if mine.done:
                if mine.error is not None:
                    raise mine.error
                return
            batch, self.waiting, self.committing = self.waiting, [], True
        error = None
        try:
            tables.append_requests(self.store, self.server_id, [r for b in batch for r in b.requests])
            tables.append_samples(self.store, self.server_id, [r for b in batch for r in b.samples])
        except BaseException as e:  # noqa: BLE001 (every request of the batch learns it; the leader raises it)
            error = e
        if error is None and (self.commits + 1) % UPKEEP_EVERY == 0:
            try:  # while still the committer: no other commit of this process runs against it
                tables.upkeep(self.store)
            except Exception:  # noqa: BLE001 - upkeep is an economy; the answers do not depend on it
                log.exception("tinker: upkeep of the request tables failed; it is tried again later")
        with self.cv:
            for b in batch:
                b.done, b.error = True, error
            self.committing = False
            self.commits += 1
            self.cv.notify_all()
        if error is not None:
            raise error


class Journal:
    def __init__(self, store: ObjectStore, server_id: str) -> None:
        self.store, self.server_id = store, server_id
        self.rows = _GroupCommit(store, server_id)

    def _result_path(self, rid: str) -> str:
        return tables.server_path(self.store, self.server_id, "results", f"{rid}.json")

    def record(self, rid: str, entry: _Entry, result: Result) -> None:
        if entry.info.get("restored"):
            return
        tables.write_json(self.store, self._result_path(rid),
                          tables.result_record(result.json, result.proto, result.error, result.category))  # fmt: skip
        self.rows.commit([request_row(rid, entry, result)], result.samples)

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
