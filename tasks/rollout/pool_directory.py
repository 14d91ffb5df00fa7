"""The remote pools a run may send groups to, as dispatch targets: fixed ones and those of the pool registry.

A run's pools come from two sources, and the dispatcher (dispatch.py) reads both at every refresh, during each
step's rollout:

- *fixed* pools (`--rollout-pools NAME=URL`) are listed for the whole run, at the address the run was given; the
  version each serves is read from its record in the pool registry (storage/weights/pool_registry.py), which its
  agent writes; while it has none, the version is unknown and the pool gets no group;
- *registered* pools (`--rollout-pools auto`, or a registry URI) come and go with their records:
  - a pool that registers *joins*: it gets groups as soon as the version it serves is fresh enough for the step;
  - a *draining* pool keeps the groups it has and gets no new ones; once drained it deregisters and *leaves*;
  - a pool whose heartbeat (its record's ``beat``) has not moved for ``silent_beats`` of its heartbeat periods
    (``heartbeat_s``) on the run's clock is *silent*: no new groups (benched) until it beats again; after
    ``drop_beats`` periods it is *dropped*;
  - a record last written longer than ``drop_beats`` periods ago (the writer's clock) is a pool that died without
    deregistering: ignored from the start.

What a pool serves is `PoolRecord.serves` for both. Pools are named in log lines, never by URL (a URL may carry
credentials), and the rows they make record the pool's name. The targets outlive a step's rollout: a pool's
version and liveness carry over to the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sluiceway.storage.weights.pool_registry import DRAINING, PoolRecord, PoolRegistry
from sluiceway.tasks.rollout.pool_target import PoolTarget, RolloutClient

log = logging.getLogger("sluiceway")


@dataclass(frozen=True)
class FixedPool:
    """A `--rollout-pools NAME=URL` pool."""

    name: str
    url: str  # the router the run sends its requests to: the run's flag, never the record's
    registry: PoolRegistry  # where its agent reports what it serves


@dataclass
class Reading:
    """One read of every source (:meth:`PoolDirectory.read`)."""

    registered: dict[str, PoolRecord] | None  # every registry's records; None: unreadable now (kept as last read)
    fixed: dict[str, PoolRecord | None]  # each fixed pool's record (None: none yet); a pool not read now is absent


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
        fixed: list[FixedPool] = (),
        silent_beats: float = 3.0,
        drop_beats: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.registries = registries
        self.fixed = list(fixed)
        self.make_client = make_client  # called on the loop that generates (an async client belongs to it)
        self.default_capacity = default_capacity  # a fixed pool's, and a registered one's without a capacity
        self.silent_beats, self.drop_beats = silent_beats, drop_beats
        self.clock, self.wall_clock = clock, wall_clock
        self._fixed: dict[str, PoolTarget] = {}  # made at the first apply, on the generating loop
        self._joined: dict[str, PoolTarget] = {}  # registered pools now listed
        self.retiring: list[PoolTarget] = []  # left or dropped: their clients close once no group runs there
        self._seen: dict[str, _Seen] = {}
        self._ignored: set[str] = set()  # left-over records, logged once
        self._dropped: dict[str, int] = {}  # silent pools dropped, at the beat they fell silent on
        self._unread: dict[str, str] = {}  # sources that could not be read, and the kind of error (warned once)
        self._reading: concurrent.futures.Future[Reading] | None = None  # a read on its thread (read_within)
        self._reading_since = 0.0
        self._slow_said = False

    @property
    def targets(self) -> dict[str, PoolTarget]:
        """Every pool listed now, fixed ones first."""
        return self._fixed | self._joined

    def read(self) -> Reading:
        """Every source's records (blocking: the dispatcher calls it through :meth:`read_within`). A store that
        cannot be read now leaves its pools as last read, with one warning until it can be read again (never an
        exception: the registry is what pools say, and no pool may end the run). A name registered in two
        registries is one pool: the first registry's record wins."""
        fixed: dict[str, PoolRecord | None] = {}
        for pool in self.fixed:
            try:
                fixed[pool.name] = pool.registry.record(pool.name)
            except Exception as exc:  # noqa: BLE001 - whatever the store raised, the run goes on without the news
                self._unreadable(f"pool {pool.name}", exc, f"pool {pool.name}: could not read what it serves")
            else:
                self._readable(f"pool {pool.name}", f"pool {pool.name}: what it serves is read again")
        registered: dict[str, PoolRecord] | None = {}
        for registry in self.registries:
            try:
                found = registry.records()
            except Exception as exc:  # noqa: BLE001 - the store is unreachable for now
                self._unreadable(registry.wstore.uri, exc, f"pool registry {registry.wstore.uri}: could not read "
                                 "it; its pools stay as last read")  # fmt: skip
                registered = None
                continue
            self._readable(registry.wstore.uri, f"pool registry {registry.wstore.uri}: read again")
            if registered is not None:
                for name, record in found.items():
                    registered.setdefault(name, record)
        return Reading(registered, fixed)

    def _unreadable(self, source: str, exc: BaseException, what: str) -> None:
        """One warning per source and kind of error, not one per refresh while the store stays down."""
        kind = type(exc).__name__
        if self._unread.get(source) != kind:
            self._unread[source] = kind
            log.warning("%s (%s: %s)", what, kind, exc)

    def _readable(self, source: str, what: str) -> None:
        if self._unread.pop(source, None) is not None:
            log.info("%s", what)

    async def read_within(self, timeout_s: float) -> Reading | None:
        """:meth:`read` on a thread of its own, waited for until it is ``timeout_s`` old: None while it runs on
        (the pools stay as last read; a later call takes its result, and starts no second read beside it). The
        thread is a daemon: a read that never returns (a store that stops answering mid-read) holds neither the
        rollout nor the run's exit."""
        if self._reading is None:
            future: concurrent.futures.Future[Reading] = concurrent.futures.Future()

            def work() -> None:
                future.set_running_or_notify_cancel()
                try:
                    future.set_result(self.read())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)

            self._reading, self._reading_since = future, time.monotonic()
            threading.Thread(target=work, name="pool-directory-read", daemon=True).start()
        future = self._reading
        left = self._reading_since + timeout_s - time.monotonic()
        if left > 0 and not future.done():
            await asyncio.wait({asyncio.wrap_future(future)}, timeout=left)
        if not future.done():
            if not self._slow_said:
                self._slow_said = True
                log.warning("pool registry: a read has not returned in %g s; the pools stay as last read until "
                            "it does", timeout_s)  # fmt: skip
            return None
        self._reading = None
        if self._slow_said:
            self._slow_said = False
            log.info("pool registry: the slow read returned")
        return future.result()

    def apply(self, reading: Reading) -> None:
        """Update the targets from ``reading``."""
        for pool in self.fixed:
            t = self._fixed.get(pool.name)
            if t is None:
                t = self._fixed[pool.name] = PoolTarget(pool.name, self.make_client(pool.url), self.default_capacity)
            if pool.name in reading.fixed:
                record = reading.fixed[pool.name]
                t.version = record.serves if record is not None else None
        if reading.registered is None:
            return
        records = {n: r for n, r in reading.registered.items() if n not in self._fixed}  # a fixed pool's own record
        now = self.clock()
        for name in list(self._joined):
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
            t = self._joined.pop(name)
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
        self._fixed, self._joined, self.retiring = {}, {}, []

    def _update(self, name: str, r: PoolRecord, now: float) -> None:
        t = self._joined.get(name)
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
            self._joined[name] = t
            self._seen[name] = _Seen(r.beat, now, r.url)
            log.info("pool %s (%s) joined: serves v%s, takes %d samples at once", name, r.region or "no region",
                     r.serves, capacity)  # fmt: skip
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
        t.version = r.serves
        t.capacity = r.capacity or self.default_capacity
