"""verifiers episodes in a worker process of their own (issue 52 points 5 and 6).

An environment's code (its taskset, rubric, harness glue) is code nobody here wrote. Run on the run's own event
loop, a reward that called `os._exit` ended the run and one that blocked (`time.sleep` in an async reward) hung
every session. Here it runs in one spawned process per verifiers source (infra/call_worker.py: the process, the
pipe, the beats), on that process's own loop. A call is one episode: (task idx, endpoint URL, gateway key) in, the
episode's plain summary (verifiers_episodes.py `episode_summary`) out; before the trace's first model call the
worker asks the run to name the session by the trace's id (the alias) and waits for the answer.

The episode's model calls go from the worker to the run's agent endpoint over HTTP, as before (verifiers' eval
client with the gateway key). A worker that exits fails the episodes it held, naming its exit code; one whose loop
gives no sign of life past an episode's `timeout.episode` plus `GRACE_S` (blocked) is killed, failing the same;
the next episode starts a new worker. Either way the run, its endpoint and its other samples go on. The episodes a
dead worker held are not played again: each had its agent session on the endpoint, with the turns it took.
"""

from __future__ import annotations

from sluiceway.infra.call_worker import CallFailed, CallWorker, WorkerGone

__all__ = ["CallFailed", "EpisodeWorker", "WorkerGone", "GRACE_S"]

GRACE_S = 30.0  # past timeout.episode, how long a worker's loop may give no sign of life before it is killed


class EpisodeWorker(CallWorker):
    """The run's side of one source's worker."""

    def __init__(self, source: str, args: dict | None, size: int | None, episode_timeout_s: float) -> None:
        super().__init__(f"{__name__}:EpisodeHandler", (source, args, size), "the verifiers worker process",
                         episode_timeout_s + GRACE_S, during="the episode (the environment's code?)")  # fmt: skip

    async def run(self, idx: int, base_url: str, gateway: str, on_alias) -> dict:
        """Task `idx`'s episode in the worker; its summary. `on_alias(trace_id)` is called before the trace's first
        model call. WorkerGone when the worker ends or blocks with it; CallFailed when the episode raised."""
        return await self.call((idx, base_url, gateway), on_alias)


class EpisodeHandler:
    """The worker's side: the environment and its episodes (verifiers_episodes.py)."""

    def __init__(self, source: str, args: dict | None, size: int | None) -> None:
        from sluiceway.tasks.rollout.agent.verifiers_episodes import Episodes

        self.episodes = Episodes(source, args, size)

    async def handle(self, payload: tuple, ask) -> dict:
        idx, base_url, gateway = payload
        return await self.episodes.play(idx, base_url, gateway, lambda trace: ask(trace.id))

    async def close(self) -> None:
        await self.episodes.close()
