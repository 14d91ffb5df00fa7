"""The pool registry on a local directory and on a real S3 server (SeaweedFS): records written, listed, removed;
drain requests asked for and seen; a record that is not one is skipped with one warning."""

from __future__ import annotations

import json
import logging

from sluiceway.storage.weights.pool_registry import PoolRecord, PoolRegistry
from sluiceway.storage.weights.store import WeightStore


def test_records_and_drain_requests(store, caplog):
    registry = PoolRegistry(WeightStore(store, "weights"))
    assert registry.records() == {} and not registry.drain_requested("east")
    registry.write(PoolRecord(pool="east", url="http://e:1", capacity=8, serving=3, beat=1, extra="kept"))
    registry.write(PoolRecord(pool="west", state="draining", beat=4))
    records = registry.records()
    assert sorted(records) == ["east", "west"]
    assert (records["east"].capacity, records["east"].serving, records["east"].model_extra) == (8, 3, {"extra": "kept"})
    assert records["west"].state == "draining" and records["west"].url is None
    registry.request_drain("east")
    assert registry.drain_requested("east") and not registry.drain_requested("west")
    assert sorted(registry.records()) == ["east", "west"]  # a drain request is not a record
    registry.remove("east")
    assert sorted(registry.records()) == ["west"] and not registry.drain_requested("east")
    registry.remove("nobody")  # nothing to remove: no error

    ws = registry.wstore  # written by something else than an agent: capacity must be >= 1
    ws.put_text(ws.path("pools", "broken.json"), json.dumps({"pool": "broken", "capacity": 0}))
    with caplog.at_level(logging.WARNING, "sluiceway.pools"):
        assert sorted(registry.records()) == ["west"]
        assert sorted(registry.records()) == ["west"]
    assert sum("record broken.json is not a pool record" in r.message for r in caplog.records) == 1
