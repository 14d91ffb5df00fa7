"""verifiers episodes in a worker process of their own (issue 52 points 5 and 6).

An environment's code (its taskset, rubric, harness glue) is code nobody here wrote. Run on the run's own event
loop, a reward that called `os._exit` ended the run and one that blocked (`time.sleep` in an async reward) hung
every session. Here it runs in one spawned process per verifiers source, on that process's own loop; the run
talks to it over a pipe:

    worker -> run   ("ready",) | ("broken", message)                   once, after loading the environment
    run -> worker   ("run", eid, task idx, endpoint URL, gateway key)   play task idx's episode
    worker -> run   ("alias", eid, trace id)                            before the trace's first model call
    run -> worker   ("ack", eid)                                        the session answers to that id now
    worker -> run   ("done", eid, summary) | ("failed", eid, message)   the episode's plain summary, or why not
    run -> worker   ("stop",)

The episode's model calls go from the worker to the run's agent endpoint over HTTP, as before (verifiers' eval
client with the gateway key). A worker that exits fails the episodes it held, naming its exit code; one that gives
no answer past an episode's `timeout.episode` plus `GRACE_S` (its loop blocked) is killed, failing the same; the
next episode starts a new worker. Either way the run, its endpoint and its other samples go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("sluiceway")

GRACE_S = 30.0  # past timeout.episode, what a worker gets before it is called blocked and killed
START_TIMEOUT_S = 300.0  # spawning a worker imports verifiers and loads the environment


class WorkerGone(RuntimeError):
    """The worker process ended, or was killed, with this episode in it: the sample's failure, nothing more."""


@dataclass
class _Pending:
    loop: asyncio.AbstractEventLoop
    fut: asyncio.Future
    on_alias: Any
    proc: Any


class EpisodeWorker:
    """The run's side of one source's worker: starts it on demand, sends episodes, routes the answers back."""

    def __init__(self, source: str, args: dict | None, size: int | None, episode_timeout_s: float) -> None:
        self.source, self.args, self.size = source, args, size
        self.timeout_s = episode_timeout_s + GRACE_S
        self._lock = threading.Lock()  # the process, the pipe's send side, the pending table
        self._start = threading.Lock()  # one start at a time
        self._proc: Any = None
        self._conn: Any = None
        self._pending: dict[str, _Pending] = {}

    # ------------------------------------------------------------------------------------------ the process
    def _ensure(self) -> Any:
        """The live worker, started (and its environment loaded) if there is none."""
        with self._start:
            with self._lock:
                if self._proc is not None and self._proc.is_alive():
                    return self._proc
            ctx = mp.get_context("spawn")  # never fork: the run's threads and locks stay in the run
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(self.source, self.args, self.size, theirs), daemon=True,
                               name="sluiceway-verifiers")  # fmt: skip
            proc.start()
            theirs.close()
            ready = None
            with contextlib.suppress(EOFError, OSError):
                if ours.poll(START_TIMEOUT_S):
                    ready = ours.recv()
            if ready != ("ready",):
                proc.kill()
                proc.join(5)
                why = ready[1] if ready and ready[0] == "broken" else f"exit code {proc.exitcode}"
                raise WorkerGone(f"the verifiers worker process did not start ({why})")
            with self._lock:
                self._proc, self._conn = proc, ours
            threading.Thread(target=self._read, args=(proc, ours), daemon=True, name="verifiers-worker").start()
            return proc

    def _read(self, proc, conn) -> None:
        """Answers from one worker, until it ends; then the episodes it held fail."""
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            kind, eid = msg[0], msg[1]
            p = self._pending.get(eid)
            if p is None:
                continue
            if kind == "alias":
                try:
                    p.on_alias(msg[2])
                finally:
                    self._send(("ack", eid))
            elif kind == "done":
                p.loop.call_soon_threadsafe(_settle, p.fut, msg[2], None)
            elif kind == "failed":
                p.loop.call_soon_threadsafe(_settle, p.fut, None, RuntimeError(msg[2]))
        proc.join(5)
        code = proc.exitcode
        how = f"exited with code {code}" if code is not None and code >= 0 else f"was killed (signal {-(code or 9)})"
        with self._lock:
            if self._proc is proc:
                self._proc = self._conn = None
            lost = [p for p in self._pending.values() if p.proc is proc]
        if lost:
            log.warning("verifiers %s: the worker process %s with %d episodes in it; the next starts a new one",
                        self.source, how, len(lost))  # fmt: skip
        for p in lost:
            gone = WorkerGone(f"the verifiers worker process {how} during the episode (the environment's code?)")
            p.loop.call_soon_threadsafe(_settle, p.fut, None, gone)
        with contextlib.suppress(Exception):
            conn.close()

    def _send(self, msg: tuple) -> bool:
        with self._lock:
            if self._conn is None:
                return False
            try:
                self._conn.send(msg)
                return True
            except (OSError, ValueError):
                return False

    # ------------------------------------------------------------------------------------------ one episode
    async def run(self, idx: int, base_url: str, gateway: str, on_alias) -> dict:
        """Task `idx`'s episode in the worker; its summary (verifiers_episodes.py `episode_summary`).
        `on_alias(trace_id)` is called before the trace's first model call. WorkerGone when the worker ends or blocks
        with it."""
        proc = await asyncio.to_thread(self._ensure)
        eid = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._lock:
            self._pending[eid] = _Pending(loop, fut, on_alias, proc)
        try:
            if not self._send(("run", eid, idx, base_url, gateway)):
                raise WorkerGone("the verifiers worker process could not be reached")
            try:
                return await asyncio.wait_for(fut, self.timeout_s)
            except TimeoutError:
                log.warning("verifiers %s: the worker gave no answer within %.0f s (an environment blocking its "
                            "event loop?); it is killed and the next episode starts a new one", self.source,
                            self.timeout_s)  # fmt: skip
                with contextlib.suppress(Exception):
                    proc.kill()
                raise WorkerGone(f"the verifiers worker gave no answer within {self.timeout_s:.0f} s (timeout.episode "
                                 f"+ {GRACE_S:.0f} s: its event loop blocked?); it was killed") from None  # fmt: skip
        finally:
            with self._lock:
                self._pending.pop(eid, None)

    def close(self) -> None:
        with self._lock:
            proc = self._proc
        if proc is None:
            return
        self._send(("stop",))
        proc.join(35)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _settle(fut: asyncio.Future, result, error) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


# ---------------------------------------------------------------------------------------------- the worker
def serve(source: str, args: dict | None, size: int | None, conn) -> None:
    """The worker process: load the environment, then play the episodes the run sends until it says stop."""
    from sluiceway.infra.proc import die_with_parent

    with contextlib.suppress(Exception):
        die_with_parent()  # a SIGKILLed run leaves no worker behind
    try:
        from sluiceway.tasks.rollout.agent.verifiers_episodes import Episodes

        episodes = Episodes(source, args, size)
    except BaseException as e:  # noqa: BLE001 - its load's failure is the run's to report
        conn.send(("broken", f"{type(e).__name__}: {e}"))
        return
    send_lock, acks = threading.Lock(), {}

    def send(msg: tuple) -> None:
        with send_lock:
            conn.send(msg)

    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def play(eid: str, idx: int, base_url: str, gateway: str) -> None:
        def minted(trace) -> None:  # before the trace's first model call: the run names the session by its id
            acks[eid] = threading.Event()
            send(("alias", eid, trace.id))
            acks[eid].wait(60)

        try:
            summary = await episodes.play(idx, base_url, gateway, minted)
            send(("done", eid, summary))
        except BaseException as e:  # noqa: BLE001 - a SystemExit from the environment's code too
            send(("failed", eid, f"{type(e).__name__}: {e}"))
        finally:
            acks.pop(eid, None)

    def receive() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                msg = ("stop",)
            if msg[0] == "stop":
                loop.call_soon_threadsafe(stop.set)
                return
            if msg[0] == "ack" and msg[1] in acks:
                acks[msg[1]].set()
            elif msg[0] == "run":
                loop.call_soon_threadsafe(lambda m=msg: loop.create_task(play(*m[1:])))

    async def main() -> None:
        threading.Thread(target=receive, daemon=True).start()
        send(("ready",))
        await stop.wait()
        await episodes.close()

    try:
        loop.run_until_complete(main())
    finally:
        os._exit(0)  # threads of the environment's (its tool servers' clients) must not hold the process
