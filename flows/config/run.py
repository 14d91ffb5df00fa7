"""The run config: one part per owner (flows/config/*.py), each checking its own fields; the rules between parts
and those that depend on the command (run, eval, replay, sft) are checked here.

Field names follow slime's command-line arguments where slime has one (``--rollout-batch-size`` is
``rollout.rollout_batch_size``), so a slime user's flags carry over. Every field documents itself; the CLI
is generated from these models.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field

from sluiceway.flows.config.algorithm import AlgorithmConfig
from sluiceway.flows.config.data import DataConfig
from sluiceway.flows.config.durability import DurabilityConfig
from sluiceway.flows.config.eval import EvalConfig
from sluiceway.flows.config.group import Group
from sluiceway.flows.config.logging import LoggingConfig
from sluiceway.flows.config.replay import ReplayConfig
from sluiceway.flows.config.resources import ResourcesConfig
from sluiceway.flows.config.reward import RewardConfig
from sluiceway.flows.config.rollout import RolloutConfig
from sluiceway.flows.config.storage import StorageSettings
from sluiceway.flows.config.sync import SyncConfig
from sluiceway.flows.config.training import TrainingConfig
from sluiceway.infra.prompt_sources import FILE, source_kind


class RunConfig(Group):
    resources: ResourcesConfig = Field(
        default_factory=ResourcesConfig, description="Where the trainer runs: device, processes, parallel sizes."
    )
    data: DataConfig = Field(default_factory=DataConfig, description="The prompts (or SFT samples) trained on.")
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig, description="Generation: batch sizes, sampling, schedule, engines."
    )
    reward: RewardConfig = Field(default_factory=RewardConfig, description="How a sample is scored.")
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig, description="The objective: advantages, policy loss, KL, distillation."
    )
    training: TrainingConfig = Field(
        default_factory=TrainingConfig, description="The trainer: batches, optimizer, precision, model, LoRA."
    )
    storage: StorageSettings = Field(
        default_factory=StorageSettings, description="Where tables and checkpoints live, and for how long."
    )
    sync: SyncConfig = Field(default_factory=SyncConfig, description="How new weights reach the engines.")
    durability: DurabilityConfig = Field(
        default_factory=DurabilityConfig, description="How long a stage rides out a transient failure."
    )
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation sets, schedule and sampling.")
    replay: ReplayConfig = Field(default_factory=ReplayConfig, description="`sluiceway replay`: what is replayed.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Log lines and metrics backends.")

    # Whose invariants a validation without a context checks (a flow's typed parameter, say): see EvalRunConfig.
    invariants_of: ClassVar[str] = "run"

    @property
    def eval_sets(self) -> list[tuple[str, str]]:
        """(name, source) pairs of eval_prompt_data."""
        return self.eval.sets

    @property
    def remote_pools(self) -> list[tuple[str, str]]:
        """rollout_pools' fixed pools as (name, router URL) pairs."""
        return self.rollout.remote_pools

    @property
    def pool_registry_uris(self) -> list[str]:
        """The weight stores whose pool registries the run reads (`auto`: its own weight store)."""
        return list(dict.fromkeys(self.weights_uri if u == "auto" else u for u in self.rollout.pool_registries))

    @property
    def has_own_engines(self) -> bool:
        """Whether the run starts or attaches engines of its own (else only remote pools generate)."""
        r = self.rollout
        return r.rollout_num_engines > 0 or bool(r.rollout_external_engine_addrs)

    def check(self, context: dict) -> None:
        """The rules between parts (each part checked its own fields before), for the context's command."""
        # Which command the config is for (validation context, see validate_for): replay trains from a stored
        # table and eval only samples, so neither needs prompt_data; plan only sizes a layout (no data).
        command = context.get("command", self.invariants_of)
        self._check_placement()
        if self.algorithm.loss_type == "sft_loss":
            self._check_sft()  # the rollout and reward settings play no part in SFT
            return
        r, t, a = self.rollout, self.training, self.algorithm
        if command == "replay" and not self.replay.replay_run_id:
            raise ValueError("replay needs replay_run_id (--replay-run-id RUN: the stored run to train from)")
        if command == "eval" and not self.eval.eval_prompt_data:
            raise ValueError("eval needs eval_prompt_data (--eval-prompt-data FILE or env:NAME, or NAME SOURCE pairs)")
        if t.num_epoch is not None or self.data.response_key is not None:
            raise ValueError("num_epoch and response_key apply to `sluiceway sft` only; RL runs num_rollout steps")
        produced = r.rollout_batch_size * r.n_samples_per_prompt
        consumed = t.global_batch_size * t.num_steps_per_rollout
        if produced != consumed:
            raise ValueError(
                f"rollout_batch_size x n_samples_per_prompt ({r.rollout_batch_size} x {r.n_samples_per_prompt}"
                f" = {produced}) must equal global_batch_size x num_steps_per_rollout"
                f" ({t.global_batch_size} x {t.num_steps_per_rollout} = {consumed})"
            )
        if a.advantage_estimator in ("grpo", "dr_grpo", "gspo", "rloo") and r.n_samples_per_prompt < 2:
            raise ValueError("GRPO needs n_samples_per_prompt >= 2 (advantages are relative to the group)")
        if a.num_critic_only_steps >= r.num_rollout:
            raise ValueError(
                f"num_critic_only_steps ({a.num_critic_only_steps}) must be < num_rollout ({r.num_rollout}),"
                " else the policy never trains"
            )
        if a.use_opd and a.opd_type == "sglang" and a.opd_teacher_url is None and a.opd_teacher_load is None:
            if command == "run":  # a replay reads the stored teacher log-probs; eval needs no teacher
                raise ValueError("opd_type sglang needs a teacher: opd_teacher_url (a running engine) or "
                                 "opd_teacher_load (an HF directory the run serves)")  # fmt: skip
        if r.rollout_num_engines == 0 and not r.rollout_external_engine_addrs and not r.rollout_pools:
            raise ValueError("no engines: set rollout_num_engines >= 1, rollout_external_engine_addrs or rollout_pools")
        if not self.has_own_engines and command == "run" and self.eval.eval_interval:
            raise ValueError("eval_interval needs the run's own engines (rollout_num_engines >= 1): with "
                             "rollout_num_engines 0 only remote pools generate, and only training groups")  # fmt: skip
        if r.rollout_pools and self.sync.update_weight_mode != "delta":
            raise ValueError(
                "rollout_pools need update_weight_mode delta: remote pools get weights only from the weight store"
            )
        self._check_data_parallel()
        if self.data.prompt_data is None and command == "run":
            raise ValueError("data.prompt_data is required (--prompt-data FILE or env:NAME)")

    def _check_sft(self) -> None:
        kind = source_kind(self.data.prompt_data)
        if kind != FILE:  # an environment (env:, verifiers:, openenv:) has episodes, not responses to imitate
            got = f": {self.data.prompt_data} is an environment ({kind}:), not a file" if kind else ""
            raise ValueError(f"SFT needs a JSONL or Parquet data file (--prompt-data FILE){got}")
        self._check_data_parallel()
        if self.algorithm.use_kl_loss or self.eval.eval_interval:
            raise ValueError("SFT has no KL loss and no evaluation yet: unset use_kl_loss and eval_interval")

    def _check_placement(self) -> None:
        """Where the engines go: SGLang engines placed on GPUs need the Ray cluster the trainer is placed on."""
        r = self.rollout
        if r.rollout_num_gpus is not None and (self.resources.ray_address is None or r.rollout_engine != "sglang"):
            raise ValueError("rollout_num_gpus places SGLang engines on a Ray cluster: it needs ray_address and "
                             "rollout_engine sglang (embedded engines: rollout_num_engines)")  # fmt: skip

    def _check_data_parallel(self) -> None:
        t, dp = self.training, self.resources.data_parallel_size
        if dp > 1 and not t.max_tokens_per_gpu and t.global_batch_size % (t.micro_batch_size * dp):
            raise ValueError(
                f"global_batch_size ({t.global_batch_size}) must be a multiple of micro_batch_size x data parallel"
                f" size ({t.micro_batch_size} x {dp}), so every data-parallel rank gets whole micro-batches"
            )

    @property
    def run_id(self) -> str:
        return self.logging.run_id or Path(self.storage.output_dir).resolve().name

    @property
    def tables_uri(self) -> str:
        return self.storage.storage_uri or str(Path(self.storage.output_dir).resolve() / "tables")

    @property
    def weights_uri(self) -> str:
        """The weight store of update_weight_mode delta (OUTPUT_DIR/weights holds the local HF directories)."""
        if self.sync.weights_uri:
            return self.sync.weights_uri
        if self.storage.storage_uri:
            return self.storage.storage_uri.rstrip("/") + f"/weights/{self.run_id}"
        return str(Path(self.storage.output_dir).resolve() / "weight_store")


class EvalRunConfig(RunConfig):
    """The run config checked as `sluiceway eval` checks it (eval sets required, no prompt data): the eval flow's
    parameter type, so its deployment's form in the Prefect UI is the typed config, as the RL flow's is."""

    invariants_of: ClassVar[str] = "eval"


class ReplayRunConfig(RunConfig):
    """The run config checked as `sluiceway replay` checks it (a stored run to replay, no prompt data)."""

    invariants_of: ClassVar[str] = "replay"


def validate_for(config: RunConfig | dict, command: str) -> RunConfig:
    """`config` checked with the invariants of `command`: run (the default), replay or eval."""
    data = config.model_dump(mode="json") if isinstance(config, RunConfig) else config
    return RunConfig.model_validate(data, context={"command": command})
