"""How each new weight version reaches the engines: the run's own, and remote pools through the weight store."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sluiceway.flows.config.group import Group


class SyncConfig(Group):
    sync_mode: Literal["disk"] = Field(
        "disk",
        description="How new weights reach the run's own engines: 'disk' writes HF safetensors under the run "
        "directory and calls each engine's /update_weights_from_disk.",
    )
    update_weight_mode: Literal["full", "delta"] = Field(
        "full",
        description="full: only the run's own engines get each version (from the run directory). delta: each "
        "version is also published to the weight store (weights_uri) as a full copy or a lossless delta, for "
        "remote pools whose agents pull it (`sluiceway pools up`, docs/weight_sync.md); the run's own engines "
        "still load the local directory.",
    )
    update_weights_interval: int = Field(
        1,
        ge=1,
        description="Sync weights every N rollout steps (and after the last); engines serve older weights in "
        "between, which the trajectories' weight_version records.",
    )
    weights_uri: str | None = Field(
        None,
        description="update_weight_mode delta: where the weight store lives, a local path or s3://bucket/prefix "
        "(default: STORAGE_URI/weights/RUN_ID, or OUTPUT_DIR/weight_store without storage_uri).",
    )
    weights_full_every: int = Field(
        10, ge=1, description="update_weight_mode delta: a full version every N versions (bounds the delta chain)."
    )
    weights_keep: int = Field(
        3, ge=1, description="update_weight_mode delta: newest versions kept on the weight store."
    )
    lora_sync: Literal["adapter", "merged"] = Field(
        "adapter",
        description="With --lora-rank: what each weight version is. adapter: the adapter alone (peft's "
        "adapter_model.safetensors + adapter_config.json; the embedded engine merges it into its base weights on "
        "load, SGLang loads it with /load_lora_adapter), a few MB per version; merged: full weights with the "
        "adapter folded in, for engines without LoRA.",
    )
