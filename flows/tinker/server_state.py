"""What the Tinker server holds (flows/tinker/app.py's routes read and change it): its sessions, models and their
runners, sampler directories and sampling sessions, training-run records and who owns what, kept in memory and,
with a store, on it (the journal, saved states; storage/tinker.py); and the names and records it writes."""

from __future__ import annotations

import datetime as _dt
import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinker import types

from sluiceway.flows.tinker.access import NotFound, session_of
from sluiceway.flows.tinker.futures import (
    FutureStore,
    SequencedRunner,
    TinkerUserError,
)
from sluiceway.storage.object_store import ObjectStore

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    base_model: str  # the name the user gave (a zoo name or a directory)
    base_dir: Path  # its local HF directory
    work_dir: Path  # where sampler weights are written
    device: str = "cpu"
    store: ObjectStore | None = None  # where the journal, saved states and tables go (--store)
    server_id: str = "tinker"  # this server's name on the store (--server-id): a restart with the same one resumes
    futures: FutureStore | None = None
    sessions: dict[str, dict] = field(default_factory=dict)
    models: dict[str, Any] = field(default_factory=dict)  # model_id -> TinkerModel, once created
    runners: dict[str, SequencedRunner] = field(default_factory=dict)
    sampler_dirs: dict[str, Path] = field(default_factory=dict)  # tinker:// path -> its model directory
    sampling_sessions: dict[str, tuple[Path, str | None]] = field(default_factory=dict)  # id -> (dir, path)
    training_runs: dict[str, dict] = field(default_factory=dict)  # model_id -> its record (get_training_run)
    last_request: dict[str, _dt.datetime] = field(default_factory=dict)  # model_id -> its last request's time
    lock: threading.Lock = field(default_factory=threading.Lock)
    # asample's threads: each waits on its engine's generate, so as many as the engines' rows (Samplers.max_running)
    # run at once and the engine batches them (the cookbook sends a group's samples as separate requests at once)
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(16, thread_name_prefix="tinker"))
    samplers: Any = None
    keys: frozenset[str] | None = None  # digests of --api-keys-file's keys; None: no keys, one user (access.py)
    micro_batch_tokens: int = 1024  # token positions of a forward_backward micro-batch (--micro-batch-tokens)
    owners: dict[str, str | None] = field(default_factory=dict)  # future or sampling session id -> its key's digest

    def __post_init__(self) -> None:
        from sluiceway.flows.tinker.sampler import Samplers

        self.samplers = self.samplers or Samplers()
        if self.futures is None:
            from sluiceway.flows.tinker.journal import Journal

            self.futures = FutureStore(Journal(self.store, self.server_id) if self.store is not None else None)

    def close(self) -> None:
        for r in self.runners.values():
            r.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.samplers.close()

    def session(self, sid: str) -> dict | None:
        """A session of this server: in memory, or one a server before a restart created (from the store), so
        a client's ServiceClient carries on across a restart."""
        if sid in self.sessions:
            return self.sessions[sid]
        if self.store is None or not re.match(r"^session-[0-9a-f]{16}$", sid):
            return None
        from sluiceway.storage.tinker import read_json, server_path

        found = read_json(self.store, server_path(self.store, self.server_id, "sessions", f"{sid}.json"))
        if found is not None:
            self.sessions.setdefault(sid, found)
        return found

    def save_session(self, sid: str, session: dict) -> None:
        self.sessions[sid] = session
        if self.store is not None:
            from sluiceway.storage.tinker import server_path, write_json

            write_json(self.store, server_path(self.store, self.server_id, "sessions", f"{sid}.json"), session)

    def save_sampler_dir(self, tinker_path: str, path: Path) -> None:
        self.sampler_dirs[tinker_path] = path
        if self.store is not None:  # the directory is local (--work-dir): it outlives a restart on this machine
            from sluiceway.storage.tinker import server_path, write_json

            where = server_path(self.store, self.server_id, "sampler_weights", sampler_key(tinker_path))
            write_json(self.store, where, {"tinker_path": tinker_path, "dir": str(path)})

    def sampler_dir(self, tinker_path: str) -> Path:
        """The model directory a save_weights_for_sampler path names (one saved before a restart too)."""
        if tinker_path in self.sampler_dirs:
            return self.sampler_dirs[tinker_path]
        found = None
        if self.store is not None:
            from sluiceway.storage.tinker import read_json, server_path

            found = read_json(self.store, server_path(self.store, self.server_id, "sampler_weights",
                                                      sampler_key(tinker_path)))  # fmt: skip
        if found is None or not Path(found["dir"]).is_dir():
            raise TinkerUserError(f"unknown model_path {tinker_path!r}: give a path save_weights_for_sampler "
                                  "returned by this server (its weights are in the server's --work-dir)")  # fmt: skip
        self.sampler_dirs[tinker_path] = Path(found["dir"])
        return self.sampler_dirs[tinker_path]

    def delete_sampler_dir(self, tinker_path: str) -> bool:
        """Forget a save_weights_for_sampler path and remove its directory (an engine on it is closed); False when
        this server knows no such path."""
        import shutil

        try:
            path = self.sampler_dir(tinker_path)
        except TinkerUserError:
            return False
        self.sampler_dirs.pop(tinker_path, None)
        if self.store is not None:
            from sluiceway.storage.tinker import delete_json, server_path

            delete_json(self.store, server_path(self.store, self.server_id, "sampler_weights",
                                                sampler_key(tinker_path)))  # fmt: skip
        self.samplers.drop(path)
        if path.resolve().is_relative_to(self.work_dir.resolve()):  # only what this server wrote
            shutil.rmtree(path, ignore_errors=True)
        return True

    def training_run(self, model_id: str) -> dict | None:
        """A model's training-run record (what the REST client's get_training_run answers): in memory, or from
        the store for a model of a server before a restart (a state saved then is loaded by its model id)."""
        if model_id in self.training_runs:
            return self.training_runs[model_id]
        if self.store is None or not MODEL_ID.match(model_id):
            return None
        from sluiceway.storage.tinker import read_json, training_run_path

        found = read_json(self.store, training_run_path(self.store, self.server_id, model_id))
        if found is not None:
            self.training_runs.setdefault(model_id, found)
        return found

    def update_training_run(self, model_id: str, **changes: Any) -> None:
        """Create or change a model's training-run record, on the store too. A store that fails is logged: the
        request it belongs to (create_model, a save) still succeeds."""
        record = {**(self.training_run(model_id) or {}), **changes, "updated_at": now_iso()}
        self.training_runs[model_id] = record
        if self.store is not None:
            from sluiceway.storage.tinker import training_run_path, write_json

            try:
                write_json(self.store, training_run_path(self.store, self.server_id, model_id), record)
            except Exception:  # noqa: BLE001
                log.exception("tinker: the training run of %s could not be written to the store", model_id)

    def check_owner(self, owner: str | None, ident: str, what: str) -> None:
        """NotFound unless `ident` (a session or model id, a tinker:// path) belongs to the key `owner`; a session
        this server does not know is left to the route to call unknown."""
        if self.keys is None:
            return
        session = self.session(session_of(ident))
        if session is not None and session.get("owner") != owner:
            raise NotFound(f"unknown {what} {ident!r}")

    def own(self, item: str, owner: str | None) -> None:
        """Record who made a future or sampling session; only a server with keys asks (without, nothing is kept)."""
        if self.keys is not None:
            self.owners[item] = owner

    def check_item(self, owner: str | None, item: str, what: str) -> None:
        """NotFound unless the future or sampling session `item` was made with the key `owner` (one made before a
        restart has no owner in memory: with keys, it is unknown)."""
        if self.keys is not None and self.owners.get(item, "") != owner:
            raise NotFound(f"unknown {what} {item!r}")

    def model(self, model_id: str):
        m = self.models.get(model_id)
        if m is None:
            raise TinkerUserError(
                f"unknown model_id {model_id!r} (create it first; after a server restart, "
                "resume from a saved state: create_training_client_from_state)"
            )
        return m

    def matches_base(self, name: str | None) -> bool:
        return name is None or name == self.base_model or name == str(self.base_dir)


def sampler_key(tinker_path: str) -> str:
    """A file name for a sampler path (any string the client sends: hashed, never a path of its own)."""
    import hashlib

    return hashlib.sha256(tinker_path.encode()).hexdigest()[:32] + ".json"


MODEL_ID = re.compile(r"^[A-Za-z0-9_:\-]+$")  # a model id as this server makes them (session-<hex>:train:<n>)


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat()


def str_metadata(metadata: dict | None) -> dict[str, str] | None:
    """The user_metadata of a create_model or load (values of any JSON type) as a TrainingRun carries it
    (strings): a value that is not a string is kept as its JSON."""
    import json

    if not metadata:
        return None
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}


def checkpoint_record(tinker_path: str, user_metadata: dict | None) -> dict:
    """A saved checkpoint as the SDK's `Checkpoint` (JSON); ttl_seconds is ignored, so it never expires."""
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
    return types.Checkpoint(checkpoint_id=parsed.checkpoint_id, checkpoint_type=parsed.checkpoint_type,
                            time=_dt.datetime.now(_dt.UTC), tinker_path=tinker_path,
                            user_metadata=user_metadata).model_dump(mode="json")  # fmt: skip


STATE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")


def check_name(name: str) -> None:
    if not STATE_NAME.match(name):
        raise TinkerUserError(f"state name {name!r}: letters, digits, '_', '-' and '.' only (not first), at most 200")


def parse_state_path(path: str) -> tuple[str, str]:
    """tinker://<model_id>/weights/<name> -> (model_id, name)."""
    parts = path.removeprefix("tinker://").split("/")
    if not path.startswith("tinker://") or len(parts) != 3 or parts[1] != "weights":
        raise TinkerUserError(f"{path!r} is not a saved state's path (tinker://<model_id>/weights/<name>, what "
                              "save_state returned)")  # fmt: skip
    if not MODEL_ID.match(parts[0]):
        raise TinkerUserError(f"{path!r}: not a model id of this server")
    check_name(parts[2])
    return parts[0], parts[2]


def sample_rows(rid: str, body: dict, seqs: list, sampling_session_id: str | None, sampler_path: str) -> list[dict]:
    """One `tinker_samples` row per sampled sequence (storage/tinker.py)."""
    from sluiceway.flows.tinker.sampler import DEFAULT_MAX_TOKENS, prompt_tokens

    params = body.get("sampling_params") or {}
    prompt = prompt_tokens(body.get("prompt") or {})
    seed = params.get("seed")
    return [
        {
            "request_id": rid,
            "sequence_id": f"{rid}:{i}",
            "sample_index": i,
            "sampling_session_id": sampling_session_id,
            "sampler_path": sampler_path,
            "prompt_token_ids": prompt,
            "output_token_ids": list(s.tokens),
            "logprobs": list(s.logprobs),
            "stop_reason": s.stop_reason,
            "seed": None if seed is None else int(seed) + i,
            "temperature": float(params.get("temperature", 1.0)),
            "top_p": float(params.get("top_p", 1.0)),
            "top_k": int(params.get("top_k", -1)),
            "max_tokens": int(params.get("max_tokens") or DEFAULT_MAX_TOKENS),
        }  # fmt: skip
        for i, s in enumerate(seqs)
    ]
