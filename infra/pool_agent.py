"""The agent beside one pool of engines: pulls new weight versions from the weight store and has the engines load
them.

    agent = PoolAgent("us-east", WeightStore(ObjectStore.from_uri(uri)), lambda: pool.urls, work_dir)
    agent.poll_once()   # or agent.start() for a thread that polls every poll_interval_s

Each poll: if the store has a version newer than the one held in ``work_dir/current``, ``materialize`` it there
(applying only the deltas after the held version; a full download when the held copy is not in the chain), then
send ``/update_weights_from_disk`` with that ``weight_version`` to every engine whose ``/get_weight_version``
differs (so an engine that restarted on the base model catches up too). A version the store cannot reproduce
exactly (a corrupted delta, a missing file) leaves ``current`` and the engines as they were; the error, naming
the version and tensor, is logged and kept in the status until a later version goes through.

The copy in ``current`` is checked against its checksums.json once, at the agent's first poll (a restarted agent
would otherwise hand a restarted engine whatever its disk holds): a damaged copy is dropped with a warning and the
newest version is fetched again, in full. Every version the agent downloads is checked by ``materialize`` (each
tensor and file against the store's manifest) before it replaces ``current``, so later polls trust the copy; a
copy without checksums.json (materialized by an older build) is not checked.

The status (``work_dir/status.json``, rewritten atomically after every poll) is what the agent reports:
``{"pool", "region", "url", "capacity", "state", "version", "serving", "engines": {url: version}, "error",
"beat", "heartbeat_s", "updated", ...}``; ``version`` is the version every engine serves, or null while they
disagree; ``serving`` is the oldest version any reachable engine serves (what a run must assume of a request the
router sends anywhere in the pool). The same status is the pool's record in the pool registry beside the weight
versions (``pools/NAME.json``, storage/weights/pool_registry.py), written when it changes and at least every
``heartbeat_s``: that is how a run in another datacenter finds the pool, its router and the version it serves.

Leaving: ``drain()`` (SIGTERM to `sluiceway pools up`) or a drain request in the registry (`sluiceway pools drain
NAME`) puts the pool in state "draining": runs give it no new groups, it loads no new version, and once its
engines have had nothing running or waiting for ``drain_quiet_s`` (longer than a run takes to see the state) it
deletes its record (deregisters) and sets ``left``. After ``drain_timeout_s`` it deregisters anyway: a group still
running there fails at the run, which generates it elsewhere.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from pydantic import ValidationError

from sluiceway.storage.weights.checksums import checksums_problem
from sluiceway.storage.weights.errors import WeightSyncError
from sluiceway.storage.weights.materialize import local_version, materialize
from sluiceway.storage.weights.pool_registry import DRAINING, SERVING, PoolRecord, PoolRegistry, why_invalid
from sluiceway.storage.weights.store import WeightStore

log = logging.getLogger("sluiceway.pools")


class PoolAgent:
    def __init__(
        self,
        name: str,
        wstore: WeightStore,
        engine_urls: Callable[[], list[str]] | list[str],
        work_dir: str | Path,
        *,
        region: str = "",
        poll_interval_s: float = 2.0,
        load_timeout_s: float = 600.0,
        heartbeat_s: float = 10.0,
        url: str | None = None,
        capacity: int | None = None,
        drain_quiet_s: float = 3.0,
        drain_timeout_s: float = 600.0,
    ) -> None:
        try:  # what runs check of every record it will write: refused here, not skipped by every run
            PoolRecord(pool=name, region=region, url=url, capacity=capacity, heartbeat_s=heartbeat_s)
        except ValidationError as exc:
            raise ValueError(f"pool agent: runs would skip the records of pool {name!r} ({why_invalid(exc)})") from None
        self.name, self.region = name, region
        self.url, self.capacity = url, capacity  # what the registry tells runs: where to send requests, how many
        self.wstore = wstore
        self.registry = PoolRegistry(wstore)
        self.state = SERVING  # then DRAINING, then "left" (deregistered)
        self.drain_quiet_s, self.drain_timeout_s = drain_quiet_s, drain_timeout_s
        self.left = threading.Event()  # set once drained and deregistered
        self._drain = threading.Event()  # drain() asks; the polling thread acts
        self._draining_since: float | None = None
        self._idle_since: float | None = None
        self._beat = 0
        self._urls = engine_urls if callable(engine_urls) else (lambda: list(engine_urls))
        self.work_dir = Path(work_dir)
        self.current = self.work_dir / "current"  # the materialized HF directory the engines load
        self.status_path = self.work_dir / "status.json"
        self.poll_interval_s = poll_interval_s
        self.heartbeat_s = heartbeat_s
        self._reported: tuple[dict, float] | None = None  # last status sent to the store, and when
        self._last: dict | None = None  # the last status, which the heartbeat thread sends again
        self._report_lock = threading.Lock()
        self.error: str | None = None
        self.engines: dict[str, int | None] = {}
        self._http = httpx.Client(timeout=load_timeout_s, trust_env=False)  # loopback/LAN engines: never a proxy
        self._stop = threading.Event()
        self._wake = threading.Event()  # stop() and drain() cut the wait between polls short
        self._thread: threading.Thread | None = None
        self._checked = False  # whether ``current`` was checked against its checksums (once, at the first poll)

    @property
    def held(self) -> int | None:
        """The version materialized in ``current`` (it survives an agent restart)."""
        return local_version(self.current)

    @property
    def version(self) -> int | None:
        """The version every engine serves, or None while they disagree (or before the first poll)."""
        found = set(self.engines.values())
        return found.pop() if len(found) == 1 and self.engines else None

    @property
    def serving(self) -> int | None:
        """The oldest version a reachable engine serves (None: none reachable)."""
        found = [v for v in self.engines.values() if v is not None]
        return min(found) if found else None

    def poll_once(self) -> int | None:
        """Fetch and load the newest version if there is one; returns the version the pool serves. A draining
        pool loads nothing new: it waits for its engines to finish, then deregisters."""
        if self.left.is_set():
            return self.version
        if not self._checked:
            self._check_current()
            try:  # a drain request left by an earlier pool of this name is not for us
                self.registry.remove(self.name)
            except OSError as exc:
                log.warning("pool %s: could not clear its old record in %s: %s", self.name, self.wstore, exc)
            # Register at once, with what the engines serve now: runs and `pools list` see the pool while it
            # downloads the newest version (minutes for a full one over a WAN), and take it once that is in.
            self.engines = {url: self._engine_version(url) for url in self._urls()}
            self._write_status(force=True)
        if self.state == SERVING and (self._drain.is_set() or self.registry.drain_requested(self.name)):
            self._begin_drain()
        if self.state == DRAINING:
            self._poll_draining()
            return self.version
        latest = self.wstore.newest()
        held = self.held
        if latest is not None and (held is None or latest > held):
            self._fetch(latest, held)
        held = self.held
        # One assignment: the heartbeat thread and `version` read the map while a poll pushes (a map emptied and
        # refilled in place read as "no engine serves anything" in between).
        self.engines = {url: self._push(url, held) for url in self._urls()}
        self._write_status()
        return self.version

    # -- leaving ----------------------------------------------------------------------------------------------

    def drain(self) -> None:
        """Ask the pool to leave (safe from a signal handler): the polling thread drains, then deregisters."""
        self._drain.set()
        self._wake.set()

    def _begin_drain(self) -> None:
        self.state = DRAINING
        self._draining_since = time.monotonic()
        log.info("pool %s: draining (no new groups; deregisters once its engines are idle)", self.name)
        self._write_status(force=True)

    def _poll_draining(self) -> None:
        now = time.monotonic()
        busy = [url for url in self._urls() if self._engine_load(url) != 0]
        if busy:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now
        quiet = self._idle_since is not None and now - self._idle_since >= self.drain_quiet_s
        overdue = now - self._draining_since >= self.drain_timeout_s
        if not (quiet or overdue):
            self._write_status()  # the heartbeat goes on: a draining pool is not a dead one
            return
        if overdue and not quiet:
            log.warning("pool %s: engines %s still busy after %.0f s of draining; deregistering anyway (their "
                        "groups are made elsewhere)", self.name, ", ".join(busy), self.drain_timeout_s)  # fmt: skip
        self._deregister()

    def _deregister(self) -> None:
        with self._report_lock:
            self.state = "left"  # from now on nothing writes the record again
        try:
            self.registry.remove(self.name)
        except OSError as exc:  # runs then see the heartbeat stop, which ends in the same place
            log.warning("pool %s: could not deregister from %s: %s", self.name, self.wstore, exc)
        self._write_local_status(self.status())
        log.info("pool %s: drained and deregistered", self.name)
        self.left.set()
        self._stop.set()

    def _engine_load(self, url: str) -> int | None:
        """Requests running or waiting at the engine (None: not known). The embedded engine answers /get_load
        with one dict, SGLang with one per data-parallel rank."""
        try:
            r = self._http.get(f"{url}/get_load", timeout=10.0)
            r.raise_for_status()
            loads = r.json()
        except (httpx.HTTPError, ValueError):
            return None
        total = 0
        for load in loads if isinstance(loads, list) else [loads]:
            if not isinstance(load, dict):
                return None
            if "num_reqs" in load:
                total += int(load["num_reqs"])
            else:
                total += int(load.get("num_running_reqs", 0)) + int(load.get("num_waiting_reqs", 0))
        return total

    def _check_current(self) -> None:
        """Drop a damaged held copy, so this poll fetches the newest version in full (one hash of the copy: SmolLM2,
        270 MB, about 0.2 s here; never on an engine load)."""
        problem = checksums_problem(self.current) if self.current.is_dir() else None
        if problem is not None:
            log.warning(
                "pool %s: weights %s/%s; fetching the newest version again from %s",
                self.name, self.current, problem, self.wstore,
            )  # fmt: skip
            shutil.rmtree(self.current)
        self._checked = True

    def _fetch(self, version: int, held: int | None) -> None:
        try:
            materialize(self.wstore, version, self.current if held is not None else None, self.current)
        except WeightSyncError as exc:  # the old weights stay: materialize renames into place only on success
            if self.error != str(exc):  # once per distinct failure, not every poll
                log.error("pool %s: %s; still serving v%s", self.name, exc, held)
            self.error = str(exc)
            return
        self.error = None
        log.info("pool %s: fetched weights v%d (held v%s)", self.name, version, held)

    def _engine_version(self, url: str) -> int | None:
        try:
            r = self._http.get(f"{url}/get_weight_version", timeout=10.0)
            r.raise_for_status()
            return int(r.json()["weight_version"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    def _push(self, url: str, held: int | None) -> int | None:
        """Have the engine at ``url`` serve ``held``; the version it serves afterwards (None: unreachable)."""
        serving = self._engine_version(url)
        if held is None or serving == held:
            return serving
        body = {"model_path": str(self.current.resolve()), "weight_version": str(held)}
        try:
            r = self._http.post(f"{url}/update_weights_from_disk", json=body)
            if r.status_code >= 400 or r.json().get("success") is False:
                raise httpx.HTTPError(f"answered {r.status_code}: {r.text[:300]}")
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("pool %s: engine %s did not load v%d: %s", self.name, url, held, exc)  # retried next poll
            return serving
        return self._engine_version(url)

    def status(self) -> dict:
        return {
            "pool": self.name,
            "region": self.region,
            "url": self.url,
            "capacity": self.capacity,
            "state": self.state,
            "version": self.version,
            "serving": self.serving,
            "held": self.held,
            "engines": self.engines,
            "error": self.error,
            "beat": self._beat,
            "heartbeat_s": self.heartbeat_s,
            "updated": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "updated_unix": time.time(),
        }

    def _write_status(self, force: bool = False) -> None:
        status = self.status()
        self._write_local_status(status)
        self._report(status, force)

    def _write_local_status(self, status: dict) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.status_path.with_name(f".status.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(status, indent=1))
        os.replace(tmp, self.status_path)  # a reader never sees half a status

    def _report(self, status: dict, force: bool = False) -> None:
        """Send the status to the registry when it changed, else once per heartbeat (cheap on S3)."""
        with self._report_lock:  # the poll loop and the heartbeat thread
            if self.state == "left":  # deregistered: a late beat must not register the pool again
                return
            self._last = status
            now = time.monotonic()
            same = {k: v for k, v in status.items() if k not in ("updated", "updated_unix", "beat")}
            fresh = self._reported is not None and now - self._reported[1] < self.heartbeat_s
            if not force and fresh and self._reported[0] == same:
                return
            self._beat += 1
            try:
                record = PoolRecord.model_validate(status | {"beat": self._beat, "updated_unix": time.time()})
                self.registry.write(record)
            except OSError as exc:  # the store is unreachable for now: the pool still serves; next poll tries again
                log.warning("pool %s: could not report status to %s: %s", self.name, self.wstore, exc)
                return
            self._reported = (same, now)

    def _beat_loop(self) -> None:
        """The heartbeat on its own thread: a poll that downloads a version for minutes must not look like death."""
        while not self._stop.wait(self.heartbeat_s / 2):
            if self._last is not None:
                try:
                    self._report(self._last)
                except Exception:  # noqa: BLE001 - the next beat tries again
                    log.exception("pool %s: heartbeat failed", self.name)

    # -- background polling ------------------------------------------------------------------------------------

    def start(self) -> PoolAgent:
        self._thread = threading.Thread(target=self._loop, name=f"pool-agent-{self.name}", daemon=True)
        self._thread.start()
        threading.Thread(target=self._beat_loop, name=f"pool-beat-{self.name}", daemon=True).start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:  # noqa: BLE001 - a flaky store or engine must not end the agent; next poll retries
                log.exception("pool %s: poll failed", self.name)
            # A draining pool looks at its engines more often: it deregisters soon after they are idle.
            self._wake.wait(min(self.poll_interval_s, 0.5) if self.state == DRAINING else self.poll_interval_s)
            self._wake.clear()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30.0)
        self._http.close()
