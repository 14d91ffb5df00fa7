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
    a, registry, _ = agent(tmp_path, heartbeat_s=30.0)  # long: a loaded machine's slow poll is not "due"
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
    status, at = a._reported
    a._reported = (status, at - 30.0)  # the heartbeat falls due (as 30 s later), without sleeping
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


def test_pools_list_prints_a_bad_timestamp_as_unknown(tmp_path, capsys):
    """Issue 40: `sluiceway pools list` failed on a record whose time no date can show (a finite number still)."""
    from sluiceway.flows.pools import list_pools
    from sluiceway.storage.weights.pool_registry import PoolRecord

    uri = str(tmp_path / "store")
    registry = PoolRegistry(WeightStore(ObjectStore.from_uri(uri)))
    registry.write(PoolRecord(pool="far", updated_unix=1e300, serving=2))  # the year 10**292
    registry.write(PoolRecord(pool="near", updated_unix=0.0))
    assert list_pools(uri) == 0
    out = capsys.readouterr().out
    assert "far" in out and "unknown" in out and "1970-01-01T00:00:00" in out


def test_an_agent_and_a_pools_file_refuse_what_runs_would_skip(tmp_path):
    """Issue 40: a pool named 'local', a NaN heartbeat or a URL that does not parse was written, and every run
    skipped (or, before, took) its record: refused where the pool starts instead."""
    import math

    import pytest

    from sluiceway.flows.pools import load_pools
    from sluiceway.infra.errors import UserError

    wstore = WeightStore(ObjectStore.from_uri(str(tmp_path / "store")))
    for bad in ({"name": "local"}, {"heartbeat_s": math.nan}, {"heartbeat_s": 1e9}, {"url": "http://[::1"},
                {"region": "eu\n"}, {"capacity": 0}):  # fmt: skip
        kw = {"name": "east", "url": "http://lb:1"} | bad
        with pytest.raises(ValueError):
            PoolAgent(kw.pop("name"), wstore, [], tmp_path / "agent", **kw)
    path = tmp_path / "pools.yaml"
    for bad in ("name: local", "name: east\n  url: 'http://[::1'", "name: east\n  heartbeat_s: .nan",
                "name: east\n  region: \"eu\\x1b[31m\""):  # fmt: skip
        path.write_text(f"pools:\n- {bad}\n  model: tiny-llama\n  weights_uri: {tmp_path / 'store'}\n")
        with pytest.raises(UserError):
            load_pools(path)
    path.write_text(f"pools:\n- name: east\n  model: tiny-llama\n  weights_uri: {tmp_path / 'store'}\n")
    assert load_pools(path).pools[0].name == "east"


def test_what_the_agent_serves_stays_readable_while_a_poll_pushes(tmp_path):
    """The heartbeat thread and `version` read the engines' versions while the polling thread pushes: a poll must
    never show them an empty map ("no engine serves anything"), as one that emptied it first did for the length of
    its HTTP calls (test_pool_rollouts read `version` None right after a run, once)."""
    a, _, _ = agent(tmp_path)
    a.poll_once()
    assert a.version == 2
    seen_while_pushing = []
    push = a._push
    a._push = lambda url, held: seen_while_pushing.append((a.version, a.status()["engines"])) or push(url, held)
    a.poll_once()
    assert seen_while_pushing == [(2, {"http://engine": 2})]
