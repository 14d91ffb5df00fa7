"""Where the trainer runs: device, processes, tensor/pipeline parallel sizes, a Ray cluster."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sluiceway.flows.config.group import Group


class ResourcesConfig(Group):
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="Where the trainer runs (embedded engines run on the CPU)."
    )
    actor_num_gpus_per_node: int = Field(
        1,
        ge=1,
        description="Trainer processes (one per GPU; on CPU, gloo processes). Above 1 the trainer is a torchrun "
        "group the flow drives step after step; data parallel size = this / tensor_model_parallel_size.",
    )
    trainer_launcher: Literal["auto", "in_process", "torchrun"] = Field(
        "auto",
        description="Where the trainer runs: in the flow's process, or a torchrun group. auto: in process "
        "for one process, torchrun above.",
    )
    tensor_model_parallel_size: int = Field(1, ge=1, description="Megatron tensor parallel size.")
    pipeline_model_parallel_size: int = Field(1, ge=1, description="Megatron pipeline parallel size (only 1 yet).")
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads (default: torch's choice).")
    ray_address: str | None = Field(
        None,
        description="Run the trainer ranks (and engines) as actors on this existing Ray cluster: 'auto' or "
        "HOST:PORT (docs/deploy.md). Unset: everything runs on this machine as before.",
    )
    actor_num_nodes: int = Field(
        1, ge=1, description="Ray: nodes of the trainer group; ranks = actor_num_nodes x actor_num_gpus_per_node."
    )

    def check(self, context: dict) -> None:
        """Where the trainer ranks go: a layout that cannot be placed is refused."""
        if self.actor_num_nodes > 1 and self.ray_address is None:
            raise ValueError("actor_num_nodes > 1 places the trainer on several nodes: it needs ray_address")
        if self.ray_address is not None and self.trainer_launcher != "auto":
            raise ValueError("ray_address places the trainer ranks as Ray actors: leave trainer_launcher at auto")
        if self.pipeline_model_parallel_size > 1:
            raise ValueError("pipeline_model_parallel_size > 1 is not supported yet (tensor and data parallel are)")
        if self.world_size % self.tensor_model_parallel_size:
            raise ValueError(
                f"actor_num_nodes x actor_num_gpus_per_node ({self.world_size}) must be a multiple of "
                f"tensor_model_parallel_size ({self.tensor_model_parallel_size})"
            )
        if self.world_size > 1 and self.trainer_launcher == "in_process":
            raise ValueError("trainer_launcher in_process runs one process: set actor_num_gpus_per_node 1")

    @property
    def world_size(self) -> int:
        """Trainer ranks in all."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.tensor_model_parallel_size
