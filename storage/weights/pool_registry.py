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

import errno
import hashlib
import json
import logging
import os
import re
import stat
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from sluiceway.storage.weights.store import WeightStore

log = logging.getLogger("sluiceway.pools")

SERVING, DRAINING = "serving", "draining"
RESERVED_NAME = "local"  # the run's own engines (tasks/rollout/pool_target.py LOCAL): never a registered pool
NAME_RULE = re.compile(r"[A-Za-z0-9_.-]{1,128}")  # as --rollout-pools NAME=URL and `pools up` spell names
MAX_RECORD_BYTES = 256 * 1024  # a record over this is not read (a real one is well under 16 KiB)
MAX_HEARTBEAT_S = 86400.0  # a pool beats at least once a day, or liveness would never drop it
_INT64 = 2**63 - 1
_INT32 = 2**31 - 1


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a registered pool's name, or None."""
    if not isinstance(name, str) or not NAME_RULE.fullmatch(name):
        return "a pool's name is 1 to 128 of A-Z a-z 0-9 _ . -"
    if name == RESERVED_NAME:
        return f"{RESERVED_NAME!r} is the run's own engines"
    return None


def url_problem(url: str) -> str | None:
    """Why ``url`` is no router address a run can send requests to (http(s)://HOST[:PORT][/PATH]), or None. The
    URL itself is never part of the answer (it may carry credentials)."""
    if any(c.isspace() or not c.isprintable() for c in url):
        return "the URL holds a space or a control character"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0-65535
    except ValueError:
        return "the URL does not parse"
    if parts.scheme not in ("http", "https"):
        return "the URL is not http:// or https://"
    if not parts.hostname:
        return "the URL names no host"
    return None


class PoolRecord(BaseModel):
    """What a pool tells runs about itself (extra keys are kept: older and newer agents share a registry).

    Every field is checked as it is read (:meth:`PoolRegistry.records`): a record a run could not act on safely
    (a heartbeat that is NaN, infinite or beyond a day, so the pool would never be dropped; a URL no client can
    reach; the name of the run's own engines) is no record."""

    model_config = ConfigDict(extra="allow")

    pool: str
    region: str = Field("", max_length=128, pattern=r"^[^\x00-\x1f\x7f]*$")  # shown in log lines: no control chars
    url: str | None = Field(None, max_length=2048)  # the router a run sends requests to; None: takes none
    capacity: int | None = Field(None, ge=1, le=_INT32)  # samples in flight at once; None: the run's own limit
    state: Literal["serving", "draining"] = SERVING
    version: int | None = Field(None, ge=0, le=_INT64)  # every engine serves this (None while they disagree)
    serving: int | None = Field(None, ge=0, le=_INT64)  # the oldest version any reachable engine serves
    beat: int = Field(0, ge=0, le=_INT64)
    heartbeat_s: float = Field(30.0, gt=0, le=MAX_HEARTBEAT_S, allow_inf_nan=False)
    updated_unix: float | None = Field(None, allow_inf_nan=False)  # the writer's clock: any finite time

    @field_validator("pool")
    @classmethod
    def _name(cls, value: str) -> str:
        if (problem := name_problem(value)) is not None:
            raise ValueError(problem)
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and (problem := url_problem(value)) is not None:
            raise ValueError(problem)
        return value

    @property
    def serves(self) -> int | None:
        """The version a run must assume of a request sent anywhere in the pool: the oldest any engine serves,
        else (a record without ``serving``) the one every engine serves; None: not known."""
        return self.serving if self.serving is not None else self.version


class _Skip(Exception):
    """An entry of ``pools/`` that is not read: the reason, in a few words (``kind`` says which warning it is)."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind = kind


def why_invalid(exc: ValidationError) -> str:
    """The first problem of a record, without the value (a URL may carry credentials)."""
    err = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {err['msg']}" if where else err["msg"]


def _local_kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _read_local(path: str, known: Any) -> tuple[Any, bytes | None]:
    """(what the file is now, its bytes; None: unchanged since ``known``) without ever blocking on the entry: a
    FIFO, a device or a directory is found by its type and never read; a file over the cap is never read."""
    st = os.stat(path)  # follows a link: what a read would reach
    if not stat.S_ISREG(st.st_mode):
        raise _Skip("type", f"it is {_local_kind(st.st_mode)}, not a file")
    signature = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if signature == known:
        return signature, None
    if st.st_size > MAX_RECORD_BYTES:
        raise _Skip("size", f"{st.st_size} bytes, over the {MAX_RECORD_BYTES} a record may have")
    # O_NONBLOCK: should the entry have become a FIFO since the stat, opening it does not wait for a writer.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Skip("type", f"it is {_local_kind(st.st_mode)}, not a file")
        chunks, left = [], MAX_RECORD_BYTES + 1
        while left > 0 and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > MAX_RECORD_BYTES:
        raise _Skip("size", f"over the {MAX_RECORD_BYTES} bytes a record may have")
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), data


class PoolRegistry:
    """The records of the pools serving one weight store.

    Reading never trusts ``pools/``: only regular files are read (a FIFO, a device or a directory named
    ``NAME.json`` is skipped by its type, never opened for a blocking read), at most ``MAX_RECORD_BYTES`` of each
    (larger ones are skipped from their size), parsed by pydantic's own parser (bounded nesting, no NaN) and
    checked field by field (`PoolRecord`); a record whose entry has not changed since it was last read (its size,
    modification time and inode; on S3 its size and ETag) is not read again. An entry that cannot be used is
    skipped with one warning, once per entry and problem, and hides no other; one that cannot be read now (an I/O
    error) keeps what it held when last read, so its pool ages out by its heartbeat as one that fell silent.
    """

    def __init__(self, wstore: WeightStore) -> None:
        self.wstore = wstore
        self._held: dict[str, tuple[Any, PoolRecord | None]] = {}  # name -> (its entry when read, what it held)
        self._said: dict[str, str] = {}  # name -> the problem last warned about

    def __repr__(self) -> str:
        return f"PoolRegistry({self.wstore.uri})"

    def write(self, record: PoolRecord) -> None:
        """Register pool ``record.pool``, or rewrite its record (a change, a heartbeat). A record that readers
        would refuse (a field changed after it was made, or over the size cap) raises ValueError, unwritten."""
        text = record.model_dump_json()
        PoolRecord.model_validate_json(text, strict=True)  # what a reader checks, so a writer never writes it
        if len(text.encode()) > MAX_RECORD_BYTES:
            raise ValueError(f"pool {record.pool}: a record of {len(text.encode())} bytes is over the "
                             f"{MAX_RECORD_BYTES} a reader takes")  # fmt: skip
        ws = self.wstore
        with ws.store.redacting():
            ws.fs.makedirs(ws.path("pools"), exist_ok=True)
            ws.put_text(ws.path("pools", f"{record.pool}.json"), text)

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
        """Every registered pool's record: one listing, and one read per record that changed since the last.
        Raises OSError only when ``pools/`` cannot be listed (the store unreachable)."""
        ws = self.wstore
        out: dict[str, PoolRecord] = {}
        with ws.store.redacting():
            entries = self._list()
        for name in [n for n in {*self._held, *self._said} if n not in entries]:
            self._forget(name)  # gone: a record that comes back under this name is read and judged anew
        for name in sorted(entries):
            if (record := self._entry(name, entries[name])) is not None:
                out[name] = record
        return out

    def record(self, name: str) -> PoolRecord | None:
        """Pool ``name``'s record, or None while it has none (or an unusable one): no listing, one bounded read
        (a fixed `NAME=URL` pool's, read at every refresh of a run; on a local store not even that while the
        file is unchanged)."""
        return self._entry(name, None)

    # -- reading one entry -------------------------------------------------------------------------------------

    def _list(self) -> dict[str, dict | None]:
        """The ``NAME.json`` entries of ``pools/``: name -> the listing's details (S3; None on a local store,
        where each entry is looked at when read)."""
        ws = self.wstore
        base = ws.path("pools")
        if not ws.store.is_s3:
            try:
                with os.scandir(base) as found:
                    files = [e.name for e in found]
            except FileNotFoundError:
                return {}
            return {f.removesuffix(".json"): None for f in files if f.endswith(".json") and f != ".json"}
        ws.fs.invalidate_cache(base)
        try:
            found = ws.fs.ls(base, detail=True)
        except FileNotFoundError:
            return {}
        out: dict[str, dict | None] = {}
        for info in found:
            file = info["name"].rstrip("/").rsplit("/", 1)[-1]
            if file.endswith(".json") and file != ".json":
                out[file.removesuffix(".json")] = info
        return out

    def _entry(self, name: str, info: dict | None) -> PoolRecord | None:
        ws = self.wstore
        file = f"{name}.json"
        known, held = self._held.get(name, (None, None))
        try:
            if (problem := name_problem(name)) is not None:
                raise _Skip("name", problem)
            with ws.store.redacting():
                signature, data = self._fetch(name, info, known)
        except FileNotFoundError:  # not registered, or deregistered between a listing and the read
            self._forget(name)
            return None
        except _Skip as skip:
            self._held.pop(name, None)
            self._warn(name, skip.kind, f"record {file} is not read ({skip}); skipped")
            return None
        except OSError as exc:  # this entry, now: what it held stays, and its pool ages out if it stays so
            kept = "kept as last read" if held is not None else "skipped"
            self._warn(name, "io", f"record {file} could not be read ({type(exc).__name__}: {exc}); {kept}")
            return held
        if data is None:  # unchanged since it was read
            return held
        record, problem = _parse(name, data)
        self._held[name] = (signature, record)
        if problem is not None:
            self._warn(name, "invalid", f"record {file} is not a pool record ({problem}); skipped")
        elif self._said.pop(name, None) is not None:
            log.info("pool registry %s: record %s is readable again", ws.uri, file)
        return record

    def _fetch(self, name: str, info: dict | None, known: Any) -> tuple[Any, bytes | None]:
        """(what the entry is now, its bytes; None: unchanged since ``known``), at most MAX_RECORD_BYTES read."""
        ws = self.wstore
        path = ws.path("pools", f"{name}.json")
        if not ws.store.is_s3:
            return _read_local(path, known)
        if info is None:  # one pool's record, no listing: one ranged GET
            data = _s3_head(ws.fs, path, MAX_RECORD_BYTES + 1)
            signature: Any = ("sha256", hashlib.sha256(data).digest())
        else:
            if info.get("type") != "file":  # a prefix: pools/NAME.json/...
                raise _Skip("type", "it is a directory, not a file")
            size = int(info.get("size") or 0)
            signature = (size, info.get("ETag"), str(info.get("LastModified")))
            if signature == known:
                return signature, None
            if size > MAX_RECORD_BYTES:
                raise _Skip("size", f"{size} bytes, over the {MAX_RECORD_BYTES} a record may have")
            data = _s3_head(ws.fs, path, MAX_RECORD_BYTES + 1) if size else b""
        if len(data) > MAX_RECORD_BYTES:
            raise _Skip("size", f"over the {MAX_RECORD_BYTES} bytes a record may have")
        return signature, (None if signature == known else data)

    def _warn(self, name: str, kind: str, message: str) -> None:
        """One line per entry and problem: not again at every refresh while the entry stays as it is."""
        if self._said.get(name) != kind:
            self._said[name] = kind
            log.warning("pool registry %s: %s", self.wstore.uri, message)

    def _forget(self, name: str) -> None:
        self._held.pop(name, None)
        self._said.pop(name, None)

    # -- drain requests ---------------------------------------------------------------------------------------

    def request_drain(self, name: str) -> None:
        ws = self.wstore
        with ws.store.redacting():
            ws.fs.makedirs(ws.path("pools"), exist_ok=True)
            ws.put_text(ws.path("pools", f"{name}.drain"), json.dumps({"pool": name}))

    def drain_requested(self, name: str) -> bool:
        """Whether a ``NAME.drain`` entry is there, whatever it holds (its bytes are never read: a FIFO or a huge
        object there must not stall the agent). On S3 one GET of at most a byte (a 404 while no drain is asked:
        what every poll of a serving pool pays), not a HEAD and a LIST."""
        ws = self.wstore
        path = ws.path("pools", f"{name}.drain")
        with ws.store.redacting():
            try:
                if ws.store.is_s3:
                    _s3_head(ws.fs, path, 1)
                else:
                    os.stat(path)
            except FileNotFoundError:
                return False
            return True


def _s3_head(fs: Any, path: str, n: int) -> bytes:
    """The first ``n`` bytes of an S3 object (all of a smaller one): one ranged GET. S3 answers a range of an
    empty object with 416 InvalidRange (s3fs: OSError EINVAL), which is an empty object here."""
    try:
        return fs.cat_file(path, start=0, end=n)
    except OSError as exc:
        if exc.errno == errno.EINVAL and "range" in str(exc).lower():
            return b""
        raise


def _parse(name: str, data: bytes) -> tuple[PoolRecord | None, str | None]:
    """The record in ``data``, or why there is none. pydantic's parser bounds nesting and refuses NaN and
    invalid UTF-8 itself (json.loads would raise RecursionError on a record nested 5,000 deep)."""
    try:
        record = PoolRecord.model_validate_json(data, strict=True)
    except ValidationError as exc:
        return None, why_invalid(exc)
    except (ValueError, RecursionError) as exc:  # not expected of pydantic's parser; never the run's end
        return None, type(exc).__name__
    if record.pool != name:
        return None, f"it names pool {record.pool!r}"
    return record, None
