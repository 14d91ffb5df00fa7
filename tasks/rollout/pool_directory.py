"""The remote pools a run finds in the pool registry (storage/weights/pool_registry.py), as dispatch targets.

`--rollout-pools auto` (or a registry URI) gives the run a `PoolDirectory`; the dispatcher (dispatch.py) reads
it at every refresh, during each step's rollout, and offers groups to the pools it lists:

- a pool that registers *joins*: it gets groups as soon as the version it serves is fresh enough for the step;
- a *draining* pool keeps the groups it has and gets no new ones; once drained it deregisters and *leaves*;
- a pool whose heartbeat (its record's ``beat``) has not moved for ``silent_beats`` of its heartbeat periods
  (``heartbeat_s``) on the run's clock is *silent*: no new groups (benched) until it beats again; after
  ``drop_beats`` periods it is *dropped*;
- a record last written longer than ``drop_beats`` periods ago (the writer's clock) is a pool that died without
  deregistering: ignored from the start.

Pools are named in log lines, never by URL (a URL may carry credentials), and the rows they make record the
pool's name. The targets outlive a step's rollout: a pool's version and liveness carry over to the next step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from sluiceway.storage.weights.pool_registry import DRAINING, PoolRecord, PoolRegistry
from sluiceway.tasks.rollout.dispatch import PoolTarget, RolloutClient

log = logging.getLogger("sluiceway")


@dataclass
class _Seen:
    beat: int
    since: float  # run clock (monotonic) when ``beat`` was first seen
    url: str | None


class PoolDirectory:
    def __init__(
        self,
        registries: list[PoolRegistry],
        make_client: Callable[[str], RolloutClient],
        default_capacity: int,
        *,
        silent_beats: float = 3.0,
        drop_beats: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.registries = registries
        self.make_client = make_client  # called on the loop that generates (an async client belongs to it)
        self.default_capacity = default_capacity
        self.silent_beats, self.drop_beats = silent_beats, drop_beats
        self.clock, self.wall_clock = clock, wall_clock
        self.targets: dict[str, PoolTarget] = {}
        self.retiring: list[PoolTarget] = []  # left or dropped: their clients close once no group runs there
        self._seen: dict[str, _Seen] = {}
        self._ignored: set[str] = set()  # left-over records, logged once
        self._dropped: dict[str, int] = {}  # silent pools dropped, at the beat they fell silent on

    def read(self) -> dict[str, PoolRecord]:
        """Every registry's records (blocking: the dispatcher calls it in a thread). A name registered in two
        registries is one pool: the first registry's record wins."""
        out: dict[str, PoolRecord] = {}
        for registry in self.registries:
            for name, record in registry.records().items():
                out.setdefault(name, record)
        return out

    def apply(self, records: dict[str, PoolRecord]) -> None:
        """Update the targets from ``records``."""
        now = self.clock()
        for name in list(self.targets):
            seen, r = self._seen[name], records.get(name)
            if r is None:
                log.info("pool %s left (deregistered)", name)
            elif now - seen.since > self.drop_beats * r.heartbeat_s:
                log.warning("pool %s dropped: no heartbeat for %.0f s", name, now - seen.since)
                self._dropped[name] = r.beat  # not to rejoin on this same record; a new beat brings it back
            elif r.url != seen.url:
                log.info("pool %s moved to a new address: its groups follow", name)  # a new pod, say
            else:
                continue
            t = self.targets.pop(name)
            t.gone = True  # a group still running there is generated elsewhere (dispatch.py)
            self.retiring.append(t)
            del self._seen[name]
        for name, r in records.items():
            self._update(name, r, now)

    async def close_idle(self) -> None:
        """Close the clients of pools that left, once no group runs there."""
        idle = [t for t in self.retiring if t.in_flight == 0]
        self.retiring = [t for t in self.retiring if t.in_flight]
        for t in idle:
            await t.client.aclose()

    async def aclose(self) -> None:
        for t in [*self.targets.values(), *self.retiring]:
            await t.client.aclose()
        self.targets, self.retiring = {}, []

    def _update(self, name: str, r: PoolRecord, now: float) -> None:
        t = self.targets.get(name)
        if t is None:
            if r.url is None or r.state == DRAINING or self._dropped.get(name) == r.beat:
                return  # nothing to send it, on its way out, or dropped and silent since
            age = None if r.updated_unix is None else self.wall_clock() - r.updated_unix
            if age is not None and age > self.drop_beats * r.heartbeat_s:
                if name not in self._ignored:
                    self._ignored.add(name)
                    log.info("pool %s: its record is %.0f s old (a pool that did not deregister): ignored", name, age)
                return
            self._ignored.discard(name)
            capacity = r.capacity or self.default_capacity
            t = PoolTarget(name, self.make_client(r.url), capacity)
            self.targets[name] = t
            self._seen[name] = _Seen(r.beat, now, r.url)
            log.info("pool %s (%s) joined: serves v%s, takes %d samples at once", name, r.region or "no region",
                     r.serving, capacity)  # fmt: skip
        seen = self._seen[name]
        if r.beat != seen.beat:
            seen.beat, seen.since = r.beat, now
        silent = now - seen.since > self.silent_beats * r.heartbeat_s
        if silent != t.silent:
            if silent:
                log.warning("pool %s: no heartbeat for %.0f s: no new groups until it beats again",
                            name, now - seen.since)  # fmt: skip
            else:
                log.info("pool %s: heartbeat again", name)
        if r.state == DRAINING and not t.draining:
            log.info("pool %s draining: it finishes its groups and gets no new ones", name)
        t.silent, t.draining = silent, r.state == DRAINING
        t.version = r.serving if r.serving is not None else r.version
        t.capacity = r.capacity or self.default_capacity
