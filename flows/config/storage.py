"""Where a run's tables, checkpoints and Prefect home live, and how long tables keep old versions."""

from __future__ import annotations

from pydantic import Field

from sluiceway.flows.config.group import Group


class StorageSettings(Group):
    output_dir: str = Field("runs/default", description="Run directory: local tables, checkpoints, Prefect home.")
    storage_uri: str | None = Field(
        None,
        description="Where tables live: a local path or s3://bucket/prefix (default: OUTPUT_DIR/tables). "
        "S3 endpoint and credentials come from AWS_* environment variables, never from here.",
    )
    s3_endpoint_url: str | None = Field(None, description="S3 endpoint (else AWS_ENDPOINT_URL).")
    s3_region: str | None = Field(None, description="S3 region (else AWS_REGION, default us-east-1).")
    retention_hours: float = Field(
        24.0,
        ge=0,
        description="Replay retention: a table version stays replayable (time travel, `sluiceway replay "
        "--replay-version`) for at least this many hours after it was committed; upkeep then drops older log "
        "entries and the data files only they read (docs/storage.md).",
    )
    idempotency_hours: float = Field(
        1.0,
        gt=0,
        description="How long a table remembers the id of each idempotent write, so a retried stage does not "
        "write twice; ids are looked up on every append, so fewer kept means cheaper appends (docs/storage.md).",
    )
    maintenance_interval: int = Field(
        50,
        ge=0,
        description="Table upkeep every N steps (compaction, log checkpoint, log cleanup and vacuum within the "
        "retention), so storage costs stay flat over a long run; 0 turns it off.",
    )
