"""The run's view of the pool registry (tasks/rollout/pool_directory.py) and what the dispatcher does with it:
a registered pool joins and qualifies once fresh, a draining or silent one takes no new groups, a silent one is
dropped after ten heartbeats, a deregistered one leaves, a record left behind long ago is ignored; liveness is
judged on the run's clock (a pool's clock may be off). Records come from a real registry on a local store."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.weights.pool_registry import PoolRecord, PoolRegistry
from sluiceway.storage.weights.store import WeightStore
from sluiceway.tasks.rollout.dispatch import PoolDispatcher
from sluiceway.tasks.rollout.pool_directory import PoolDirectory
from sluiceway.tasks.rollout.pool_target import LOCAL, PoolTarget


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Client:
    def __init__(self, url: str) -> None:
        self.router_url, self.closed = url, False

    async def aclose(self) -> None:
        self.closed = True


@pytest.fixture
def registry(tmp_path) -> PoolRegistry:
    return PoolRegistry(WeightStore(ObjectStore.from_uri(str(tmp_path / "weights"))))


def record(name: str, beat: int = 1, **kw) -> PoolRecord:
    return PoolRecord(**{"pool": name, "region": "r", "url": f"http://{name}.invalid:1", "serving": 3, "version": 3,
                         "beat": beat, "heartbeat_s": 1.0, "state": "serving", **kw})  # fmt: skip


def directory(registry, clock, wall) -> PoolDirectory:
    return PoolDirectory([registry], Client, default_capacity=8, clock=clock, wall_clock=wall)


def test_a_pool_joins_drains_and_leaves(registry, caplog):
    caplog.set_level(logging.INFO, "sluiceway")
    clock, wall = Clock(), Clock(5000.0)
    d = directory(registry, clock, wall)
    d.apply(d.read())
    assert d.targets == {}
    registry.write(record("east", capacity=4, updated_unix=wall.t))
    registry.write(record("nourl", url=None))  # takes no requests: never a target
    d.apply(d.read())
    east = d.targets["east"]
    assert list(d.targets) == ["east"] and (east.version, east.capacity) == (3, 4)
    assert east.client.router_url == "http://east.invalid:1"
    registry.write(record("east", beat=2, state="draining"))
    d.apply(d.read())
    assert east.draining and not east.silent
    east.in_flight = 4  # a group still running there when it deregisters
    registry.remove("east")
    d.apply(d.read())
    assert d.targets == {} and d.retiring == [east]
    asyncio.run(d.close_idle())
    assert not east.client.closed  # its group still runs
    east.in_flight = 0
    asyncio.run(d.close_idle())
    assert east.client.closed and d.retiring == []
    said = caplog.text
    assert "pool east (r) joined" in said and "pool east draining" in said and "pool east left" in said
    assert "invalid" not in said  # no URL in the log


def test_a_silent_pool_is_benched_then_dropped_and_rejoins_when_it_beats(registry):
    clock, wall = Clock(), Clock(5000.0)
    d = directory(registry, clock, wall)
    registry.write(record("east", beat=7))
    d.apply(d.read())
    east = d.targets["east"]
    clock.t += 2.5
    d.apply(d.read())
    assert not east.silent  # 2.5 heartbeats: not yet
    clock.t += 1.0
    d.apply(d.read())
    assert east.silent  # 3.5 heartbeats without a beat: no new groups
    clock.t += 7.0
    d.apply(d.read())
    assert "east" not in d.targets  # 10.5 heartbeats: dropped
    d.apply(d.read())
    assert "east" not in d.targets  # the same old record does not bring it back
    registry.write(record("east", beat=8))
    d.apply(d.read())
    assert "east" in d.targets and not d.targets["east"].silent


def test_liveness_is_judged_on_the_run_s_clock_and_old_records_are_ignored(registry):
    clock, wall = Clock(), Clock(5000.0)
    d = directory(registry, clock, wall)
    registry.write(record("skewed", updated_unix=wall.t + 3600))  # its clock is an hour ahead: still fine
    registry.write(record("ghost", updated_unix=wall.t - 60))  # 60 heartbeats ago: died without deregistering
    d.apply(d.read())
    assert list(d.targets) == ["skewed"]
    for beat in range(2, 30):  # it keeps beating: never silent, whatever its clock says
        clock.t += 1.0
        registry.write(record("skewed", beat=beat, updated_unix=wall.t + 3600))
        d.apply(d.read())
        assert not d.targets["skewed"].silent


def test_a_pool_that_moved_is_reached_at_its_new_address(registry):
    d = directory(registry, Clock(), Clock(5000.0))
    registry.write(record("east"))
    d.apply(d.read())
    old = d.targets["east"]
    registry.write(record("east", beat=2, url="http://east-2.invalid:1"))
    d.apply(d.read())
    assert d.targets["east"].client.router_url == "http://east-2.invalid:1" and d.retiring == [old]


def test_the_dispatcher_reads_the_registry_and_says_once_a_minute_what_it_waits_for(registry, caplog):
    async def scenario():
        d = directory(registry, Clock(), Clock(5000.0))
        registry.write(record("east", serving=1))  # too old for the step
        disp = PoolDispatcher([], min_version=3, refresh_s=0.0, wait_s=0.01, directory=d, wait_log_s=0.05)
        waiter = asyncio.ensure_future(disp.acquire(4))
        await asyncio.sleep(0.3)
        assert not waiter.done()
        registry.write(record("east", beat=2, serving=3))  # caught up: it takes the group
        target = await asyncio.wait_for(waiter, 2.0)
        assert target.name == "east" and target.in_flight == 4
        await d.aclose()

    caplog.set_level(logging.INFO, "sluiceway")
    asyncio.run(scenario())
    waits = [r.message for r in caplog.records if "waiting" in r.message]
    assert waits and "v3 or newer" in waits[0] and "east serves v1" in waits[0]
    assert len(waits) < 10  # at most one per wait_log_s, not one per poll


def test_a_refused_group_goes_to_another_pool():
    from sluiceway.tasks.rollout.client import WeightVersionRefused

    class Refusing:
        router_url = "http://far.invalid"

    async def scenario():
        local = PoolTarget(LOCAL, client=None, capacity=4, local=True)
        far = PoolTarget("far", client=Refusing(), capacity=4, version=5)
        local.in_flight = 4  # busy: the group goes to "far" first
        disp = PoolDispatcher([local, far], min_version=5, refresh_s=60.0, wait_s=0.01)

        async def generate(target):
            if target is far:
                raise WeightVersionRefused("refused", serving=4, min_version=5, max_version=None)
            return "ok"

        async def free_local():
            await asyncio.sleep(0.05)
            await disp.release(local, 4)

        asyncio.ensure_future(free_local())
        out, where = await disp.run(4, generate)
        assert (out, where.name) == ("ok", LOCAL) and far.version == 4 and far.in_flight == 0

    asyncio.run(scenario())


def test_a_group_on_a_pool_that_falls_silent_is_generated_elsewhere():
    class Hanging:
        router_url = "http://far.invalid"

    async def scenario():
        local = PoolTarget(LOCAL, client=None, capacity=4, local=True)
        far = PoolTarget("far", client=Hanging(), capacity=4, version=5)
        local.in_flight = 4  # busy at first: the group goes to "far", whose link then goes dark
        disp = PoolDispatcher([local, far], min_version=5, refresh_s=60.0, wait_s=0.01)
        calls = []

        async def generate(target):
            calls.append(target.name)
            if target is far:
                await asyncio.sleep(3600)  # a partitioned pool: no answer, no error
            return "ok"

        async def partition():
            await asyncio.sleep(0.1)
            far.silent = True  # what the directory sets once its heartbeat stops
            await disp.release(local, 4)

        asyncio.ensure_future(partition())
        out, where = await asyncio.wait_for(disp.run(4, generate), 10.0)
        assert (out, where.name, calls) == ("ok", LOCAL, ["far", LOCAL]) and far.in_flight == 0

    asyncio.run(scenario())


def test_a_pool_that_falls_silent_is_seen_while_no_group_waits(registry):
    # The only group runs on "far" and none waits for a pool: the group's own watch reads the registry.
    async def scenario():
        clock = Clock()
        d = directory(registry, clock, Clock(5000.0))
        registry.write(record("far", serving=5))
        local = PoolTarget(LOCAL, client=None, capacity=4, local=True)
        local.in_flight = 4  # busy at first: the group goes to "far"
        disp = PoolDispatcher([local], min_version=5, refresh_s=0.0, wait_s=0.01, directory=d)
        calls = []

        async def generate(target):
            calls.append(target.name)
            if target.name == "far":
                await asyncio.sleep(3600)  # partitioned: no answer, no error
            return "ok"

        async def partition():
            await asyncio.sleep(0.1)
            clock.t += 3.5  # far's beat has not moved for 3.5 of its heartbeats
            await disp.release(local, 4)

        asyncio.ensure_future(partition())
        out, where = await asyncio.wait_for(disp.run(4, generate), 10.0)
        assert (out, where.name, calls) == ("ok", LOCAL, ["far", LOCAL]) and d.targets["far"].silent
        await d.aclose()

    asyncio.run(scenario())


class StuckRegistry(PoolRegistry):
    """A registry whose listing does not return until ``go`` is set (a store that stops answering mid-read)."""

    def __init__(self, wstore) -> None:
        super().__init__(wstore)
        self.go, self.reads = threading.Event(), 0

    def records(self):
        self.reads += 1
        self.go.wait()
        return super().records()


def test_a_registry_read_that_hangs_leaves_the_pools_as_last_read(tmp_path, caplog):
    """Issue 40: a read of the registry that never returns (the FIFO of point 3 was one) hung the run with no log
    line. The rollout goes on with the pools as last read, one warning; no second read starts beside the first."""
    registry = StuckRegistry(WeightStore(ObjectStore.from_uri(str(tmp_path / "weights"))))
    registry.write(record("east", serving=5))

    async def scenario():
        d = directory(registry, Clock(), Clock(5000.0))
        local = PoolTarget(LOCAL, client=None, capacity=4, local=True)
        disp = PoolDispatcher([local], min_version=5, refresh_s=0.0, wait_s=0.01, directory=d, read_timeout_s=0.05)
        for _ in range(3):  # the read hangs: each group still gets the run's own engines
            target = await disp.acquire(4)
            assert target is local
            await disp.release(local, 4)
        assert registry.reads == 1 and "east" not in d.targets
        registry.go.set()  # the store answers again: the read returns, and the next refresh applies it
        for _ in range(200):
            await disp._refresh()
            if "east" in d.targets:
                break
            await asyncio.sleep(0.01)
        assert d.targets["east"].version == 5  # what the read that hung found, once it returned
        await d.aclose()

    caplog.set_level(logging.INFO, "sluiceway")
    asyncio.run(scenario())
    assert caplog.text.count("a read has not returned") == 1 and "the slow read returned" in caplog.text


def test_an_unreadable_registry_is_one_line_until_it_reads_again(registry, caplog):
    class Down(PoolRegistry):
        down = True

        def records(self):
            if self.down:
                raise OSError("the store does not answer")
            return super().records()

    down = Down(registry.wstore)
    registry.write(record("east"))
    d = PoolDirectory([down], Client, default_capacity=8, clock=Clock(), wall_clock=Clock(5000.0))
    caplog.set_level(logging.INFO, "sluiceway")
    for _ in range(3):
        assert d.read().registered is None  # the pools stay as last read
    down.down = False
    assert list(d.read().registered) == ["east"]
    assert caplog.text.count("could not read it") == 1 and caplog.text.count("read again") == 1
