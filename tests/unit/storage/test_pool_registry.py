"""The pool registry on a local directory and on a real S3 server (SeaweedFS): records written, listed, removed;
drain requests asked for and seen; a record that is not one is skipped with one warning. Issue 40: an entry that
is no record (nested 5,000 deep, a NaN heartbeat, a URL that does not parse, the name 'local', a FIFO, a
directory, over the size cap) is skipped with one line and hides no other; an unchanged record is not read again."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.weights.pool_registry import MAX_RECORD_BYTES, PoolRecord, PoolRegistry
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


# -- issue 40: what a registry entry may be, and what a run does with it ------------------------------------------

NESTED = '{"pool": "deep", "x": ' + "[" * 5000 + "]" * 5000 + "}"
BAD_RECORDS = {  # file -> its text: each reproduction of issue 40 points 3 and 11
    "deep": NESTED,  # json.loads raised RecursionError, which ended the run
    "nan": '{"pool": "nan", "url": "http://n:1", "heartbeat_s": NaN}',  # accepted: the pool was never dropped
    "inf": '{"pool": "inf", "url": "http://n:1", "heartbeat_s": Infinity}',
    "ipv6": json.dumps({"pool": "ipv6", "url": "http://[::1"}),  # httpx.InvalidURL at connect ended the run
    "port": json.dumps({"pool": "port", "url": "http://p:99999"}),
    "local": json.dumps({"pool": "local", "url": "http://l:1"}),  # the run's own engines' name was accepted
    "alias": json.dumps({"pool": "local", "url": "http://l:1"}),  # the same, under another file name
    "other": json.dumps({"pool": "east", "url": "http://o:1"}),  # a record naming another pool
    "binary": "\udcff\udcfe",  # bytes that are no UTF-8 (written below as such)
    "list": "[1, 2]",
    "region": json.dumps({"pool": "region", "region": "eu\n\x1b[31m"}),  # would reach log lines
    "beat": json.dumps({"pool": "beat", "beat": "7"}),  # strict: a string is no count
}


def _put(ws, file: str, text: str) -> None:
    data = text.encode("utf-8", "surrogateescape")
    if ws.store.is_s3:
        ws.fs.pipe_file(ws.path("pools", file), data)
    else:
        Path(ws.path("pools", file)).write_bytes(data)


@pytest.mark.parametrize("bad", sorted(BAD_RECORDS))
def test_a_bad_record_is_skipped_with_one_line_and_hides_no_other(store, caplog, bad):
    registry = PoolRegistry(WeightStore(store, "weights"))
    registry.write(PoolRecord(pool="east", url="http://e:1", serving=3, beat=1))
    _put(registry.wstore, f"{bad}.json", BAD_RECORDS[bad])
    with caplog.at_level(logging.WARNING, "sluiceway.pools"):
        for _ in range(3):  # three refreshes, one line
            assert sorted(registry.records()) == ["east"] and registry.records()["east"].serving == 3
            assert registry.record(bad) is None
    said = [r.message for r in caplog.records if f"record {bad}.json" in r.message]
    assert len(said) == 1 and "skipped" in said[0], said
    assert "http://" not in caplog.text  # a URL may carry credentials: never in a warning


def test_records_that_runs_refuse_cannot_be_made_or_written(tmp_path):
    refused = [{"heartbeat_s": float("nan")}, {"heartbeat_s": 0}, {"heartbeat_s": 1e9}, {"url": "http://[::1"}]
    refused += [{"url": "ftp://x:1"}, {"url": "http://:1"}, {"pool": "local"}, {"pool": "a b"}, {"capacity": 0}]
    for bad in refused:
        with pytest.raises(ValidationError):
            PoolRecord(**{"pool": "p", **bad})
    registry = PoolRegistry(WeightStore(ObjectStore.from_uri(str(tmp_path / "s")), "w"))
    record = PoolRecord(pool="p", url="http://p:1")
    record.heartbeat_s = float("nan")  # assignment is not validated: the write is
    with pytest.raises(ValueError):
        registry.write(record)
    assert registry.records() == {}


def test_a_fifo_named_like_a_record_is_never_opened(tmp_path, caplog):
    """The run hung on `pools/fifo.json` (a blocking open waits for a writer forever), with no log line."""
    registry = PoolRegistry(WeightStore(ObjectStore.from_uri(str(tmp_path / "s")), "w"))
    registry.write(PoolRecord(pool="east", url="http://e:1"))
    os.mkfifo(registry.wstore.path("pools", "fifo.json"))
    os.mkfifo(registry.wstore.path("pools", "east.drain"))  # a drain request is an entry, never read
    found: list = []

    def read() -> None:
        found.extend([sorted(registry.records()), registry.record("fifo"), registry.drain_requested("east")])

    with caplog.at_level(logging.WARNING, "sluiceway.pools"):
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(120)  # a guard against hanging the suite, not a timing: a blocked open never returns
        assert not reader.is_alive(), "the registry opened the FIFO and waits for a writer"
    assert found == [["east"], None, True]
    assert sum("record fifo.json is not read (it is a FIFO, not a file)" in r.message for r in caplog.records) == 1


def test_a_directory_named_like_a_record_hides_no_pool(store, caplog):
    """`pools/dir.json` a directory (on S3 a prefix): every read of the registry failed, and a live pool never
    joined."""
    registry = PoolRegistry(WeightStore(store, "weights"))
    registry.write(PoolRecord(pool="east", url="http://e:1"))
    ws = registry.wstore
    if store.is_s3:
        ws.fs.pipe_file(ws.path("pools", "dir.json", "inside"), b"{}")
    else:
        os.mkdir(ws.path("pools", "dir.json"))
    with caplog.at_level(logging.WARNING, "sluiceway.pools"):
        assert sorted(registry.records()) == ["east"]
        assert sorted(registry.records()) == ["east"]
        assert registry.record("dir") is None
    assert sum("record dir.json is not read (it is a directory" in r.message for r in caplog.records) == 1


def test_an_unchanged_record_is_not_read_again_and_an_oversized_one_never(store, caplog, monkeypatch):
    """A 200 MB record was read whole at every refresh (steps went from 0.6 s to 1.0-1.5 s)."""
    import sluiceway.storage.weights.pool_registry as pool_registry

    parsed: list[int] = []
    real = pool_registry._parse
    monkeypatch.setattr(pool_registry, "_parse", lambda name, data: parsed.append(len(data)) or real(name, data))
    registry = PoolRegistry(WeightStore(store, "weights"))
    registry.write(PoolRecord(pool="east", url="http://e:1", beat=1))
    _put(registry.wstore, "huge.json", json.dumps({"pool": "huge", "pad": "x" * (MAX_RECORD_BYTES + 1)}))
    with caplog.at_level(logging.WARNING, "sluiceway.pools"):
        for _ in range(3):
            assert sorted(registry.records()) == ["east"]
    assert len(parsed) == 1 and parsed[0] < MAX_RECORD_BYTES  # east once; huge never read
    assert sum("record huge.json is not read" in r.message and "over the" in r.message for r in caplog.records) == 1
    registry.write(PoolRecord(pool="east", url="http://e:1", beat=2))  # a heartbeat: read again
    assert registry.records()["east"].beat == 2 and len(parsed) == 2
    if not store.is_s3:  # a fixed pool's record (no listing): unchanged, not read again either
        assert registry.record("east").beat == 2 and len(parsed) == 2


def test_a_record_that_became_bad_and_good_again_is_said_each_time(tmp_path, caplog):
    registry = PoolRegistry(WeightStore(ObjectStore.from_uri(str(tmp_path / "s")), "w"))
    registry.write(PoolRecord(pool="west"))
    with caplog.at_level(logging.INFO, "sluiceway.pools"):
        for beat in (1, 2):
            _put(registry.wstore, "east.json", "not json")
            assert sorted(registry.records()) == ["west"]
            registry.write(PoolRecord(pool="east", url="http://e:1", beat=beat))
            assert registry.records()["east"].beat == beat
    assert sum("record east.json is not a pool record" in r.message for r in caplog.records) == 2
    assert sum("record east.json is readable again" in r.message for r in caplog.records) == 2
