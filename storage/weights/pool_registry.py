"""The pool registry: inference pools that come and go during a run, found beside the run's weight versions.

    <prefix>/pools/NAME.json    pool NAME's record: rewritten by its agent on every change and every heartbeat
    <prefix>/pools/NAME.drain   a request that pool NAME leave (`sluiceway pools drain NAME`)

A pool's agent (infra/pool_agent.py) registers by writing its record, keeps it alive by rewriting it, and
deregisters by deleting it once drained. A run started with `--rollout-pools auto` (or a registry URI) lists the
records at every refresh (tasks/rollout/pool_directory.py). The weight store is the one place both sides already
reach, wherever they are; a pool needs no address of the run, and the run learns the pools' addresses only here
(never from its own parameters, so no pool URL reaches a table, a log line or a Prefect parameter).

A record (`PoolRecord`): name, region, the router URL a run should use, capacity (samples in flight at once),
state ("serving" or "draining"), the versions its engines serve, and the heartbeat: ``beat`` counts the writes and
``heartbeat_s`` says how often one comes at the least. A reader judges liveness by whether ``beat`` moved on its
own clock (so clocks of different datacenters need not agree); ``updated_unix`` only lets a reader skip a record
left behind long ago by a pool that died without deregistering.

This module alone reads and writes ``pools/``, and only as `PoolRecord`s: the agent writes one, a run reads them
(every record for `--rollout-pools auto`, one pool's for a fixed `NAME=URL` pool), `sluiceway pools` lists them.
"""

from __future__ import annotations

import json
import logging
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sluiceway.storage.weights.store import WeightStore

log = logging.getLogger("sluiceway.pools")

SERVING, DRAINING = "serving", "draining"


class PoolRecord(BaseModel):
    """What a pool tells runs about itself (extra keys are kept: older and newer agents share a registry)."""

    model_config = ConfigDict(extra="allow")

    pool: str
    region: str = ""
    url: str | None = None  # the router a run sends this pool's requests to; None: a pool that takes none
    capacity: int | None = Field(None, ge=1)  # samples in flight at once; None: the run's own limit
    state: Literal["serving", "draining"] = SERVING
    version: int | None = None  # every engine serves this (None while they disagree)
    serving: int | None = None  # the oldest version any reachable engine serves
    beat: int = 0
    heartbeat_s: float = 30.0
    updated_unix: float | None = None

    @property
    def serves(self) -> int | None:
        """The version a run must assume of a request sent anywhere in the pool: the oldest any engine serves,
        else (a record without ``serving``) the one every engine serves; None: not known."""
        return self.serving if self.serving is not None else self.version


class PoolRegistry:
    """The records of the pools serving one weight store."""

    def __init__(self, wstore: WeightStore) -> None:
        self.wstore = wstore
        self._bad: set[str] = set()  # records already warned about

    def __repr__(self) -> str:
        return f"PoolRegistry({self.wstore.uri})"

    def write(self, record: PoolRecord) -> None:
        """Register pool ``record.pool``, or rewrite its record (a change, a heartbeat)."""
        ws = self.wstore
        with ws.store.redacting():
            ws.fs.makedirs(ws.path("pools"), exist_ok=True)
            ws.put_text(ws.path("pools", f"{record.pool}.json"), record.model_dump_json())

    def remove(self, name: str) -> None:
        """Deregister: the record and any drain request go."""
        ws = self.wstore
        with ws.store.redacting():
            for path in (ws.path("pools", f"{name}.json"), ws.path("pools", f"{name}.drain")):
                try:
                    ws.fs.rm_file(path)
                except FileNotFoundError:
                    pass

    def records(self) -> dict[str, PoolRecord]:
        """Every registered pool's record (one listing and one read per pool); unreadable ones are skipped."""
        ws = self.wstore
        out: dict[str, PoolRecord] = {}
        with ws.store.redacting():
            ws.fs.invalidate_cache(ws.path("pools"))
            try:
                names = [p.rsplit("/", 1)[-1] for p in ws.fs.ls(ws.path("pools"), detail=False)]
            except FileNotFoundError:
                return out
            for file in sorted(n for n in names if n.endswith(".json")):
                name = file.removesuffix(".json")
                if (record := self._read(name)) is not None:
                    out[name] = record
        return out

    def record(self, name: str) -> PoolRecord | None:
        """Pool ``name``'s record, or None while it has none (or an unreadable one): one read, no listing (a
        fixed `NAME=URL` pool's, read at every refresh of a run)."""
        ws = self.wstore
        with ws.store.redacting():
            ws.fs.invalidate_cache(ws.path("pools"))
            return self._read(name)

    def _read(self, name: str) -> PoolRecord | None:
        ws = self.wstore
        file = f"{name}.json"
        try:
            return PoolRecord.model_validate(json.loads(ws.fs.cat_file(ws.path("pools", file))))
        except FileNotFoundError:  # not registered, or deregistered between a listing and the read
            return None
        except (ValueError, ValidationError) as exc:
            if name not in self._bad:
                self._bad.add(name)
                log.warning("pool registry %s: record %s is not a pool record (%s); skipped",
                            ws.uri, file, str(exc).splitlines()[0])  # fmt: skip
            return None

    # -- drain requests ---------------------------------------------------------------------------------------

    def request_drain(self, name: str) -> None:
        ws = self.wstore
        with ws.store.redacting():
            ws.fs.makedirs(ws.path("pools"), exist_ok=True)
            ws.put_text(ws.path("pools", f"{name}.drain"), json.dumps({"pool": name}))

    def drain_requested(self, name: str) -> bool:
        """One GET (a 404 while no drain is asked: what every poll of a serving pool pays), not a HEAD and a LIST."""
        ws = self.wstore
        with ws.store.redacting():
            try:
                ws.fs.cat_file(ws.path("pools", f"{name}.drain"))
            except FileNotFoundError:
                return False
            return True
