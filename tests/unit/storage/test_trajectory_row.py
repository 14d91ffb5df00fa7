"""The one typed sample: TrajectoryRow mirrors the table schema; one definition of finished and trainable."""

import datetime as dt
import typing

import pyarrow as pa

from sluiceway.storage.trajectories import (
    ABORTED,
    COMPLETED,
    STATUSES,
    TRAJECTORY_SCHEMA,
    TRUNCATED,
    TrajectoryRow,
    group_rows,
    is_finished,
    is_trainable,
)

ARROW_TO_PY = {pa.string(): str, pa.int64(): int, pa.float64(): float, pa.timestamp("us", tz="UTC"): dt.datetime}


def test_trajectory_row_has_the_tables_fields_and_types():
    hints = typing.get_type_hints(TrajectoryRow)
    assert list(hints) == TRAJECTORY_SCHEMA.names
    for f in TRAJECTORY_SCHEMA:
        hint = hints[f.name]
        if pa.types.is_list(f.type):
            if f.nullable:  # list[X] | None
                hint, none = typing.get_args(hint)
                assert none is type(None), f.name
            assert typing.get_origin(hint) is list, f.name
        else:
            want = ARROW_TO_PY[f.type]
            assert hint == (want | None if f.nullable else want), f.name


def row(group_id: int, status: str = COMPLETED, filter_reason: str | None = None) -> dict:
    return {"group_id": group_id, "status": status, "filter_reason": filter_reason}


def test_finished_and_trainable():
    assert STATUSES == ("completed", "truncated", "aborted", "failed")
    assert is_finished(row(0)) and is_finished(row(0, TRUNCATED)) and not is_finished(row(0, ABORTED))
    assert is_trainable(row(0, TRUNCATED))
    assert not is_trainable(row(0, filter_reason="zero_std")) and not is_trainable(row(0, ABORTED))


def test_group_rows_keeps_arrival_order():
    rows = [row(2), row(0), row(2, TRUNCATED), row(1)]
    groups = group_rows(rows)
    assert list(groups) == [2, 0, 1] and groups[2] == [rows[0], rows[2]]
