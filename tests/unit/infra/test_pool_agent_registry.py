"""A pool agent in the pool registry (infra/pool_agent.py, storage/weights/pool_registry.py): it registers at its
first poll with the URL and capacity runs should use, beats at least every heartbeat, drains when asked (a drain
request in the registry, or drain() from a signal handler) without loading new versions, and deregisters only once
its engines have been idle for drain_quiet_s, or when drain_timeout_s runs out."""

from __future__ import annotations

import time

from weight_helpers import publish_run

from sluiceway.infra.pool_agent import PoolAgent
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.weights.pool_registry import PoolRegistry
from sluiceway.storage.weights.store import WeightStore


class Scripted(PoolAgent):
    """One engine whose version and load the test sets (no HTTP)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.serves: int | None = None
        self.load = 0
        self.pushed: list[int] = []

    def _push(self, url, held):
        if held is not None and held != self.serves:
            self.pushed.append(held)
            self.serves = held
        return self.serves

    def _engine_load(self, url):
        return self.load


def agent(tmp_path, **kw) -> tuple[Scripted, PoolRegistry, WeightStore]:
    wstore = WeightStore(ObjectStore.from_uri(str(tmp_path / "store")))
    publish_run(wstore, tmp_path, 2, full_every=1)
    a = Scripted("east", wstore, ["http://engine"], tmp_path / "agent", region="eu", url="http://lb:30000",
                 capacity=16, **kw)  # fmt: skip
    return a, PoolRegistry(wstore), wstore


def test_it_registers_before_it_downloads_then_beats(tmp_path):
    a, registry, _ = agent(tmp_path, heartbeat_s=0.05)
    registry.request_drain("east")  # left by an earlier pool of this name: not for this one
    seen_while_fetching = []
    fetch = a._fetch
    a._fetch = lambda version, held: seen_while_fetching.append(registry.records().get("east")) or fetch(version, held)
    a.poll_once()
    (early,) = seen_while_fetching  # registered already, serving what the engine had (nothing yet)
    assert early is not None and early.serving is None and early.beat == 1
    r = registry.records()["east"]
    assert (r.url, r.capacity, r.region, r.state, r.serving, r.beat) == ("http://lb:30000", 16, "eu", "serving", 2, 2)
    assert not registry.drain_requested("east") and a.state == "serving"
    a.poll_once()
    assert registry.records()["east"].beat == 2  # nothing changed, heartbeat not due: no write
    time.sleep(0.06)
    a.poll_once()
    assert registry.records()["east"].beat == 3


def test_a_drain_request_waits_for_idle_engines_then_deregisters(tmp_path):
    a, registry, wstore = agent(tmp_path, drain_quiet_s=0.1)
    a.poll_once()
    registry.request_drain("east")
    a.load = 2  # a group still running
    publish_run(wstore, tmp_path / "more", 3, full_every=1)  # a newer version: a draining pool does not load it
    a.poll_once()
    assert a.state == "draining" and registry.records()["east"].state == "draining"
    time.sleep(0.15)
    a.poll_once()
    assert "east" in registry.records() and not a.left.is_set()  # busy: it stays
    a.load = 0
    a.poll_once()
    assert "east" in registry.records()  # idle, but not yet for drain_quiet_s
    time.sleep(0.15)
    a.poll_once()
    assert a.left.is_set() and registry.records() == {} and not registry.drain_requested("east")
    assert a.pushed == [2] and a.state == "left"


def test_drain_from_a_signal_and_the_timeout(tmp_path):
    a, registry, _ = agent(tmp_path, drain_quiet_s=60.0, drain_timeout_s=0.1)
    a.poll_once()
    a.load = 1  # never idle
    a.drain()
    a.poll_once()
    assert a.state == "draining" and not a.left.is_set()
    time.sleep(0.15)
    a.poll_once()
    assert a.left.is_set() and "east" not in registry.records()  # deregistered anyway


def test_pools_list_and_drain_commands(tmp_path, capsys):
    import pytest

    from sluiceway.flows.pools import drain_pool, list_pools
    from sluiceway.infra.errors import UserError

    a, registry, wstore = agent(tmp_path)
    uri = str(tmp_path / "store")
    list_pools(uri)
    assert "no pool is registered" in capsys.readouterr().out
    a.poll_once()
    list_pools(uri)
    out = capsys.readouterr().out
    assert "east" in out and "serving" in out and "v2" in out and "lb:30000" not in out  # no URL
    with pytest.raises(UserError, match="no pool named 'west' is registered"):
        drain_pool("west", uri)
    drain_pool("east", uri)
    assert registry.drain_requested("east")
