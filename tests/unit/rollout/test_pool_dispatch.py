"""The dispatcher's rule for remote pools (tasks/rollout/dispatch.py): local engines always qualify; a remote pool
only while the version its agent reports is fresh enough, and not while benched; the pool with most room takes
the group. A fixed pool's version is read from its record in the pool registry (tasks/rollout/pool_directory.py)."""

from __future__ import annotations

import asyncio

from sluiceway.flows.config import RunConfig
from sluiceway.flows.rl import pool_min_version
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.weights.pool_registry import PoolRecord, PoolRegistry
from sluiceway.storage.weights.store import WeightStore
from sluiceway.tasks.rollout.dispatch import PoolDispatcher
from sluiceway.tasks.rollout.pool_directory import FixedPool, PoolDirectory
from sluiceway.tasks.rollout.pool_target import LOCAL, PoolTarget


def targets(**versions) -> list[PoolTarget]:
    out = [PoolTarget(LOCAL, client=None, capacity=8, local=True)]
    for name, v in versions.items():
        out.append(PoolTarget(name, client=None, capacity=8, version=v))
    return out


def test_dispatch_rules():
    t = targets(east=3, west=1, unknown=None)
    d = PoolDispatcher(t, min_version=2)
    assert [x.name for x in t if d.qualifies(x, 0.0)] == ["local", "east"]
    assert d.pick(4).name == "local"  # equal room: the run's own engines first
    t[0].in_flight = 6
    assert d.pick(4).name == "east"  # more room
    d.bench(t[1], "router unreachable")
    assert d.pick(4) is None  # local has 2 free of 8: a group of 4 waits
    assert d.pick(2).name == "local"
    t[0].in_flight = 0
    assert d.pick(12).name == "local"  # a group larger than a pool's capacity runs alone on it


class CountingRegistry(PoolRegistry):
    def __init__(self, wstore, reads: list) -> None:
        super().__init__(wstore)
        self.reads = reads

    def record(self, name):
        self.reads.append(1)
        return super().record(name)


def test_acquire_waits_for_room_and_reads_versions(tmp_path):
    async def scenario():
        reads = []
        registry = CountingRegistry(WeightStore(ObjectStore.from_uri(str(tmp_path / "weights"))), reads)
        registry.write(PoolRecord(pool="west", serving=5))  # what west's agent reports
        pools = PoolDirectory([], lambda url: None, 4, fixed=[FixedPool("west", "http://west.invalid:1", registry)])
        local = PoolTarget(LOCAL, client=None, capacity=4, local=True)
        d = PoolDispatcher([local], min_version=5, refresh_s=0.0, wait_s=5.0, directory=pools)
        first, second = await d.acquire(4), await d.acquire(4)
        west = pools.targets["west"]
        assert {first.name, second.name} == {"local", "west"} and west.version == 5 and reads
        third = asyncio.ensure_future(d.acquire(4))
        await asyncio.sleep(0.05)
        assert not third.done()  # no room anywhere
        await d.release(first, 4)
        assert (await asyncio.wait_for(third, 1.0)) is first  # a release wakes the waiter at once

    asyncio.run(scenario())


def test_min_version_per_mode():
    cfg = RunConfig.model_validate({"data": {"prompt_data": "env:arithmetic"}})
    assert pool_min_version(cfg, 5, engines_version=5) == 5  # sync: as current as the run's engines
    cfg.rollout.mode, cfg.rollout.max_staleness = "fully-async", 2
    assert pool_min_version(cfg, 5, engines_version=4) == 3  # trained at v5: up to 2 behind
    assert pool_min_version(cfg, 5, engines_version=1) == 1  # never stricter than the run's own engines


# -- issue 40: a pool whose replies are not what the API says is benched, never the run's end -------------------


def _generate_on(target):
    return target.client.generate([1, 2], {"max_new_tokens": 1}, rid="r")


def _scripted_client(url: str, answer):
    import httpx

    from sluiceway.tasks.rollout.client import EngineClient

    client = EngineClient(url, [], max_retries=1, retry_backoff_s=0.0)
    if answer is not None:
        client._http = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: answer))
    return client


def _benched_then_local(far_client, caplog) -> None:
    """One group: "far" takes it first (the run's own engines are busy), fails, is benched; the group runs local."""
    import logging

    caplog.set_level(logging.WARNING, "sluiceway")

    class Local:
        router_url = "http://local.invalid"

        async def generate(self, *a, **kw):
            return "local answer"

    async def scenario():
        local = PoolTarget(LOCAL, client=Local(), capacity=4, local=True)
        far = PoolTarget("far", client=far_client, capacity=4, version=5)
        local.in_flight = 4  # busy: the group goes to "far" first
        disp = PoolDispatcher([local, far], min_version=5, refresh_s=60.0, wait_s=0.01)

        async def free_local():
            await asyncio.sleep(0.05)
            await disp.release(local, 4)

        asyncio.ensure_future(free_local())
        out, where = await disp.run(4, _generate_on)
        assert (out, where.name, far.in_flight) == ("local answer", LOCAL, 0)
        assert far.benched_until > 0  # benched: no new groups for bench_s

    asyncio.run(scenario())
    failed = [r.message for r in caplog.records if "pool far failed" in r.message]
    assert len(failed) == 1, caplog.text


def test_a_pool_that_answers_200_with_html_is_benched(caplog):
    """A pool answering 200 with an HTML page ended the run with JSONDecodeError."""
    import httpx

    html = httpx.Response(200, text="<html><body>Sign in</body></html>", headers={"content-type": "text/html"})
    _benched_then_local(_scripted_client("http://far.invalid:1", html), caplog)
    assert "not JSON ('text/html" in caplog.text and "far.invalid" not in caplog.text


def test_a_pool_whose_url_does_not_parse_is_benched(caplog):
    """A fixed pool's URL 'http://[::1' (which --rollout-pools' check lets through): httpx.InvalidURL at connect
    ended the run."""
    _benched_then_local(_scripted_client("http://[::1", None), caplog)
    assert "no address a request can go to (InvalidURL)" in caplog.text


def test_a_pool_whose_answer_has_another_shape_is_benched(caplog):
    import httpx

    odd = httpx.Response(200, json={"output_ids": "abc", "meta_info": []})
    _benched_then_local(_scripted_client("http://far.invalid:1", odd), caplog)
    assert "is not a /generate answer" in caplog.text
