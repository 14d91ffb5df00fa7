"""`sluiceway replay`: which stored run, table version and steps are trained on again."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from sluiceway.flows.config.group import Group


class ReplayConfig(Group):
    replay_run_id: str | None = Field(
        None, description="`sluiceway replay`: the stored run whose trajectories are trained on again."
    )
    replay_tables: str | None = Field(
        None,
        description="`sluiceway replay`: where that run's tables are, a local path or s3://bucket/prefix "
        "(default: this run's tables, storage_uri or OUTPUT_DIR/tables).",
    )
    replay_version: int | None = Field(
        None,
        ge=0,
        description="`sluiceway replay`: the Delta version of the trajectories table to read (default: "
        "the latest when the replay starts; a resumed replay keeps the version it started with).",
    )
    replay_timestamp: datetime | None = Field(
        None,
        description="`sluiceway replay`: read the trajectories table as of this time (ISO 8601, UTC when no zone "
        "is given) instead of replay_version.",
    )
    replay_steps: list[int] | None = Field(
        None, description="`sluiceway replay`: only these stored steps (default: every stored step, in order)."
    )

    def check(self, context: dict) -> None:
        if self.replay_version is not None and self.replay_timestamp is not None:
            raise ValueError("replay_version and replay_timestamp both pick the table version: give one")
