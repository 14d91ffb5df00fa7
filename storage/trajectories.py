"""The trajectories table: one row per sample, the buffer between rollout and training.

Partitioned by ``run_id``; every data file holds one step, or one block of finished steps once upkeep has
compacted them (`compact_steps`), and a step's rows are found from the files' ``step`` statistics, so reading
or rewarding a step touches that step's files alone while the table's file count stays bounded over a long
run. (Tables made before this partitioned by ``run_id`` and ``step``; they are read and written the same way.)
Token ids and log-probs are stored exactly as the engine produced them (token-in, token-out). Rows are
validated before they are written: a malformed row in the buffer would surface steps later in the trainer.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from typing import Any, TypedDict

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import WriterProperties, write_deltalake

from sluiceway.storage import handles
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.tables import (
    WRITE_LOCK,
    append_idempotent,
    append_idempotent_many,
    conform,
    open_table,
    read_table,
    replace_where,
    scan,
    sql_literal,
    table_exists,
    table_schema,
)

TRAJECTORIES = "trajectories"
PARTITION_BY = ["run_id"]
# Finished steps are compacted in blocks of this many: a block's file has one row group per step.
STEP_BLOCK = 100
# A sample's status: finished by a stop token or string, cut at the length limit, aborted (over-sampling surplus
# or a partial rollout to continue), or failed (the engine gave no usable answer).
COMPLETED, TRUNCATED, ABORTED, FAILED = STATUSES = ("completed", "truncated", "aborted", "failed")
SORT_KEYS = [("step", "ascending"), ("group_id", "ascending"), ("sample_index", "ascending")]

TRAJECTORY_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("group_id", pa.int64(), nullable=False),  # the prompt instance; GRPO groups share it
        pa.field("sample_index", pa.int64(), nullable=False),  # sample within the group
        pa.field("prompt_id", pa.string(), nullable=False),  # dataset row the prompt came from
        pa.field("prompt", pa.string(), nullable=False),  # rendered prompt text (after the chat template)
        pa.field("label", pa.string()),
        pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_text", pa.string(), nullable=False),
        pa.field("rollout_logprobs", pa.list_(pa.float32()), nullable=False),  # per response token, or empty
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),  # per response token: 1 = trained on
        pa.field("reward", pa.float64()),  # null until scored
        pa.field("reward_details", pa.string()),  # JSON from the verifier / reward model
        pa.field("status", pa.string(), nullable=False),  # one of STATUSES
        pa.field("finish_reason", pa.string(), nullable=False),  # engine's reason (stop, length, abort, ...)
        pa.field("weight_version", pa.int64(), nullable=False),  # version at the end of generation
        # every version the tokens came from (a partial rollout spans weight updates)
        pa.field("weight_versions", pa.list_(pa.int64()), nullable=False),
        pa.field("engine", pa.string(), nullable=False),
        pa.field("pool", pa.string(), nullable=False),
        pa.field("gen_time_s", pa.float64(), nullable=False),
        pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("metadata", pa.string(), nullable=False),  # JSON object
        # null: the group is trained on; else why not ("surplus" beyond the step's need, a filter's name, ...)
        pa.field("filter_reason", pa.string()),
        # On-policy distillation: the teacher's log-prob of each response token (null: not scored). Added after
        # the tables above existed: an older table gets the column on its first write (`_evolve`).
        pa.field("teacher_logprobs", pa.list_(pa.float32())),
    ]
)
# Nullable columns added to the schema over time: a table made before one of them reads it as nulls.
ADDED_COLUMNS = ("teacher_logprobs",)


class TrajectoryRow(TypedDict):
    """One sample as every stage sees it, from the rollout that builds it to the batch that trains on it; the
    table's own field names and types (TRAJECTORY_SCHEMA, which a test keeps in step with this)."""

    run_id: str
    step: int
    group_id: int
    sample_index: int
    prompt_id: str
    prompt: str
    label: str | None
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_text: str
    rollout_logprobs: list[float]
    loss_mask: list[int]
    reward: float | None
    reward_details: str | None
    status: str  # one of STATUSES
    finish_reason: str
    weight_version: int
    weight_versions: list[int]
    engine: str
    pool: str
    gen_time_s: float
    created_at: _dt.datetime
    metadata: str
    filter_reason: str | None
    teacher_logprobs: list[float] | None


def is_finished(row: TrajectoryRow) -> bool:
    """Generation ended (completed, truncated or failed): the group is not cut short; an aborted one waits."""
    return row["status"] != ABORTED


# A row "retried" was left by an earlier attempt of its step that trained nothing: the step generated its prompt
# again under a new group id (tasks/rollout/rollout.py `Rollout.run`); the old rows stay as they were, for the record.
RETRIED = "retried"


def is_usable(row: TrajectoryRow) -> bool:
    """A sample training can take: completed or truncated. A failed one never is (its parts disagree, or what made
    it failed: the reason is in its metadata), nor an aborted one (it waits to be continued)."""
    return row["status"] in (COMPLETED, TRUNCATED)


# The largest magnitude a reward may have: the advantages and the loss are computed in float32, where a larger
# finite reward (1e308, say) becomes inf and every loss of the step NaN.
MAX_REWARD = 3.4028234663852886e38  # float32's largest finite value


def reward_problem(reward: float) -> str | None:
    """Why training cannot hold `reward` ("non-finite reward nan", "reward 1e+308 beyond float32's range ..."), or
    None: checked where a reward comes in and on what is stored."""
    try:
        value = float(reward)
    except OverflowError:  # an int of hundreds of digits
        value = None
    if value is not None and not math.isfinite(value):
        return f"non-finite reward {reward!r}"
    if value is not None and abs(value) <= MAX_REWARD:
        return None
    text = repr(reward)
    shown = text if len(text) <= 40 else f"{text[:12]}... ({len(text)} digits)"
    return f"reward {shown} beyond float32's range (training computes in float32)"


def trainable_reward(reward: float) -> bool:
    """A reward training can hold (`reward_problem` says why not)."""
    return reward_problem(reward) is None


def row_failure(row: TrajectoryRow) -> str | None:
    """Why a sample was aborted or failed, as it recorded it (`abort_reason` or `failure_reason` in its metadata)."""
    try:
        meta = json.loads(row.get("metadata") or "{}")
    except ValueError:
        return None
    if not isinstance(meta, dict):
        return None
    return meta.get("abort_reason") or meta.get("failure_reason")


def is_trainable(row: TrajectoryRow) -> bool:
    """The one definition of "trained on": completed or truncated (`is_usable`), and its group kept by every filter
    (no filter_reason). tasks/train/replay.py writes the same rule as an Arrow expression."""
    return is_usable(row) and row.get("filter_reason") is None


def group_rows(rows: list[TrajectoryRow]) -> dict[int, list[TrajectoryRow]]:
    """A step's rows by group (prompt instance), in the order they came."""
    groups: dict[int, list[TrajectoryRow]] = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r)
    return groups


# Fields a caller may leave out of a row dict, and what they become.
_ROW_DEFAULTS: dict[str, Any] = {
    "label": None,
    "reward": None,
    "reward_details": None,
    "metadata": "{}",
    "filter_reason": None,
    "teacher_logprobs": None,
}
_JSON_FIELDS = ("reward_details", "metadata")


def append_trajectories(store: ObjectStore, rows: list[dict[str, Any]] | pa.Table, app_id: str) -> bool:
    """Validate and append one batch of samples; False when a batch with ``app_id`` was already written.

    Row dicts may omit ``label``, ``reward``, ``reward_details``, ``filter_reason`` (null), ``metadata`` (``"{}"``) and
    ``created_at`` (now); ``metadata`` and ``reward_details`` may be dicts (stored as JSON). Raises
    ValueError naming the row and field when a row does not fit :data:`TRAJECTORY_SCHEMA`.
    """
    table = rows if isinstance(rows, pa.Table) else _rows_to_table(rows)
    if table.num_rows == 0:
        raise ValueError("append_trajectories: no rows")
    table = conform(table, TRAJECTORY_SCHEMA, what="trajectory")
    validate_trajectories(table)
    _evolve(store)
    return append_idempotent(store, TRAJECTORIES, table, app_id=app_id, partition_by=PARTITION_BY)


def append_trajectory_groups(store: ObjectStore, groups: list[tuple[list[dict[str, Any]], str]]) -> list[bool]:
    """`append_trajectories` for several (rows, app_id) batches in one Delta commit; per batch, whether it was new."""
    items = []
    for rows, app_id in groups:
        table = conform(_rows_to_table(rows), TRAJECTORY_SCHEMA, what="trajectory")
        validate_trajectories(table)
        items.append((table, app_id))
    _evolve(store)
    return append_idempotent_many(store, TRAJECTORIES, items, partition_by=PARTITION_BY)


def read_trajectories(store: ObjectStore, run_id: str, step: int | None = None, version: int | None = None) -> pa.Table:
    """Samples of ``run_id`` (one step, or all; at Delta ``version`` for time travel), sorted by step, group,
    sample; typed as TRAJECTORY_SCHEMA.

    The latest rows of one step come from the step cache while the step's files are unchanged: reward, filter
    and train read the step the stage before them wrote, and pay for the read once.
    """
    if not table_exists(store, TRAJECTORIES):
        return TRAJECTORY_SCHEMA.empty_table()
    if step is None or version is not None:
        return _typed(read_table(store, TRAJECTORIES, version=version, filters=_partition_filter(run_id, step)))
    h = handles.handle(store, TRAJECTORIES)
    with h.lock:
        dataset = _step_dataset(h, run_id, step)
        files = frozenset(f.path for f in dataset.get_fragments())
        hit = _step_cache(h).get((run_id, int(step)))
        if hit is not None and hit[0] == files:
            return hit[1]
        with store.redacting():
            table = _typed(dataset.to_table(filter=pq.filters_to_expression(_partition_filter(run_id, step))))
        _remember(h, run_id, step, files, table)
        return table


def existing_group_ids(store: ObjectStore, run_id: str, step: int) -> set[int]:
    """Groups already stored for a step: a resumed rollout generates only the missing ones."""
    return set(read_trajectories(store, run_id, step).column("group_id").to_pylist())


def update_samples(
    store: ObjectStore, run_id: str, step: int, keys: list[tuple[int, int]], columns: dict[str, pa.Array], what: str
) -> int:
    """Set `columns` on the samples `keys` = [(group_id, sample_index)] of one step.

    The step's rows are updated in memory and written back in place of the old ones in one commit
    (tables.replace_where); rows whose values already match are left alone, and an update that changes
    nothing commits nothing. Returns the number of rows changed. Every key must exist (an update for an
    unknown sample is a bug upstream, not something to drop).
    """
    if not keys:
        return 0
    keys = [(int(g), int(i)) for g, i in keys]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{what}: duplicate (group_id, sample_index) keys for {run_id} step {step}")
    with WRITE_LOCK:
        _evolve(store)
        current = read_trajectories(store, run_id, step)
        where = {
            k: n
            for n, k in enumerate(
                zip(current.column("group_id").to_pylist(), current.column("sample_index").to_pylist(), strict=True)
            )
        }
        missing = [k for k in keys if k not in where]
        if missing:
            raise ValueError(
                f"{what}: {len(missing)} (group_id, sample_index) keys not stored for {run_id} step {step}, "
                f"e.g. {missing[:3]}"
            )
        changed_rows: set[int] = set()
        updated = current
        for name, values in columns.items():
            column = current.column(name).to_pylist()
            for k, value in zip(keys, values.to_pylist(), strict=True):
                row = where[k]
                if not _same(column[row], value):
                    column[row] = value
                    changed_rows.add(row)
            field = TRAJECTORY_SCHEMA.field(name)
            updated = updated.set_column(updated.schema.get_field_index(name), field, pa.array(column, field.type))
        if not changed_rows:
            return 0
        replace_where(store, TRAJECTORIES, {"run_id": run_id, "step": int(step)}, updated)
        # What this commit wrote is what the next stage reads: keep it under the step's new files.
        h = handles.handle(store, TRAJECTORIES)
        with h.lock:  # the handle is at our commit already (the write advanced it; WRITE_LOCK is held)
            files = frozenset(f.path for f in _step_dataset(h, run_id, step, refresh=False).get_fragments())
            _remember(h, run_id, step, files, updated)
    return len(changed_rows)


def set_rewards(
    store: ObjectStore,
    run_id: str,
    step: int,
    rewards: list[tuple[int, int, float, str | None]],
) -> int:
    """Set ``reward`` and ``reward_details`` for ``(group_id, sample_index, reward, details)`` of one step.

    A reward must be a number training can hold (`trainable_reward`) or None: the reward stage makes any other the
    sample's failure (tasks/reward/score.py), and this refuses any that gets past it, naming the sample."""
    for g, i, r, _ in rewards:
        problem = None if r is None else reward_problem(r)
        if problem is not None:
            raise ValueError(f"set_rewards: {problem} for {run_id} step {step} (group {g}, sample {i})")
    columns = {
        "reward": pa.array([None if r is None else float(r) for _, _, r, _ in rewards], pa.float64()),
        "reward_details": pa.array([_json_text(d, "reward_details") for _, _, _, d in rewards], pa.string()),
    }
    return update_samples(store, run_id, step, [(g, i) for g, i, _, _ in rewards], columns, "set_rewards")


def set_teacher_logprobs(store: ObjectStore, run_id: str, step: int, scored: list[tuple[int, int, list[float]]]) -> int:
    """Store the teacher's per-response-token log-probs of ``(group_id, sample_index, logprobs)`` of one step."""
    columns = {"teacher_logprobs": pa.array([list(lp) for _, _, lp in scored], pa.list_(pa.float32()))}
    return update_samples(store, run_id, step, [(g, i) for g, i, _ in scored], columns, "set_teacher_logprobs")


def set_filter_reasons(store: ObjectStore, run_id: str, step: int, reasons: list[tuple[int, int, str | None]]) -> int:
    """Mark samples as dropped from training (reason) or kept (None); dropped rows stay in the table."""
    columns = {"filter_reason": pa.array([r for _, _, r in reasons], pa.string())}
    return update_samples(store, run_id, step, [(g, i) for g, i, _ in reasons], columns, "set_filter_reasons")


def compact_steps(store: ObjectStore, run_id: str, done_before: int, block_steps: int = STEP_BLOCK) -> int:
    """Rewrite each complete block of ``block_steps`` steps below ``done_before`` that is spread over several
    files as one file (sorted, one row group per step); returns the number of files replaced.

    Only steps whose stages are all done may be passed (the flow passes the step it just trained + 1): a
    block is rewritten in one commit whose predicate covers the block's steps only, so appends and rewrites of
    later steps, and readers of any version, are unaffected; a retried or interrupted compaction changes nothing.
    """
    if not table_exists(store, TRAJECTORIES):
        return 0
    replaced = 0
    _evolve(store)
    with WRITE_LOCK, store.redacting():
        dt = open_table(store, TRAJECTORIES)
        if "step" in dt.metadata().partition_columns:
            return 0  # the older layout: a partition per step, which `optimize` compacts within
        actions = pa.table(dt.get_add_actions(flatten=True))
        actions = actions.filter(pc.equal(actions.column("partition.run_id"), run_id))
        files_in: dict[int, int] = {}
        for lo, hi in zip(actions.column("min.step").to_pylist(), actions.column("max.step").to_pylist(), strict=True):
            if lo is None or hi is None or lo // block_steps != hi // block_steps:
                continue  # no statistics, or already spanning blocks: leave it
            block = lo // block_steps
            if (block + 1) * block_steps <= done_before:
                files_in[block] = files_in.get(block, 0) + 1
        for block, n in sorted(files_in.items()):
            if n < 2:
                continue
            lo, hi = block * block_steps, (block + 1) * block_steps
            rows = _typed(scan(dt, [("run_id", "=", run_id), ("step", ">=", lo), ("step", "<", hi)]))
            steps = len(pc.unique(rows.column("step")))
            predicate = f"run_id = {sql_literal(run_id)} AND step >= {lo} AND step < {hi}"
            write_deltalake(
                dt,
                conform(rows, table_schema(dt), what=TRAJECTORIES),
                mode="overwrite",
                predicate=predicate,
                writer_properties=WriterProperties(max_row_group_size=max(1, -(-rows.num_rows // steps))),
            )
            replaced += n
    return replaced


def validate_trajectories(table: pa.Table) -> None:
    """Checks the schema cannot express: status values, finite rewards, per-token lengths, unique keys (run after
    conform)."""
    bad_status = pc.invert(pc.is_in(table.column("status"), value_set=pa.array(STATUSES)))
    if pc.any(bad_status).as_py():
        row = _first(bad_status)
        raise ValueError(
            f"trajectory row {row}{_key(table, row)}: status {table.column('status')[row].as_py()!r}; "
            f"expected one of {list(STATUSES)}"
        )
    reward = table.column("reward")
    beyond = pc.greater(pc.abs(reward), MAX_REWARD)  # finite, but not in float32 (`reward_problem`)
    bad_reward = pc.fill_null(pc.or_(pc.invert(pc.is_finite(reward)), beyond), False)  # null: not scored yet, fine
    if pc.any(bad_reward).as_py():
        row = _first(bad_reward)
        raise ValueError(
            f"trajectory row {row}{_key(table, row)}: reward {reward[row].as_py()!r} is not a finite number "
            f"in float32's range (a failed score is reward 0 with its reason in reward_details)"
        )
    n_resp = pc.list_value_length(table.column("response_token_ids"))
    for name, may_be_empty in (("loss_mask", False), ("rollout_logprobs", True), ("teacher_logprobs", True)):
        n = pc.list_value_length(table.column(name))
        bad = pc.fill_null(pc.not_equal(n, n_resp), False)  # a null list (teacher_logprobs not scored) is fine
        if may_be_empty:
            bad = pc.and_(bad, pc.not_equal(n, 0))
        if pc.any(bad).as_py():
            row = _first(bad)
            raise ValueError(
                f"trajectory row {row}{_key(table, row)}: {name!r} has {n[row].as_py()} entries for "
                f"{n_resp[row].as_py()} response tokens; expected one per response token"
                + (" (or none)" if may_be_empty else "")
            )
    keys = table.group_by(["run_id", "step", "group_id", "sample_index"]).aggregate([([], "count_all")])
    dup = pc.greater(keys.column("count_all"), 1)
    if pc.any(dup).as_py():
        r = keys.filter(dup).slice(0, 1).to_pylist()[0]
        raise ValueError(
            f"trajectories: key (run_id={r['run_id']!r}, step={r['step']}, group_id={r['group_id']}, "
            f"sample_index={r['sample_index']}) appears {r['count_all']} times in one batch"
        )


# -- helpers ---------------------------------------------------------------------------------------------------


def _rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Row dicts to a table, with errors that name the row and the field (pyarrow's name neither)."""
    names = set(TRAJECTORY_SCHEMA.names)
    now = _dt.datetime.now(_dt.UTC)
    prepared = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise TypeError(f"trajectory row {i}: expected a dict, got {type(row).__name__}")
        unknown = sorted(set(row) - names)
        if unknown:
            raise ValueError(f"trajectory row {i}: unknown fields {unknown}")
        full = {**_ROW_DEFAULTS, "created_at": now, **row}
        missing = [n for n in TRAJECTORY_SCHEMA.names if n not in full]
        if missing:
            raise ValueError(f"trajectory row {i}: missing fields {missing}")
        for name in _JSON_FIELDS:
            full[name] = _json_text(full[name], name)
        prepared.append(full)
    columns = []
    for field in TRAJECTORY_SCHEMA:
        values = [r[field.name] for r in prepared]
        try:
            columns.append(pa.array(values, type=field.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
            for i, v in enumerate(values):  # find the row that does not fit
                try:
                    pa.array([v], type=field.type)
                except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
                    raise ValueError(
                        f"trajectory row {i}: field {field.name!r} = {_short(v)} does not fit {field.type}"
                    ) from None
            raise ValueError(f"trajectories: field {field.name!r} does not fit {field.type}: {exc}") from None
    return pa.Table.from_arrays(columns, schema=TRAJECTORY_SCHEMA)


def _json_text(value: Any, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: not JSON-serializable ({exc})") from None


# How many recent steps the step cache keeps per table (the stages of one step, and async rollout's next one).
STEP_CACHE_SIZE = 4


def _typed(table: pa.Table) -> pa.Table:
    for name in ADDED_COLUMNS:  # a table (or an old version of one) from before the column: nulls
        if name not in table.column_names:
            field = TRAJECTORY_SCHEMA.field(name)
            table = table.append_column(field, pa.nulls(table.num_rows, field.type))
    return table.select(TRAJECTORY_SCHEMA.names).cast(TRAJECTORY_SCHEMA).sort_by(SORT_KEYS)


def _evolve(store: ObjectStore) -> None:
    """Add the ADDED_COLUMNS an existing table lacks (nullable, so its old rows read as nulls), before a write:
    appends, in-place updates and compaction all write the schema of TRAJECTORY_SCHEMA. Old table versions stay
    readable (time travel reads them with the schema they had; `_typed` adds the nulls). Checked once per handle."""
    if not table_exists(store, TRAJECTORIES):
        return
    h = handles.handle(store, TRAJECTORIES)
    if h.views.get("evolved"):
        return
    with WRITE_LOCK, store.redacting():
        dt = h.latest()
        missing = [TRAJECTORY_SCHEMA.field(n) for n in ADDED_COLUMNS if n not in table_schema(dt).names]
        if missing:
            from deltalake.schema import Field as DeltaField

            dt.alter.add_columns([DeltaField.from_arrow(f) for f in missing])
            h.latest()
        h.views["evolved"] = True


def _step_dataset(h: handles.Handle, run_id: str, step: int, refresh: bool = True):
    """The step's files at the newest version, pruned while the log is replayed (no file opened yet)."""
    with h.store.redacting():
        dt = h.latest() if refresh else h.table
        return dt.to_pyarrow_dataset(file_pruning_predicate=_partition_filter(run_id, step))


def _step_cache(h: handles.Handle) -> dict[tuple[str, int], tuple[frozenset[str], pa.Table]]:
    # Kept on the handle so it lives and dies with it; valid only while the step's set of files is the same
    # (a commit that touches the step replaces or adds a file). Assumes one process writes a given step.
    return h.views.setdefault("steps", {})


def _remember(h: handles.Handle, run_id: str, step: int, files: frozenset[str], table: pa.Table) -> None:
    cache = _step_cache(h)
    cache.pop((run_id, int(step)), None)
    cache[(run_id, int(step))] = (files, table)
    while len(cache) > STEP_CACHE_SIZE:
        cache.pop(next(iter(cache)))


def _same(a: Any, b: Any) -> bool:
    """SQL's NOT DISTINCT: equal, or both null (or both NaN)."""
    return a == b or (a is None and b is None) or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


def _partition_filter(run_id: str, step: int | None) -> list[tuple[str, str, Any]]:
    filters: list[tuple[str, str, Any]] = [("run_id", "=", run_id)]
    if step is not None:
        filters.append(("step", "=", int(step)))
    return filters


def _first(mask: pa.ChunkedArray | pa.Array) -> int:
    return pc.index(mask, True).as_py()


def _key(table: pa.Table, row: int) -> str:
    try:
        g, s = table.column("group_id")[row].as_py(), table.column("sample_index")[row].as_py()
    except IndexError:
        return ""
    return f" (group {g}, sample {s})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
