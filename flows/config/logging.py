"""Where a run's metrics and log lines go: the console, TensorBoard, Weights & Biases."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sluiceway.flows.config.group import Group


class LoggingConfig(Group):
    run_id: str | None = Field(None, description="Run identifier (default: derived from output_dir's name).")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO",
        description="Least severe level of sluiceway's own log lines, on the terminal and in OUTPUT_DIR/sluiceway.log "
        "(other libraries' only from WARNING).",
    )
    quiet: bool = Field(False, description="Print no per-step lines.")
    tensorboard_dir: str | None = Field(
        None, description="Where TensorBoard event files go (always written; default: OUTPUT_DIR/tensorboard)."
    )
    use_wandb: bool = Field(
        False, description="Also log metrics to Weights & Biases (needs `pip install wandb`; key from WANDB_API_KEY)."
    )
    wandb_project: str | None = Field(None, description="wandb project (default: 'sluiceway').")
    wandb_team: str | None = Field(None, description="wandb entity (team or user).")
    wandb_group: str | None = Field(None, description="wandb run group.")
    wandb_host: str | None = Field(None, description="wandb server URL, for a self-hosted server.")
    wandb_mode: Literal["online", "offline", "disabled"] = Field(
        "online", description="wandb mode: 'offline' writes under OUTPUT_DIR/wandb for a later `wandb sync`."
    )
    wandb_run_id: str | None = Field(None, description="wandb run id to resume (default: a new run).")
