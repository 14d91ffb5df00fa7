"""The server side of the SDK's futures: every mutating call answers a request id at once and runs later; the
client polls `retrieve_future` until the result is there (try again while pending). Pure logic, no HTTP.

Ordering: the SDK numbers a training client's requests (`seq_id`, from 1) and expects them applied in that order
(a forward_backward before the optim_step that follows it). It already sends them in turn, but HTTP requests on
separate connections can still arrive swapped, so each model runs its work in seq_id order (`SequencedRunner`).
"""

from __future__ import annotations

import collections
import datetime as _dt
import heapq
import itertools
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"


class TinkerUserError(Exception):
    """A request the server refuses for the user's reason (a bad input, something not implemented): the SDK
    raises RequestFailedError with category `user`, showing this message."""


def not_implemented(what: str) -> TinkerUserError:
    return TinkerUserError(
        f"sluiceway's Tinker server does not implement {what} yet (docs/tinker.md lists what it does)"
    )


@dataclass
class Result:
    """A finished request: a JSON body (a dict), or protobuf bytes for the types the SDK reads as protobuf."""

    json: dict[str, Any] | None = None
    proto: bytes | None = None
    error: str | None = None
    category: str = "user"  # RequestErrorCategory's value: "user", "server" or "unknown"
    # For the journal (flows/tinker/journal.py), never sent: the request row's fields the work learned
    # (metrics, num_tokens, ...) and the sampled sequences' rows.
    summary: dict[str, Any] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)

    def body(self) -> dict[str, Any] | bytes:
        if self.error is not None:  # the SDK's RequestFailedResponse
            return {"error": self.error, "category": self.category}
        return self.proto if self.proto is not None else self.json


@dataclass
class _Entry:
    info: dict[str, Any] = field(default_factory=dict)  # what the request was: type, model, seq_id, loss_fn...
    done: threading.Event = field(default_factory=threading.Event)
    result: Result | None = None
    created: float = field(default_factory=time.monotonic)
    submitted_at: _dt.datetime = field(default_factory=lambda: _dt.datetime.now(_dt.UTC))
    started: float | None = None  # when its work began (monotonic)


class Journal(Protocol):
    """Where finished requests are kept beyond the process (flows/tinker/journal.py)."""

    def record(self, rid: str, entry: _Entry, result: Result) -> None: ...

    def lookup(self, rid: str) -> Result | None: ...


REQUEST_ID = re.compile(r"^req-[0-9a-f]{32}$")
KEEP_FINISHED = 1024  # finished results a server with a journal keeps in memory (older ones are on the store)


class FutureStore:
    """Request ids and their results: in memory while the server runs, and with a `journal` each result is
    written to the store before it is answered, so a restarted server still answers a finished request."""

    def __init__(self, journal: Journal | None = None, keep_finished: int = KEEP_FINISHED) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._finished: collections.deque[str] = collections.deque()  # with a journal, oldest first
        self.keep_finished = keep_finished
        self.journal = journal

    def new(self, **info: Any) -> str:
        rid = f"req-{uuid.uuid4().hex}"
        with self._lock:
            self._entries[rid] = _Entry(info)
        return rid

    def finish(self, rid: str, result: Result) -> None:
        entry = self._entries[rid]
        if self.journal is not None:
            try:
                self.journal.record(rid, entry, result)
            except Exception:  # noqa: BLE001 (the store failing must not lose the answer the client waits for)
                log.exception("tinker: request %s could not be written to the store", rid)
        # The journal's parts are written: what stays in memory is the answer alone.
        result.summary, result.samples = {}, []
        entry.result = result
        entry.done.set()
        if self.journal is not None:
            self._forget_old(rid)

    def _forget_old(self, rid: str) -> None:
        """Keep `keep_finished` finished results in memory; older ones are read back from the journal if polled
        again (`known`). Without this a server's memory grew with every request it ever answered."""
        with self._lock:
            self._finished.append(rid)
            while len(self._finished) > self.keep_finished:
                self._entries.pop(self._finished.popleft(), None)

    def run(self, rid: str, fn: Callable[[], Result]) -> None:
        """Run `fn` and keep what it returns; an exception becomes the request's error (user or server)."""
        self._entries[rid].started = time.monotonic()
        try:
            result = fn()
        except TinkerUserError as e:
            result = Result(error=str(e), category="user")
        except Exception as e:  # noqa: BLE001 (any failure is the request's answer, never the server's end)
            result = Result(error=f"{type(e).__name__}: {e}", category="server")
        self.finish(rid, result)

    def known(self, rid: str) -> bool:
        """Whether `rid` is a request of this server: one in memory, or with a journal, one a server before a
        restart finished (read back from the store, then kept in memory)."""
        if rid in self._entries:
            return True
        if self.journal is None or not REQUEST_ID.match(rid):
            return False
        result = self.journal.lookup(rid)
        if result is None:
            return False
        entry = _Entry({"restored": True}, result=result)
        entry.done.set()
        with self._lock:
            self._entries.setdefault(rid, entry)
        return True

    def wait(self, rid: str, timeout: float) -> Result | None:
        """The result, waiting up to `timeout` s for it (a long poll: the SDK asks again at once on try_again,
        so answering immediately would spin it); None while still pending. KeyError for an unknown id."""
        entry = self._entries.get(rid)
        if entry is None and self.known(rid):  # forgotten since `known` said yes: read back from the journal
            entry = self._entries[rid]
        if entry is None:
            raise KeyError(rid)
        entry.done.wait(timeout)
        return entry.result


UNSEQUENCED = 1 << 62  # jobs without a seq_id sort after every numbered one and never wait for a gap


@dataclass(order=True)
class _Job:
    seq: int
    order: int
    fn: Callable[[], None] = field(compare=False)


class SequencedRunner:
    """Runs one model's jobs one at a time, in seq_id order, on its own thread.

    A job whose predecessor (seq_id - 1) has not arrived waits for it up to `gap_wait` s, then runs anyway: the
    SDK's ids are consecutive, but a request that failed on the client before it was sent would otherwise stop
    the model for good. Jobs without a seq_id run in arrival order after those queued with one.
    """

    def __init__(self, name: str, gap_wait: float = 2.0) -> None:
        self.gap_wait = gap_wait
        self._cv = threading.Condition()
        self._heap: list[_Job] = []
        self._order = itertools.count()
        self._last = 0  # the seq_id of the last job run (the SDK's first is 1)
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=f"tinker-{name}", daemon=True)
        self._thread.start()

    def submit(self, seq_id: int | None, fn: Callable[[], None]) -> None:
        with self._cv:
            seq = seq_id if seq_id is not None else UNSEQUENCED
            heapq.heappush(self._heap, _Job(seq, next(self._order), fn))
            self._cv.notify_all()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()

    def _next(self) -> _Job | None:
        with self._cv:
            deadline = None
            while not self._stopped:
                if self._heap:
                    head = self._heap[0]
                    if head.seq <= self._last + 1 or head.seq >= UNSEQUENCED:
                        return heapq.heappop(self._heap)
                    deadline = deadline or time.monotonic() + self.gap_wait
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return heapq.heappop(self._heap)
                    self._cv.wait(left)
                else:
                    deadline = None
                    self._cv.wait()
            return None

    def _loop(self) -> None:
        while (job := self._next()) is not None:
            if job.seq < UNSEQUENCED:
                self._last = max(self._last, job.seq)
            job.fn()
