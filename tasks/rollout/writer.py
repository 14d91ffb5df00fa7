"""Finished groups go to the trajectory table off the event loop, several per Delta commit.

A Delta commit costs tens of milliseconds whatever its size, and written on the event loop it would stall every
request in flight. The writer hands commits to a thread; groups that finish while one commit is under way go
together in the next. A group counts as stored once its commit returns, as before: a crash loses only groups
not yet committed, and a re-run generates just those.
"""

from __future__ import annotations

import asyncio

from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import TrajectoryRow, append_trajectory_groups


class GroupWriter:
    def __init__(self, store: ObjectStore):
        self.store = store
        self._queue: list[tuple[list[TrajectoryRow], str, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None
        self.commits = 0

    async def write(self, rows: list[TrajectoryRow], app_id: str) -> bool:
        """Store one group's rows; True if new (False: a re-run found it written already)."""
        done = asyncio.get_running_loop().create_future()
        self._queue.append((rows, app_id, done))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await done

    async def _flush(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                new = await asyncio.to_thread(append_trajectory_groups, self.store, [(r, a) for r, a, _ in batch])
            except Exception as exc:  # every waiting group sees the failure
                for *_, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.commits += 1
            for (*_, fut), was_new in zip(batch, new):
                if not fut.done():
                    fut.set_result(was_new)
