"""Offline replay: a stored run's trajectories, at one Delta version of the table, as per-step training batches.

The plain code behind `flows/replay.py` (no Prefect, no engine). Delta time travel pins the buffer: the rows,
rewards and filter marks are what the table held at that version, however much it has grown since. A step's
advantages are computed again from its stored rewards with the configured estimator; the stored rollout
log-probs travel with each sample as the behaviour policy's.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from deltalake.exceptions import DeltaError

from sluiceway.infra.errors import UserError
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.tables import open_table, read_table, table_exists
from sluiceway.storage.trajectories import COMPLETED, TRAJECTORIES, TRUNCATED, read_trajectories
from sluiceway.tasks.train.batch import build_train_samples, rollout_metrics
from sluiceway.tasks.train.samples import TrainSample


@dataclass(frozen=True)
class ReplaySource:
    """What a replay reads: one run's rows in one store, at one table version, these steps in this order."""

    store: ObjectStore
    run_id: str
    version: int
    steps: list[int]


def resolve_version(store: ObjectStore, version: int | None = None, timestamp: _dt.datetime | None = None) -> int:
    """The trajectories table version to read: `version`, the last commit at or before `timestamp`, or the latest."""
    uri = store.table_uri(TRAJECTORIES)
    if not table_exists(store, TRAJECTORIES):
        raise UserError(f"replay: no trajectories table at {uri}")
    dt = open_table(store, TRAJECTORIES)
    latest = dt.version()
    if version is not None:
        if version > latest:
            raise UserError(f"--replay-version {version}: the trajectories table at {uri} has versions up to {latest}")
        return version
    if timestamp is None:
        return latest
    ts = timestamp if timestamp.tzinfo else timestamp.replace(tzinfo=_dt.UTC)
    ts_ms = (ts - _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)) // _dt.timedelta(milliseconds=1)
    # Resolved from the commits' own timestamps (what `history()` shows), not with deltalake's
    # load_as_version(datetime): that one compares against the log files' modification times, which on a loaded
    # machine can fall a millisecond after the commit's timestamp, so the moment of a commit read the one before.
    # deltalake also answers version 0 for a time before the table existed; that would replay rows that were not
    # there yet, so say so instead.
    history = [(h["timestamp"], h["version"]) for h in dt.history()]
    at_or_before = [v for when, v in history if when <= ts_ms]
    if not at_or_before:
        first = _dt.datetime.fromtimestamp(min(when for when, _ in history) / 1000, _dt.UTC)
        raise UserError(f"--replay-timestamp {ts.isoformat()}: before the first commit of {uri} ({first.isoformat()})")
    return max(at_or_before)


def open_source(
    store: ObjectStore,
    run_id: str,
    version: int | None = None,
    timestamp: _dt.datetime | None = None,
    steps: list[int] | None = None,
) -> ReplaySource:
    """Check that `run_id` has replayable steps at that version; every user mistake is one UserError line."""
    v = resolve_version(store, version, timestamp)
    where = f"{store.table_uri(TRAJECTORIES)} at version {v}"
    try:
        cols = read_table(
            store, TRAJECTORIES, version=v, filters=[("run_id", "=", run_id)],
            columns=["step", "reward", "status", "filter_reason"],
        )  # fmt: skip
    except (DeltaError, OSError) as e:  # its log entries or data files were cleaned up (storage/maintenance.py)
        raise UserError(not_replayable(store, v, e)) from None
    stored = sorted(set(cols.column("step").to_pylist()))
    if not stored:
        raise UserError(f"--replay-run-id {run_id}: no trajectories of that run in {where}")
    chosen = stored if steps is None else list(dict.fromkeys(int(s) for s in steps))
    missing = [s for s in chosen if s not in stored]
    if missing:
        raise UserError(f"--replay-steps: {missing} not stored for run {run_id} in {where} (stored: {stored})")
    # A version taken mid-step can hold rows not scored yet: their group's advantages are unknown.
    # storage/trajectories.is_trainable as an Arrow expression (the columns only, no row dicts).
    usable = pc.is_in(cols.column("status"), pa.array([COMPLETED, TRUNCATED]))
    trainable = pc.and_(usable, pc.is_null(cols.column("filter_reason")))
    unscored = cols.filter(pc.and_(trainable, pc.is_null(cols.column("reward"))))
    bad = sorted(set(unscored.column("step").to_pylist()) & set(chosen))
    if bad:
        raise UserError(
            f"replay: step {bad[0]} of run {run_id} has unscored samples in {where} (a version taken mid-step); "
            "pick a later version or leave the step out with --replay-steps"
        )
    return ReplaySource(store, run_id, v, chosen)


def not_replayable(store: ObjectStore, version: int, error: Exception) -> str:
    """The one line for a version that table upkeep has cleaned up (or that cannot be read for another reason)."""
    uri = store.table_uri(TRAJECTORIES)
    dt = open_table(store, TRAJECTORIES)
    kept = dt.metadata().configuration.get("delta.logRetentionDuration")
    if kept is None:
        return f"--replay-version {version}: cannot read {uri} ({error})"
    return (
        f"--replay-version {version}: no longer replayable from {uri}: upkeep keeps versions for "
        f"storage.retention_hours ({kept}) and removed this one; pick a later version (the latest is {dt.version()})"
    )


def step_batch(
    source: ReplaySource, step: int, estimator: str, normalize_by_std: bool
) -> tuple[list[TrainSample], dict[str, float]]:
    """One stored step as training samples (advantages recomputed) and its rollout metrics."""
    table = read_trajectories(source.store, source.run_id, step, version=source.version)
    return build_train_samples(table, estimator, normalize_by_std), rollout_metrics(table)


def replay_batches(
    source: ReplaySource, estimator: str, normalize_by_std: bool
) -> Iterator[tuple[int, list[TrainSample]]]:
    """(step, samples) for every step of `source`, in order, one step read at a time."""
    for step in source.steps:
        yield step, step_batch(source, step, estimator, normalize_by_std)[0]
