"""The trainer: batch sizes, optimizer and schedule, recompute, precision, the model and its checkpoints,
LoRA.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from sluiceway.flows.config.group import Group
from sluiceway.flows.config.variants import LoraPart, lora_of

# LoRA target names (peft's, all-linear, Megatron-Bridge's fused layers); models/lora.py maps them to projections
# (the config imports nothing of the project: tests/unit/models/test_lora.py checks both lists agree).
LORA_TARGET_NAMES = ("all-linear", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                     "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # fmt: skip


class TrainingConfig(Group):
    global_batch_size: int = Field(64, ge=1, description="Samples per optimizer step.")
    micro_batch_size: int = Field(16, ge=1, description="Samples per forward/backward pass.")
    num_steps_per_rollout: int = Field(1, ge=1, description="Optimizer steps per rollout step.")
    use_distributed_optimizer: bool = Field(
        False,
        description="Shard the fp32 master weights and Adam moments over the data-parallel group (ZeRO-1), so "
        "optimizer memory per rank falls as 1/DP; checkpoints stay loadable at another DP size.",
    )
    recompute_granularity: Literal["full", "selective"] | None = Field(
        None,
        description="Activation recompute (Megatron's): full recomputes whole transformer layers in backward, "
        "selective only the attention core. Less activation memory for more compute (`sluiceway plan` shows how "
        "much; docs/benchmarks.md measures it).",
    )
    recompute_method: Literal["uniform", "block"] | None = Field(
        None,
        description="With --recompute-granularity full (default uniform): uniform recomputes groups of "
        "recompute_num_layers layers; block recomputes the first recompute_num_layers layers of each stage.",
    )
    recompute_num_layers: int | None = Field(
        None, ge=1, description="With --recompute-granularity full: layers per recompute group or block (default 1)."
    )
    num_epoch: int | None = Field(
        None,
        ge=1,
        description="SFT: passes over the data set (default 1); steps = ceil(samples x num_epoch / global_batch_size).",
    )
    lr: float = Field(1e-6, gt=0.0, description="Learning rate (AdamW).")
    lr_warmup_iters: int = Field(0, ge=0, description="Optimizer steps of linear warmup from 0 to lr.")
    lr_decay_style: Literal["constant", "linear", "cosine"] = Field("constant", description="LR after warmup.")
    lr_decay_iters: int | None = Field(
        None, ge=1, description="Optimizer steps over which lr decays to min_lr (default: the whole run)."
    )
    min_lr: float = Field(0.0, ge=0.0, description="Floor of the decayed learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    adam_beta1: float = Field(
        0.9, ge=0.0, lt=1.0, description="AdamW beta1: decay rate of the running mean of the gradients."
    )
    adam_beta2: float = Field(
        0.98, ge=0.0, lt=1.0, description="AdamW beta2: decay rate of the running mean of the squared gradients."
    )
    clip_grad: float = Field(1.0, ge=0.0, description="Gradient norm clip (0 disables).")
    max_tokens_per_gpu: int | None = Field(
        None,
        ge=1,
        description="Pack samples into micro-batches of at most this many tokens (one row, samples kept apart by "
        "the attention mask) instead of micro_batch_size samples each. A longer sample gets a row of its own.",
    )
    share_prompts: bool = Field(
        True,
        description="Train the samples of one prompt in one row: the prompt once, each response attending to it "
        "and to itself (same gradient, fewer tokens: GRPO's n samples pay for their prompt once).",
    )
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto",
        description="Compute precision of the trainer, the engines and the published weights. bf16: bf16 compute "
        "over fp32 master weights. auto: bf16 where the device computes it natively and faster than fp32 (on CPU "
        "a short measured probe, cached per machine: models/precision.py), else fp32.",
    )
    bf16_weight_rounding: Literal["nearest", "stochastic"] = Field(
        "stochastic",
        description="With bf16 compute, how bf16 weights take their fp32 masters' values after each step: "
        "stochastic keeps updates below bf16's spacing (tasks/train/weight_rounding.py); nearest is megatron's. "
        "Stochastic rounds up with probability equal to the weight's position between its two bf16 neighbours, "
        "through a random threshold fixed per weight (learns as fp32 does on bench_learning). The engines get the "
        "trainer's bf16 weights either way.",
    )
    bf16: bool | None = Field(
        None, description="slime's --bf16: the same as --precision bf16 (--no-bf16: fp32). Mirrors the precision."
    )
    hf_checkpoint: str = Field(
        "tiny-llama", description="HF model directory, or a zoo name: 'smollm2-135m-instruct', 'tiny-llama'."
    )
    save_interval: int | None = Field(
        10,
        ge=1,
        description="Checkpoint every N steps (rollout, SFT or replay steps), and always after the last step; "
        "null: only after the last. A resume starts after the newest checkpoint (docs/reliability.md).",
    )
    seed: int = Field(1234, description="Seed for sampling, data order and initialisation.")
    lora_rank: int = Field(
        0,
        ge=0,
        description="LoRA: train rank-r adapters on the target projections with the base model frozen (0: full "
        "fine-tuning). Only the adapters are in the optimizer and the checkpoints; the reference of a KL loss is "
        "the base model itself (no second model). docs/lora.md.",
    )
    lora_alpha: float = Field(
        32.0, gt=0.0, description="LoRA: the adapters' output is scaled by lora_alpha / lora_rank."
    )
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA: dropout on the adapters' input (peft's).")
    target_modules: list[str] = Field(
        ["all-linear"],
        description="LoRA: projections to adapt, peft's names (q_proj k_proj v_proj o_proj gate_proj up_proj "
        "down_proj, or all-linear) or Megatron-Bridge's (linear_qkv linear_proj linear_fc1 linear_fc2).",
    )

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, v: list[str]) -> list[str]:
        unknown = [n for n in v if n not in LORA_TARGET_NAMES]
        if unknown:
            raise ValueError(f"unknown LoRA target module {unknown[0]!r} (expected: {', '.join(LORA_TARGET_NAMES)})")
        return v

    @model_validator(mode="before")
    @classmethod
    def _bf16_is_a_precision(cls, data):
        """`bf16` (slime's flag) and `precision` are one setting: a given bf16 picks the precision, a concrete
        precision sets bf16, and `auto` leaves bf16 unset until flows/precision.py's resolve_precision."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        bf16, precision = data.get("bf16"), data.get("precision", "auto")
        if isinstance(bf16, bool):
            implied = "bf16" if bf16 else "fp32"
            if precision not in ("auto", implied):
                flag = "--bf16" if bf16 else "--no-bf16"
                raise ValueError(f"{flag} contradicts precision {precision}: give one of them")
            data["precision"] = precision = implied
        if precision in ("bf16", "fp32"):
            data["bf16"] = precision == "bf16"
        return data

    @property
    def lora(self) -> LoraPart | None:
        """LoRA's part (flows/config/variants.py), None for full fine-tuning (lora_rank 0): what the trainer reads."""
        return lora_of(self)

    def check(self, context: dict) -> None:
        self._check_recompute()
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of micro_batch_size"
                f" ({self.micro_batch_size})"
            )

    def _check_recompute(self) -> None:
        """Megatron's rules for its recompute flags: a method and a layer count belong to full recompute (which
        defaults them to uniform and 1 here); selective recomputes the core attention of every layer."""
        rest = [f"recompute_{n}" for n in ("method", "num_layers") if getattr(self, f"recompute_{n}") is not None]
        if rest and self.recompute_granularity != "full":
            given = f"recompute_granularity {self.recompute_granularity}" if self.recompute_granularity else "no"
            raise ValueError(f"{' and '.join(rest)} need recompute_granularity full ({given} given)")
