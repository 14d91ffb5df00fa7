"""How long a stage rides out a transient failure (engine, HTTP, S3) before the run fails."""

from __future__ import annotations

from pydantic import Field

from sluiceway.flows.config.group import Group


class DurabilityConfig(Group):
    stage_retries: int | None = Field(
        None,
        ge=0,
        description="Retries of a stage that failed for a transient reason (engine, HTTP, S3, commit race); default: "
        "as many as fit in retry_budget_s.",
    )
    retry_backoff_s: float = Field(
        2.0,
        ge=0.0,
        le=30.0,  # the cap of every wait: a longer first delay would mean nothing
        description="First retry delay; each further retry waits twice as long (exponential backoff), at most 30 s.",
    )
    retry_budget_s: float = Field(
        90.0,
        ge=0.0,
        description="How long a stage keeps retrying a transient failure when stage_retries is not given: the "
        "retry delays add up to at least this, so an object store or engine down for this long is ridden out (keep it "
        "under the run lease's 150 s, storage/run_lock.py, which a run that cannot reach its store loses).",
    )
