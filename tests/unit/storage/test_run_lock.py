"""The run lock (storage/run_lock.py): one live holder per run directory and per run's tables, on a local store
and on a real SeaweedFS; a dead or silent holder's lease is taken over; a holder that was taken over stops."""

import json
import multiprocessing as mp
import os
import socket
import time

import pytest
from storage_helpers import hold_run_lock, hold_run_lock_and_fork

from sluiceway.infra.errors import Fault, UserError
from sluiceway.storage import run_lock
from sluiceway.storage.run_lock import RunLock, _Lease


def test_second_holder_is_refused_and_names_the_first(tmp_path, store):
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=hold_run_lock, args=(tmp_path / "run", store, ready, stop))
    child.start()
    try:
        assert ready.wait(60)
        with pytest.raises(UserError, match=rf"in use by `sluiceway run` \(pid {child.pid} on "):
            RunLock(tmp_path / "run", store, "r1", "run").acquire()
        # Another directory, same run's tables: the store's lease refuses it.
        with pytest.raises(UserError, match=rf"held by `sluiceway run` \(pid {child.pid} on "):
            RunLock(tmp_path / "other", store, "r1", "run").acquire()
        # Another run id in another directory is independent.
        with run_lock.hold(tmp_path / "other", store, "r2", "run"):
            pass
    finally:
        stop.set()
        child.join(30)
    # A cleanly finished holder released both halves: the next command takes them at once.
    with run_lock.hold(tmp_path / "run", store, "r1", "resume") as lock:
        assert lock._lease.gen == 1


def test_a_killed_holder_is_taken_over_at_once_on_its_host(tmp_path, store, caplog):
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=hold_run_lock, args=(tmp_path / "run", store, ready, stop))
    child.start()
    assert ready.wait(60)
    child.kill()
    child.join(30)
    with caplog.at_level("INFO", logger="sluiceway"), run_lock.hold(tmp_path / "run", store, "r1", "resume") as lock:
        assert lock._lease.gen == 1  # generation 0 was the dead child's
    # Taking over a dead holder's lease is what every resume after a kill does: nothing to warn about (issue 30).
    assert not [r for r in caplog.records if "taking over" in r.getMessage()], caplog.text


def test_a_forked_child_that_outlives_the_holder_does_not_keep_the_lock(tmp_path, store):
    """Issue 52 point 7: an orphan forked by the run (without exec) had kept the directory's flock, so every
    resume was refused naming a pid long gone."""
    import signal

    ctx = mp.get_context("spawn")
    ready, orphan = ctx.Event(), ctx.Value("i", 0)
    holder = ctx.Process(target=hold_run_lock_and_fork, args=(tmp_path / "run", store, ready, orphan))
    holder.start()
    assert ready.wait(60)
    # Not holder.join(): the orphan inherited the write end of the holder's sentinel pipe, which join waits on,
    # so join would last until its timeout (30 s a test); is_alive asks waitpid.
    deadline = time.monotonic() + 30
    while holder.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not holder.is_alive()
    try:
        os.kill(orphan.value, 0)  # the orphan still lives...
        with run_lock.hold(tmp_path / "run", store, "r1", "resume"):  # ...and the lock is free
            pass
    finally:
        os.kill(orphan.value, signal.SIGKILL)


def test_a_silent_holder_elsewhere_expires_after_the_ttl_and_then_loses(tmp_path, store, monkeypatch):
    # A holder on another host (its pid cannot be checked from here) that stopped beating.
    other = run_lock.Holder(pid=1, host="elsewhere", since="2026-01-01T00:00:00+00:00", command="run", start="1")
    lease = _Lease(store, "r1", ttl_s=1.0)
    if not store.is_s3:
        os.makedirs(lease.base, exist_ok=True)
    lease.fs.pipe_file(lease._path(0, "json"), json.dumps(other.__dict__).encode())
    lease.fs.pipe_file(lease._path(0, "beat"), json.dumps({"at": time.time() + 3600}).encode())
    with pytest.raises(UserError, match="held by `sluiceway run` \\(pid 1 on elsewhere"):
        RunLock(tmp_path / "a", store, "r1", "run", ttl_s=1.0).acquire()
    lease.fs.pipe_file(lease._path(0, "beat"), json.dumps({"at": time.time() - 5}).encode())
    mine = RunLock(tmp_path / "b", store, "r1", "run", ttl_s=0.4)
    mine.acquire()
    try:
        assert mine._lease.gen == 1
        mine.ensure_held()
        # Someone takes generation 2 over while this holder "was paused": its next beat notices, and it stops.
        lease.fs.pipe_file(lease._path(2, "json"), json.dumps(other.__dict__).encode())
        for _ in range(100):
            if mine._lease.lost:
                break
            time.sleep(0.1)
        with pytest.raises(Fault, match="another process took over the run's lease"):
            mine.ensure_held()
    finally:
        mine.release()


def test_exclusive_create_lets_one_of_two_racers_win(tmp_path, store):
    me = run_lock.Holder.me("run")
    a, b = _Lease(store, "race", 60), _Lease(store, "race", 60)
    a.acquire(me)
    try:
        # b saw no generation yet and tries to create generation 0 too: the store refuses the second create.
        b._newest = lambda: None
        with pytest.raises(UserError, match="at the same moment"):
            b.acquire(me)
    finally:
        a.release()
    assert socket.gethostname() in json.loads(a._read(a._path(0, "json")))["host"]
