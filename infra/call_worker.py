"""Code nobody here wrote, run in a spawned worker process so that an exit or a blocked event loop costs only the
calls it held (issue 52): verifiers episodes (tasks/rollout/agent/verifiers_worker.py) and slime generate
functions (tasks/rollout/slime_plugins/worker.py) run through it.

The worker imports `factory` ("module:name") and calls it with `init` (a tuple, or a function giving the tuple when
a worker starts: what the handler must know then) to get a handler whose
`async handle(payload, ask)` answers one call (`ask(value)`, from the handler's code, asks the run a question and
blocks for its answer: verifiers' trace alias) and whose optional `async close()` runs at stop. Messages on the
pipe:

    worker -> run   ("ready",) | ("broken", message)          once, after the factory ran
    run -> worker   ("call", cid, payload) | ("cancel", cid) | ("answer", cid, value) | ("stop",)
    worker -> run   ("ask", cid, value) | ("done", cid, result) | ("failed", cid, message) | ("beat",)

The worker's loop beats every second. A worker whose loop gives no beat for `blocked_after_s` (code that blocks
it: `time.sleep` in an async function) is killed; one that exits (`os._exit`) or is killed fails the calls it
held with `WorkerGone`. `IsolatingWorker` then runs each of those calls again alone, in a worker of its own,
so the call that ended the worker fails and the others it held complete: an exit costs its own call only.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import multiprocessing as mp
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("sluiceway")

START_TIMEOUT_S = 300.0  # a worker imports its library and loads what the factory loads
BEAT_S = 1.0
ALONE_AT_ONCE = 2  # calls run again alone at the same time (each in a process of its own)


class WorkerGone(RuntimeError):
    """The worker process ended, or was killed, with this call in it."""


class CallFailed(RuntimeError):
    """The handler raised: the message is the worker's `Type: message`."""


@dataclass
class _Pending:
    loop: asyncio.AbstractEventLoop
    fut: asyncio.Future
    on_ask: Any
    proc: Any


class CallWorker:
    """The run's side of one worker process: started on the first call (again after one ended), calls
    multiplexed on its pipe. `what` names it in messages ("the verifiers worker process"), `during` what a call
    is ("the episode")."""

    def __init__(self, factory: str, init, what: str, blocked_after_s: float, during: str = "the call") -> None:
        self.factory, self.init, self.what, self.during = factory, init, what, during
        self.blocked_after_s = blocked_after_s
        self._lock = threading.Lock()  # the process, the pipe's send side, the pending table
        self._start = threading.Lock()  # one start at a time
        self._proc: Any = None
        self._conn: Any = None
        self._pending: dict[str, _Pending] = {}

    # ------------------------------------------------------------------------------------------ the process
    def _ensure(self) -> Any:
        with self._start:
            with self._lock:
                if self._proc is not None and self._proc.is_alive():
                    return self._proc
            ctx = mp.get_context("spawn")  # never fork: the run's threads and locks stay in the run
            ours, theirs = ctx.Pipe()
            init = self.init() if callable(self.init) else self.init
            proc = ctx.Process(target=serve, args=(self.factory, init, theirs), daemon=True,
                               name="sluiceway-worker")  # fmt: skip
            proc.start()
            theirs.close()
            ready = None
            with contextlib.suppress(EOFError, OSError):
                deadline = time.monotonic() + START_TIMEOUT_S
                while ready in (None, ("beat",)) and ours.poll(max(0.0, deadline - time.monotonic())):
                    ready = ours.recv()
            if ready != ("ready",):
                proc.kill()
                proc.join(5)
                why = ready[1] if ready and ready[0] == "broken" else f"exit code {proc.exitcode}"
                raise WorkerGone(f"{self.what} did not start ({why})")
            with self._lock:
                self._proc, self._conn = proc, ours
            threading.Thread(target=self._read, args=(proc, ours), daemon=True, name="call-worker").start()
            return proc

    def _read(self, proc, conn) -> None:
        """Answers from one worker until it ends (or is killed for a blocked loop); then its calls fail."""
        blocked = False
        while True:
            try:
                if not conn.poll(self.blocked_after_s):
                    blocked = True
                    log.warning("%s gave no sign of life for %.0f s (code blocking its event loop?); it is killed "
                                "and its calls run again alone", self.what, self.blocked_after_s)  # fmt: skip
                    proc.kill()
                    break
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "beat":
                continue
            p = self._pending.get(msg[1])
            if p is None:
                continue
            if msg[0] == "ask":
                answer = None
                try:
                    answer = p.on_ask(msg[2]) if p.on_ask is not None else None
                except Exception:  # noqa: BLE001 - the asker gets None; this reader must go on for every call
                    log.exception("%s: answering a call's question failed", self.what)
                try:
                    self._send(("answer", msg[1], answer))
                except Exception:  # noqa: BLE001 - an answer pickle cannot carry: None instead
                    self._send(("answer", msg[1], None))
            elif msg[0] == "done":
                p.loop.call_soon_threadsafe(_settle, p.fut, msg[2], None)
            elif msg[0] == "failed":
                p.loop.call_soon_threadsafe(_settle, p.fut, None, CallFailed(msg[2]))
        proc.join(5)
        code = proc.exitcode
        if blocked:
            how = f"was killed after {self.blocked_after_s:.0f} s without a sign of life (its event loop blocked?)"
        elif code is not None and code >= 0:
            how = f"exited with code {code}"
        else:
            how = f"was killed (signal {-(code or 9)})"
        with self._lock:
            if self._proc is proc:
                self._proc = self._conn = None
            lost = [p for p in self._pending.values() if p.proc is proc]
        if lost:
            log.warning("%s %s with %d calls in it; the next call starts a new one", self.what, how, len(lost))
        for p in lost:
            p.loop.call_soon_threadsafe(_settle, p.fut, None, WorkerGone(f"{self.what} {how} during {self.during}"))
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

    # ------------------------------------------------------------------------------------------ one call
    async def call(self, payload: Any, on_ask=None) -> Any:
        """The handler's answer to `payload`. CallFailed when it raised, WorkerGone when the worker ended with it;
        cancelling the call cancels it in the worker."""
        proc = await asyncio.to_thread(self._ensure)
        cid = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._lock:
            self._pending[cid] = _Pending(loop, fut, on_ask, proc)
        try:
            try:
                sent = self._send(("call", cid, payload))
            except Exception as e:  # noqa: BLE001 - pickle refused the payload; the pipe is untouched
                raise CallFailed(f"{type(e).__name__}: the call could not be sent to the worker: {e}") from None
            if not sent:
                raise WorkerGone(f"{self.what} could not be reached")
            return await fut
        except asyncio.CancelledError:
            self._send(("cancel", cid))
            raise
        finally:
            with self._lock:
                self._pending.pop(cid, None)

    def close(self, grace_s: float = 35.0) -> None:
        with self._lock:
            proc = self._proc
        if proc is None:
            return
        self._send(("stop",))
        proc.join(grace_s)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


class IsolatingWorker:
    """A shared `CallWorker`, and for each call it lost, a second try alone in a worker of its own: the call that
    ends a worker costs itself only. `on_retry(error)` may refuse a second try (return False)."""

    def __init__(self, factory: str, init, what: str, blocked_after_s: float) -> None:
        self.factory, self.init, self.what, self.blocked_after_s = factory, init, what, blocked_after_s
        self.shared = CallWorker(factory, init, what, blocked_after_s)
        self._alone: asyncio.Semaphore | None = None

    async def call(self, payload: Any, on_ask=None) -> Any:
        try:
            return await self.shared.call(payload, on_ask)
        except WorkerGone as first:
            if self._alone is None:
                self._alone = asyncio.Semaphore(ALONE_AT_ONCE)
            async with self._alone:
                alone = CallWorker(self.factory, self.init, f"{self.what} (this call alone)", self.blocked_after_s)
                try:
                    return await alone.call(payload, on_ask)
                except WorkerGone as again:
                    raise WorkerGone(f"{again}; before that the shared worker: {first}") from None
                finally:
                    await asyncio.to_thread(alone.close, 5.0)

    def close(self) -> None:
        self.shared.close()


def _settle(fut: asyncio.Future, result, error) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _load(factory: str):
    module, _, name = factory.partition(":")
    return getattr(importlib.import_module(module), name)


# ---------------------------------------------------------------------------------------------- the worker
def serve(factory: str, init: tuple, conn) -> None:
    """The worker process: build the handler, then answer calls until the run says stop (or goes away)."""
    from sluiceway.infra.proc import die_with_parent

    with contextlib.suppress(Exception):
        die_with_parent()  # a SIGKILLed run leaves no worker behind
    try:
        handler = _load(factory)(*init)
    except BaseException as e:  # noqa: BLE001 - its load's failure is the run's to report
        conn.send(("broken", f"{type(e).__name__}: {e}"))
        return
    send_lock = threading.Lock()
    answers: dict[str, Any] = {}  # cid -> [Event, value] while the handler waits on `ask`
    tasks: dict[str, asyncio.Task] = {}

    def send(msg: tuple) -> None:
        with send_lock:
            conn.send(msg)

    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def one(cid: str, payload: Any) -> None:
        def ask(value: Any, timeout_s: float = 60.0) -> Any:
            box = answers[cid] = [threading.Event(), None]
            send(("ask", cid, value))
            box[0].wait(timeout_s)
            return box[1]

        try:
            result = await handler.handle(payload, ask)
        except asyncio.CancelledError:
            return
        except BaseException as e:  # noqa: BLE001 - a SystemExit from the handler's code too
            send(("failed", cid, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:1000]}"))
            return
        finally:
            answers.pop(cid, None)
            tasks.pop(cid, None)
        try:
            send(("done", cid, result))
        except Exception as e:  # noqa: BLE001 - a result pickle cannot carry
            send(("failed", cid, f"its result could not be sent back to the run: {type(e).__name__}: {e}"))

    def start(cid: str, payload: Any) -> None:
        tasks[cid] = loop.create_task(one(cid, payload))

    def cancel(cid: str) -> None:
        task = tasks.get(cid)
        if task is not None:
            task.cancel()

    def receive() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                msg = ("stop",)
            if msg[0] == "stop":
                loop.call_soon_threadsafe(stop.set)
                return
            if msg[0] == "answer" and msg[1] in answers:
                answers[msg[1]][1] = msg[2]
                answers[msg[1]][0].set()
            elif msg[0] == "call":
                loop.call_soon_threadsafe(start, msg[1], msg[2])
            elif msg[0] == "cancel":
                loop.call_soon_threadsafe(cancel, msg[1])

    async def beat() -> None:
        while True:
            send(("beat",))
            await asyncio.sleep(BEAT_S)

    async def main() -> None:
        threading.Thread(target=receive, daemon=True).start()
        send(("ready",))
        beating = loop.create_task(beat())
        await stop.wait()
        beating.cancel()
        closing = getattr(handler, "close", None)
        if closing is not None:
            await closing()

    try:
        loop.run_until_complete(main())
    finally:
        os._exit(0)  # threads of the handler's code (its tool servers' clients) must not hold the process
