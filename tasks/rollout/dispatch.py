"""Which pool of engines generates a group: the run's own engines, or remote pools that pull weights on their own.

A remote pool (engines behind a router in another place, kept current by a pool agent: infra/pool_agent.py)
serves whatever weight version its agent has loaded so far. A group goes to a pool only if that version is fresh
enough for the step (``min_version``): in the synchronous modes as fresh as the run's own engines, in fully-async
mode at most ``max_staleness`` versions behind the version that will train on it. Among the pools that qualify,
the one with the most free capacity takes the group, so a fast pool takes more groups and a lagging pool takes
none: the run never waits for a slow pool while its own engines can do the work.

The run's own engines ("local") always qualify: the flow updates them itself, before the step's rollout. A run
may have none (`--rollout-num-engines 0` with pools): then nothing is hedged, and while no pool qualifies the
dispatcher waits, saying once a minute what it waits for. The remote pools are those of the run's directory
(tasks/rollout/pool_directory.py): fixed ones, and the pool registry's, which join and leave while the rollout
runs. Every refresh reads the directory again (what each pool serves, who registered); a draining or silent pool
takes no new groups.
A remote pool that fails a request (its router unreachable, every engine gone) is benched for ``bench_s`` and
its group goes to another pool. A remote pool that is merely slow is hedged: once no group waits for a pool, a
remote group running twice as long as the median group is also started on the run's own engines, and the first
copy to finish is kept (same rids and seeds: at the same version, the same samples).

The rollout (tasks/rollout/rollout.py) hands each group to :meth:`PoolDispatcher.run`, with a function that
generates the group on a given pool; where it runs, and how often, is decided here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from sluiceway.tasks.rollout.client import EngineCallError, WeightVersionRefused
from sluiceway.tasks.rollout.pool_directory import PoolDirectory
from sluiceway.tasks.rollout.pool_target import PoolTarget

log = logging.getLogger("sluiceway")

T = TypeVar("T")


@dataclass(frozen=True)
class HedgePolicy:
    """When a remote group also starts on the run's own engines: after ``factor`` x the median finished group's
    time, and never before ``min_s``; a remote group is looked at every ``poll_s`` until a group has finished."""

    factor: float = 2.0
    min_s: float = 1.0
    poll_s: float = 0.2


class PoolDispatcher:
    """Leases capacity on the qualifying pool with the most room; waits while none has room."""

    def __init__(
        self,
        targets: list[PoolTarget],
        min_version: int | None = None,
        refresh_s: float = 1.0,
        bench_s: float = 30.0,
        wait_s: float = 0.5,
        hedge: HedgePolicy | None = None,
        directory: PoolDirectory | None = None,
        wait_log_s: float = 60.0,
        read_timeout_s: float = 10.0,
    ) -> None:
        if not targets and directory is None:
            raise ValueError("no pool to generate with")
        # The run's own engines (pool_target.own_engines), or any target that is neither read nor joins or leaves
        # (tests give remote ones a set version); the remote pools are the directory's, fixed ones and registered.
        self.static, self.directory = targets, directory
        self.targets = self._all_targets()
        self.min_version = min_version
        self.refresh_s, self.bench_s, self.wait_s = refresh_s, bench_s, wait_s
        self.hedge = hedge or HedgePolicy()
        self._changed = asyncio.Condition()
        self._skipped: set[str] = set()  # pools already logged as too stale this rollout
        self.waiting = 0  # groups handed to run() that hold no pool yet: while one waits, no room is idle
        self.group_seconds: list[float] = []  # how long finished groups took, this rollout
        self.wait_log_s = wait_log_s
        self._wait_logged: float | None = None  # when the last "waiting for a pool" line went out
        self._directory_read_at = -1e9
        self.read_timeout_s = read_timeout_s  # a directory read that takes longer leaves the pools as last read

    def _all_targets(self) -> list[PoolTarget]:
        return [*self.static, *(self.directory.targets.values() if self.directory is not None else ())]

    def qualifies(self, t: PoolTarget, now: float) -> bool:
        if t.local:
            return True
        if now < t.benched_until or t.draining or t.silent:
            return False
        if self.min_version is None:
            return t.version is not None
        return t.version is not None and t.version >= self.min_version

    @property
    def local(self) -> PoolTarget | None:
        """The run's own engines (None: the run has none)."""
        return next((t for t in self.static if t.local), None)

    async def _refresh(self) -> None:
        """Read the directory again if ``refresh_s`` has passed (in a thread: the store may be a WAN away; one that
        does not answer within ``read_timeout_s`` leaves the pools as last read, and the rollout goes on)."""
        now = time.monotonic()
        if self.directory is None or now - self._directory_read_at < self.refresh_s:
            return
        self._directory_read_at = now
        reading = await self.directory.read_within(self.read_timeout_s)
        if reading is not None:
            self.directory.apply(reading)
        await self.directory.close_idle()
        self.targets = self._all_targets()
        for t in self.targets:
            if self._too_old(t, now) and t.name not in self._skipped:
                self._skipped.add(t.name)
                log.info("pool %s serves v%s, older than v%s this step needs: skipped", t.name, t.version,
                         self.min_version)  # fmt: skip

    def _too_old(self, t: PoolTarget, now: float) -> bool:
        """Whether the version ``t`` serves alone keeps it from taking a group."""
        if t.local or now < t.benched_until or t.draining or t.silent:
            return False
        return not self.qualifies(t, now)

    def pick(self, n: int) -> PoolTarget | None:
        """The qualifying pool with the most free capacity that fits ``n`` samples (a group), if any."""
        now = time.monotonic()
        free = [
            (t.capacity - t.in_flight, -i, t)
            for i, t in enumerate(self.targets)
            if self.qualifies(t, now) and t.capacity - t.in_flight >= min(n, t.capacity)
        ]
        return max(free, key=lambda x: x[:2])[2] if free else None

    async def acquire(self, n: int) -> PoolTarget:
        waiting_since = time.monotonic()
        while True:
            await self._refresh()
            async with self._changed:
                target = self.pick(n)
                if target is not None:
                    target.in_flight += n
                    return target
                self._say_waiting(waiting_since)
                try:  # woken by a release, or re-checked after wait_s for pools that caught up
                    await asyncio.wait_for(self._changed.wait(), self.wait_s)
                except TimeoutError:
                    pass

    def _say_waiting(self, since: float) -> None:
        """Once a minute while no pool qualifies at all (busy pools do not count: that is only a full queue)."""
        now = time.monotonic()
        if any(self.qualifies(t, now) for t in self.targets) or now - since < self.wait_log_s:
            return
        if self._wait_logged is not None and now - self._wait_logged < self.wait_log_s:
            return
        self._wait_logged = now
        log.warning("rollout: waiting %.0f s for a pool serving v%s or newer; %s", now - since, self.min_version,
                    "; ".join(self.why_not(t, now) for t in self.targets) or "no pool is registered")  # fmt: skip

    def why_not(self, t: PoolTarget, now: float) -> str:
        """Why pool ``t`` takes no group now, in a few words."""
        if t.draining:
            return f"{t.name} draining"
        if t.silent:
            return f"{t.name} silent (no heartbeat)"
        if now < t.benched_until:
            return f"{t.name} benched after a failure"
        return f"{t.name} serves v{t.version}"

    def try_acquire_local(self, n: int) -> PoolTarget | None:
        """Room for ``n`` samples on the run's own engines now, or None (never waits)."""
        for t in self.targets:
            if t.local and t.capacity - t.in_flight >= min(n, t.capacity):
                t.in_flight += n
                return t
        return None

    async def release(self, target: PoolTarget, n: int) -> None:
        async with self._changed:
            target.in_flight -= n
            self._changed.notify_all()

    def bench(self, target: PoolTarget, reason: str) -> None:
        target.benched_until = time.monotonic() + self.bench_s
        url = getattr(target.client, "router_url", None)
        if url:  # a URL may carry credentials: the pool's name stands for it
            reason = reason.replace(url, f"pool {target.name}")
        log.warning("pool %s failed (%s); no new groups for %.0f s", target.name, reason, self.bench_s)

    # --- running a group --------------------------------------------------------------------------------------

    async def run(
        self,
        n: int,
        generate: Callable[[PoolTarget], Awaitable[T]],
        done: asyncio.Event | None = None,
        name: str = "group",
    ) -> tuple[T, PoolTarget]:
        """``generate(target)`` for one group of ``n`` samples on the pool that takes it; its result and the pool.

        A remote pool that raises EngineCallError is benched and the group goes to another pool (the run's own
        engines' errors are raised); a slow remote pool is hedged on the run's own engines unless ``done``
        (the step has enough groups) is set.
        """
        self.waiting += 1
        while True:
            target = await self.acquire(n)
            self.waiting -= 1
            t0 = time.monotonic()
            try:
                if target.local:
                    out = await self._leased(target, n, generate), target
                else:
                    out = await self._hedged(target, n, generate, done, name)
            except WeightVersionRefused as exc:  # the pool's engines serve another version than it reported
                if target.local:
                    raise
                target.version = exc.serving
                target.benched_until = time.monotonic() + self.refresh_s  # until the registry is read again
                log.info("%s: pool %s serves v%s, the step needs v%s or newer: the group goes elsewhere",
                         name, target.name, exc.serving, exc.min_version)  # fmt: skip
                self.waiting += 1
                continue
            except EngineCallError as exc:
                if target.local:
                    raise
                self.bench(target, str(exc))  # the group goes to another pool
                self.waiting += 1
                continue
            self.group_seconds.append(time.monotonic() - t0)
            return out

    async def _leased(self, target: PoolTarget, n: int, generate: Callable[[PoolTarget], Awaitable[T]]) -> T:
        try:
            return await generate(target)
        finally:
            await self.release(target, n)

    def hedge_after(self) -> float | None:
        """A remote group running longer than this is also started on the run's own engines (None: not yet)."""
        if not self.group_seconds:
            return None
        median = sorted(self.group_seconds)[len(self.group_seconds) // 2]
        return max(self.hedge.min_s, self.hedge.factor * median)

    async def _hedged(
        self,
        target: PoolTarget,
        n: int,
        generate: Callable[[PoolTarget], Awaitable[T]],
        done: asyncio.Event | None,
        name: str,
    ) -> tuple[T, PoolTarget]:
        """The group on a remote pool; if that pool is slow while the run's own engines are idle, on both, and
        the first to finish wins."""
        t0 = time.monotonic()
        remote = asyncio.ensure_future(self._leased(target, n, generate))
        while True:
            limit = self.hedge_after()
            poll = self.hedge.poll_s
            wait_s = poll if limit is None else max(poll / 4, t0 + limit - time.monotonic())
            await asyncio.wait({remote}, timeout=min(wait_s, 1.0))  # at least once a second: is the pool alive?
            if remote.done():
                return remote.result(), target
            # Read the pools again here too (at most every refresh_s, as acquire does): when no group waits for a
            # pool, nothing else would see this one fall silent or leave.
            await self._refresh()
            if target.silent or target.gone:  # a partitioned pool's requests would wait for the read timeout
                remote.cancel()
                await asyncio.gather(remote, return_exceptions=True)
                raise EngineCallError(f"pool {target.name} {'left' if target.gone else 'fell silent'} with the group")
            finished = done is not None and done.is_set()
            if limit is None or time.monotonic() - t0 < limit or self.waiting or finished:
                continue
            if (local := self.try_acquire_local(n)) is not None:
                break
        log.info("%s: pool %s slow (%.1f s); generating it on the run's own engines too",
                 name, target.name, time.monotonic() - t0)  # fmt: skip
        hedge = asyncio.ensure_future(self._leased(local, n, generate))
        try:
            first, _ = await asyncio.wait({remote, hedge}, return_when=asyncio.FIRST_COMPLETED)
            if remote in first and remote.exception() is None:
                return remote.result(), target
            return await hedge, local  # the remote copy failed, or the local one finished first
        finally:
            for t in (remote, hedge):
                t.cancel()
            await asyncio.gather(remote, hedge, return_exceptions=True)
