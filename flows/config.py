"""The run config: one pydantic object, grouped by concern, loadable from YAML.

Field names follow slime's command-line arguments where slime has one (``--rollout-batch-size`` is
``rollout.rollout_batch_size``), so a slime user's flags carry over. Every field documents itself; the CLI
is generated from these models (see ``flows/cli.py``).
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from sluiceway.infra.errors import UserError
from sluiceway.infra.plugins import check_function

# LoRA target names (peft's, all-linear, Megatron-Bridge's fused layers); models/lora.py maps them to projections
# (the config imports nothing of the project: tests/unit/models/test_lora.py checks both lists agree).
LORA_TARGET_NAMES = ("all-linear", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                     "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # fmt: skip


class _Group(BaseModel):
    # Unknown keys in YAML are mistakes (a typo silently ignored is a lost setting). No setting means anything
    # as inf or NaN (an infinite backoff or retention overflows later, an infinite lr trains NaNs).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _check_scalars(cls, value):
        # Seeds, steps and sizes end up in torch and in int64 table columns: a larger number is a typo that
        # would fail there, after the engines started, rather than here. No path or name holds a NUL byte.
        for v in value if isinstance(value, list) else [value]:
            if type(v) is int and not -(2**63) <= v < 2**63:
                raise ValueError("must fit in a signed 64-bit integer")
            if isinstance(v, str) and "\x00" in v:
                raise ValueError("must not contain a NUL byte")
        return value


class ResourcesConfig(_Group):
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


class DataConfig(_Group):
    prompt_data: str | None = Field(
        None,
        description="JSONL or Parquet file of prompts (slime format), or 'env:NAME' for a procedural environment.",
    )
    input_key: str = Field("input", description="Field holding the prompt: plain text or a list of chat messages.")
    label_key: str | None = Field("label", description="Field holding the reference answer.")
    metadata_key: str = Field("metadata", description="Optional field holding per-sample metadata (a dict).")
    response_key: str | None = Field(
        None,
        description="SFT: field holding the response to the prompt under input_key. Unset: input_key holds "
        "whole conversations (lists of messages) whose assistant turns are trained.",
    )
    sft_max_len: int = Field(2048, ge=2, description="SFT: most tokens per sample; longer ones are an error.")
    sft_truncate: bool = Field(False, description="SFT: cut samples longer than sft_max_len instead of stopping.")
    apply_chat_template: bool = Field(False, description="Wrap prompts with the tokenizer's chat template.")
    system_prompt: str | None = Field(None, description="System message prepended when applying the chat template.")
    env_size: int = Field(512, ge=1, description="Number of prompts generated for an 'env:NAME' dataset.")
    adaptive_difficulty: bool = Field(
        False,
        description="With an env: prompt source, generate each step's prompts at levels that rise when "
        "recent accuracy passes difficulty_raise_above and fall below difficulty_lower_below.",
    )
    difficulty_raise_above: float = Field(0.8, gt=0.0, le=1.0, description="Accuracy that raises a level.")
    difficulty_lower_below: float = Field(0.2, ge=0.0, lt=1.0, description="Accuracy that lowers a level.")
    difficulty_window: int = Field(64, ge=1, description="Recent samples per environment that accuracy covers.")
    difficulty_min_samples: int = Field(32, ge=1, description="Samples at a level before it may change.")


class RolloutConfig(_Group):
    mode: Literal["sync", "one-step-off", "fully-async"] = Field(
        "sync",
        description="sync: generate, then train, each step. one-step-off: generate step k+1 while training step "
        "k (every sample one weight version behind). fully-async: keep generating up to max_staleness steps "
        "ahead (default 2) while the trainer consumes steps, pushing new weights to the engines as they come.",
    )
    rollout_batch_size: int = Field(8, ge=1, description="Prompts per rollout step.")
    n_samples_per_prompt: int = Field(8, ge=1, description="Samples per prompt (the GRPO group size).")
    num_rollout: int = Field(10, ge=1, description="Number of rollout steps in the run.")
    rollout_max_response_len: int = Field(32, ge=1, description="Maximum new tokens per response.")
    rollout_max_prompt_len: int = Field(256, ge=1, description="Prompts longer than this (in tokens) are an error.")
    rollout_temperature: float = Field(0.7, gt=0.0, description="Sampling temperature.")
    rollout_top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold.")
    rollout_max_concurrency: int = Field(64, ge=1, description="Generate requests in flight at once, over all engines.")
    over_sampling_batch_size: int | None = Field(
        None,
        ge=1,
        description="Groups submitted per step (>= rollout_batch_size); the rest are aborted once "
        "rollout_batch_size groups have finished. Default: rollout_batch_size.",
    )
    partial_rollout: bool = Field(
        False, description="Continue aborted groups in the next step from their partial tokens (APRIL)."
    )
    mask_offpolicy_in_partial_rollout: bool = Field(
        False, description="Leave the tokens a partial rollout got from older weights out of the loss."
    )
    custom_generate_function_path: str | None = Field(
        None,
        description="'module:fn' or 'file.py:fn': an async function driving multi-turn generation "
        "(see tasks/rollout/multiturn.py).",
    )
    agent_function_path: str | None = Field(
        None,
        description="'module:fn' or 'file.py:fn': your agent, fn(base_url, api_key, prompt) (sync or async), run "
        "once per sample against the run's OpenAI-compatible, token-recording endpoint instead of the default "
        "generate; it returns a reward or None (see docs/agents.md). Imported when the config is read.",
    )

    @field_validator("agent_function_path")
    @classmethod
    def _load_agent_function(cls, path: str | None) -> str | None:
        """An agent that does not import is one line when the config is read, not a failure mid-rollout."""
        if path is not None:
            check_function(path, "--agent-function-path", ("base_url", "api_key", "prompt"))
        return path

    dynamic_sampling_filter_path: str | None = Field(
        None,
        description="Drop groups at rollout time and over-sample until enough pass: 'zero_std' (DAPO), "
        "'truncated', or 'module:fn' returning keep (True) or a drop reason.",
    )
    max_staleness: int | None = Field(
        None, ge=0, description="Drop groups with tokens from weights more than N versions behind the trainer."
    )
    filter_truncated: bool = Field(False, description="Drop groups with a response that hit the length limit.")
    filter_overlong_len: int | None = Field(
        None, ge=1, description="Drop groups with a response longer than this many tokens."
    )
    rollout_engine: Literal["embedded", "sglang"] = Field(
        "embedded", description="What serves generation: sluiceway's embedded CPU engine, or SGLang servers (GPU)."
    )
    rollout_num_gpus_per_engine: int = Field(1, ge=1, description="SGLang: GPUs (tensor parallel size) per engine.")
    rollout_num_gpus: int | None = Field(
        None,
        ge=1,
        description="SGLang on a Ray cluster (--ray-address): GPUs for the engines in all, placed as "
        "rollout_num_gpus / rollout_num_gpus_per_engine engine actors (default: rollout_num_engines engines).",
    )
    sglang_server_args: list[str] | None = Field(
        None, description="Extra SGLang server flags; on the command line write --sglang-X VALUE for --X VALUE."
    )
    rollout_num_engines: int = Field(1, ge=0, description="Embedded engines to start behind the router.")
    rollout_external_engine_addrs: list[str] | None = Field(
        None, description="URLs of engines someone else runs (SGLang servers or `sluiceway engine`) to attach."
    )
    engine_max_running_requests: int = Field(64, ge=1, description="Sequences each embedded engine decodes at once.")
    engine_num_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads of each embedded engine. Default: the CPU's cores (resources.num_threads if "
        "set) shared out evenly over rollout_num_engines, at least 1 each. Several engines of few threads overlap "
        "each other's single-threaded work (SmolLM2, 32 requests on 2 cores: two 1-thread engines 1.9 s, one "
        "2-thread engine 3.6 s in bf16; fp32 3.0 vs 3.7 s), but each holds its own weights and reloads them.",
    )
    rollout_pools: list[str] | None = Field(
        None,
        description="Remote pools that take groups beside the run's own engines, as NAME=ROUTER_URL (e.g. "
        "east=http://10.0.0.5:30000). Their agents pull each weight version from the weight store and report "
        "there what they serve (needs update_weight_mode delta); a pool gets groups only while its version is "
        "fresh enough for the step (docs/weight_sync.md). Each takes up to rollout_max_concurrency requests.",
    )


class RewardConfig(_Group):
    rm_type: str = Field(
        "math",
        description="Built-in scorer: math, exact, regex, f1, choice, format, math+format, code (sandboxed "
        "execution against the label's tests), env (the verifier of the environment that made the prompt), remote.",
    )
    rm_url: str | None = Field(None, description="--rm-type remote: the reward-model server's URL.")
    rm_api_key_env: str | None = Field(
        None, description="--rm-type remote: name of the environment variable holding its API key (never logged)."
    )
    custom_rm_path: str | None = Field(
        None, description="'module.path:function' or 'file.py:function' scoring one sample (overrides rm_type)."
    )
    group_rm: bool = Field(
        False, description="custom_rm_path scores a whole group at once: fn(responses, labels, samples) -> rewards."
    )
    reward_key: str | None = Field(
        None, description="When a scorer returns a dict of values, the key that is the reward (the rest is kept)."
    )
    reward_timeout_s: float = Field(30.0, gt=0, description="A sample whose scorer takes longer gets reward 0.")
    length_penalty_budget: int | None = Field(
        None,
        ge=0,
        description="Length shaping: the reward is scaled down linearly for responses longer than "
        "this many tokens, reaching 0 at budget + length_penalty_window.",
    )
    length_penalty_window: int = Field(256, ge=1, description="Tokens over the budget at which the reward is 0.")


class AlgorithmConfig(_Group):
    advantage_estimator: Literal[
        "grpo", "dr_grpo", "gspo", "rloo", "reinforce_plus_plus_baseline", "ppo", "reinforce_plus_plus"
    ] = Field(
        "grpo",
        description="How rewards become per-token advantages. Per sample, broadcast over the response: grpo, "
        "dr_grpo, gspo, rloo (leave-one-out baseline: r_i - mean of the group's other rewards), "
        "reinforce_plus_plus_baseline. Per token, whitened over the batch's response tokens: ppo "
        "(GAE with a critic) and reinforce_plus_plus (discounted KL-shaped returns, no critic).",
    )
    normalize_advantages_by_std: bool = Field(
        True, description="GRPO: divide by the group's reward std (grpo and gspo only; rloo never divides)."
    )
    policy_loss: Literal["ppo_clip", "cispo", "sapo"] = Field(
        "ppo_clip",
        description="The policy-gradient surrogate. ppo_clip: PPO's clipped ratio (GSPO's sequence ratio with "
        "advantage_estimator gspo); cispo (MiniMax-M1): -sg[clip(ratio, 1 - eps_clip, 1 + eps_clip_high)] x A x "
        "logprob, the clipped weight carries no gradient (eps_clip >= 1: no lower bound, the paper's setting); "
        "sapo (soft adaptive policy optimization): -A x (4/tau) x sigmoid(tau x (ratio - 1)), a smooth gate "
        "instead of the clip, tau = sapo_tau_pos where A > 0, sapo_tau_neg elsewhere.",
    )
    sapo_tau_pos: float = Field(1.0, gt=0.0, description="sapo: gate temperature for positive advantages.")
    sapo_tau_neg: float = Field(
        1.05, gt=0.0, description="sapo: gate temperature for negative advantages (larger: a narrower gate)."
    )
    eps_clip: float = Field(0.2, gt=0.0, description="PPO clip range (lower); cispo: the IS weight's lower clip.")
    eps_clip_high: float | None = Field(
        None, gt=0.0, description="PPO clip range (upper); cispo: the IS weight's upper clip; default eps_clip."
    )
    eps_clip_c: float | None = Field(
        None,
        gt=1.0,
        description="Dual clip (Ye et al. 2020): bound the loss of negative-advantage tokens at -A x eps_clip_c.",
    )
    use_tis: bool = Field(
        False,
        description="Truncated importance sampling: weight each token by exp(old - rollout log-prob), "
        "clipped, to correct the training-inference mismatch.",
    )
    tis_clip: float = Field(
        2.0, gt=0.0, description="Upper clip of the TIS weight; icepop and mis: the band's upper bound."
    )
    tis_clip_low: float | None = Field(
        None,
        ge=0.0,
        description="Lower clip of the TIS weight (default none); icepop and mis: the band's lower bound "
        "(default 1 / tis_clip).",
    )
    tis_mode: Literal["truncate", "icepop", "mis"] = Field(
        "truncate",
        description="With use_tis, how the ratio exp(old - rollout log-prob) corrects the loss. truncate: TIS, "
        "the weight clamp(ratio, tis_clip_low, tis_clip); icepop (Ant Group's IcePop, slime's icepop_function): "
        "a token whose ratio lies outside [tis_clip_low, tis_clip] is masked out (weight 0), the others keep the "
        "ratio as weight; mis (sequence-level masked IS, slime's geometric level in mask mode): the same on each "
        "sequence's geometric-mean ratio, a whole sequence masked or weighted by it (give a narrow band, e.g. "
        "--tis-clip 1.01).",
    )
    custom_tis_function_path: str | None = Field(
        None,
        description="With use_tis, your correction instead of tis_mode's: 'module:fn' or 'file.py:fn', "
        "fn(old_logp, rollout_logp, mask, algorithm) -> weights [b, t] or (weights, {name: per-token tensor}), "
        "the named values logged as token means 'train/tis_NAME'. Imported when the config is read.",
    )

    @field_validator("custom_tis_function_path")
    @classmethod
    def _load_tis_function(cls, path: str | None) -> str | None:
        """The function must import and take (old_logp, rollout_logp, mask, algorithm): a mistake is one line
        when the config is read, not an exception in the trainer after the engines started."""
        if path is not None:
            check_function(path, "--custom-tis-function-path", ("old_logp", "rollout_logp", "mask", "algorithm"))
        return path

    use_kl_loss: bool = Field(False, description="Add a KL(policy || reference) loss term.")
    kl_loss_coef: float = Field(0.0, ge=0.0, description="Weight of the KL loss term.")
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = Field("low_var_kl", description="KL estimator.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Weight of the entropy bonus.")
    use_opd: bool = Field(
        False,
        description="On-policy distillation: a teacher scores the student's sampled tokens and each trained "
        "token's advantage becomes A - opd_kl_coef x (student log-prob - teacher log-prob), the per-token reverse "
        "KL (docs/distillation.md). With a zero task reward it is pure distillation. As slime's --use-opd: the same "
        "per-token term and coefficient, and the same advantages for grpo, dr_grpo, gspo and rloo; for the whitened "
        "estimators (ppo, reinforce_plus_plus, reinforce_plus_plus_baseline) the term is added after the batch "
        "whitening here and before it in slime (docs/algorithms.md).",
    )
    opd_type: Literal["sglang", "megatron"] | None = Field(
        None,
        description="use_opd: sglang: a teacher engine (opd_teacher_url, or an embedded engine the run starts on "
        "opd_teacher_load) scores each sample once after its rollout, into the trajectories' teacher_logprobs "
        "column (replay and resume read it back); megatron: a frozen megatron-core teacher from opd_teacher_load "
        "in the trainer, as the reference model.",
    )
    opd_kl_coef: float = Field(1.0, ge=0.0, description="use_opd: weight of the reverse KL in the advantage.")
    opd_teacher_load: str | None = Field(
        None,
        description="use_opd: the teacher model (HF directory or zoo name; the student's vocabulary). megatron: "
        "loaded into the trainer; sglang: served by an embedded engine the run starts on loopback.",
    )
    opd_teacher_url: str | None = Field(
        None,
        description="opd_type sglang: URL of a running teacher engine or router (SGLang, `sluiceway engine`, "
        "sglang-router) instead of opd_teacher_load.",
    )
    kl_coef: float = Field(
        0.0,
        ge=0.0,
        description="ppo / reinforce_plus_plus: reward-side KL, each response token's reward minus kl_coef x "
        "KL(policy || reference) (estimator: kl_loss_type); 0 needs no reference model.",
    )
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="ppo / reinforce_plus_plus: per-token discount.")
    lambd: float = Field(1.0, ge=0.0, le=1.0, description="ppo: GAE lambda (1: Monte-Carlo returns minus values).")
    value_clip: float | None = Field(
        0.2, gt=0.0, description="ppo: clip of the critic's value change per rollout in the value loss (null: none)."
    )
    critic_lr: float | None = Field(None, gt=0.0, description="ppo: critic learning rate (default: lr).")
    num_critic_only_steps: int = Field(
        0, ge=0, description="ppo: the first N rollout steps train the critic only (the policy waits)."
    )
    loss_agg_mode: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean",
        description="token_mean: every trained token weighs the same (DAPO); seq_mean_token_mean: "
        "every sequence weighs the same (the GRPO paper); seq_mean_token_sum_norm: token sums over the constant "
        "rollout_max_response_len (Dr. GRPO).",
    )
    loss_type: Literal["policy_loss", "sft_loss"] = Field(
        "policy_loss", description="policy_loss: the RL objective (`sluiceway run`); sft_loss: `sluiceway sft`."
    )


class TrainingConfig(_Group):
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
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.98, ge=0.0, lt=1.0)
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
        "a short measured probe, cached per machine: infra/precision.py), else fp32.",
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


class StorageSettings(_Group):
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


class SyncConfig(_Group):
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


class DurabilityConfig(_Group):
    stage_retries: int | None = Field(
        None,
        ge=0,
        description="Retries of a stage that failed for a transient reason (engine, HTTP, S3, commit race); default: "
        "as many as fit in retry_budget_s.",
    )
    retry_backoff_s: float = Field(
        2.0,
        ge=0.0,
        description="First retry delay; each further retry waits twice as long (exponential backoff), at most 30 s.",
    )
    retry_budget_s: float = Field(
        90.0,
        ge=0.0,
        description="How long a stage keeps retrying a transient failure when stage_retries is not given: the "
        "retry delays add up to at least this, so an object store or engine down for this long is ridden out (keep it "
        "under the run lease's 150 s, storage/run_lock.py, which a run that cannot reach its store loses).",
    )


class EvalConfig(_Group):
    eval_interval: int | None = Field(None, ge=1, description="Evaluate every N rollout steps.")
    eval_prompt_data: list[str] | None = Field(
        None,
        description="Evaluation sets as NAME SOURCE pairs (repeatable: --eval-prompt-data gsm data/gsm.jsonl "
        "arith env:arithmetic:3); a lone SOURCE is named 'eval'. SOURCE is a prompt file or env:NAME.",
    )
    n_samples_per_eval_prompt: int = Field(
        1, ge=1, description="Samples per evaluation prompt; pass@k is reported for k = 1, 2, 4, ... up to it."
    )
    eval_size: int = Field(32, ge=1, description="Prompts evaluated (taken from the head of the eval data).")
    eval_temperature: float | None = Field(
        None, ge=0.0, description="Sampling temperature of evaluation; 0 is greedy (default: rollout_temperature)."
    )
    eval_top_p: float | None = Field(
        None, gt=0.0, le=1.0, description="Nucleus sampling threshold of evaluation (default: rollout_top_p)."
    )
    eval_max_response_len: int | None = Field(
        None, ge=1, description="Maximum new tokens per evaluation response (default: rollout_max_response_len)."
    )


class ReplayConfig(_Group):
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


class LoggingConfig(_Group):
    run_id: str | None = Field(None, description="Run identifier (default: derived from output_dir's name).")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO")
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


class RunConfig(_Group):
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    storage: StorageSettings = Field(default_factory=StorageSettings)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    durability: DurabilityConfig = Field(default_factory=DurabilityConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    # Whose invariants a validation without a context checks (a flow's typed parameter, say): see EvalRunConfig.
    invariants_of: ClassVar[str] = "run"

    @property
    def eval_sets(self) -> list[tuple[str, str]]:
        """(name, source) pairs of eval_prompt_data."""
        items = self.eval.eval_prompt_data or []
        if len(items) == 1:
            return [("eval", items[0])]
        return list(zip(items[0::2], items[1::2]))

    def _check_placement(self) -> None:
        """Where the trainer ranks and the engines go: a layout that cannot be placed is refused."""
        res = self.resources
        if res.actor_num_nodes > 1 and res.ray_address is None:
            raise ValueError("actor_num_nodes > 1 places the trainer on several nodes: it needs ray_address")
        if res.ray_address is not None and res.trainer_launcher != "auto":
            raise ValueError("ray_address places the trainer ranks as Ray actors: leave trainer_launcher at auto")
        r = self.rollout
        if r.rollout_num_gpus is not None:
            if res.ray_address is None or r.rollout_engine != "sglang":
                raise ValueError("rollout_num_gpus places SGLang engines on a Ray cluster: it needs ray_address and "
                                 "rollout_engine sglang (embedded engines: rollout_num_engines)")  # fmt: skip
            if r.rollout_num_gpus % r.rollout_num_gpus_per_engine:
                raise ValueError(f"rollout_num_gpus ({r.rollout_num_gpus}) must be a multiple of "
                                 f"rollout_num_gpus_per_engine ({r.rollout_num_gpus_per_engine})")  # fmt: skip

    def _check_tis(self) -> None:
        """tis_mode and custom_tis_function_path choose use_tis's correction; the bounds must leave a band."""
        a = self.algorithm
        if not a.use_tis and (a.tis_mode != "truncate" or a.custom_tis_function_path):
            what = "custom_tis_function_path" if a.custom_tis_function_path else f"tis_mode {a.tis_mode}"
            raise ValueError(f"{what} corrects the loss only with use_tis: add --use-tis")
        if a.custom_tis_function_path and a.tis_mode != "truncate":
            raise ValueError(f"custom_tis_function_path replaces tis_mode {a.tis_mode}: give one of them")
        low = a.tis_clip_low if a.tis_clip_low is not None or a.tis_mode == "truncate" else 1.0 / a.tis_clip
        if low is not None and low > a.tis_clip:
            raise ValueError(f"the TIS lower bound {low:g} is above tis_clip {a.tis_clip:g}")

    @model_validator(mode="after")
    def _check_invariants(self, info: ValidationInfo) -> RunConfig:
        if (info.context or {}).get("fields_only"):
            return self  # one source's own values (build_config): the invariants are checked on the merge
        r, t = self.rollout, self.training
        # Which command the config is for (validation context, see validate_for): replay trains from a stored
        # table and eval only samples, so neither needs prompt_data; plan only sizes a layout (no data).
        command = (info.context or {}).get("command", self.invariants_of)
        self._check_recompute()
        self._check_placement()
        if self.algorithm.loss_type == "sft_loss":
            return self._check_sft_invariants()  # the rollout and reward settings play no part in SFT
        rp = self.replay
        if rp.replay_version is not None and rp.replay_timestamp is not None:
            raise ValueError("replay_version and replay_timestamp both pick the table version: give one")
        if command == "replay" and not rp.replay_run_id:
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
        if t.global_batch_size % t.micro_batch_size:
            raise ValueError(
                f"global_batch_size ({t.global_batch_size}) must be a multiple of micro_batch_size"
                f" ({t.micro_batch_size})"
            )
        if self.algorithm.advantage_estimator in ("grpo", "dr_grpo", "gspo", "rloo") and r.n_samples_per_prompt < 2:
            raise ValueError("GRPO needs n_samples_per_prompt >= 2 (advantages are relative to the group)")
        a = self.algorithm
        if a.policy_loss != "ppo_clip" and (a.advantage_estimator == "gspo" or a.eps_clip_c is not None):
            raise ValueError(f"policy_loss {a.policy_loss} replaces the PPO clip: gspo and eps_clip_c need ppo_clip")
        self._check_tis()
        token_level = a.advantage_estimator in ("ppo", "reinforce_plus_plus")
        if a.kl_coef > 0 and not token_level:
            raise ValueError(
                f"kl_coef (reward-side KL) applies to ppo and reinforce_plus_plus, not {a.advantage_estimator}:"
                " use --use-kl-loss --kl-loss-coef"
            )
        if a.advantage_estimator != "ppo" and (a.critic_lr is not None or a.num_critic_only_steps):
            raise ValueError("critic_lr and num_critic_only_steps need advantage_estimator ppo (the only critic)")
        if a.num_critic_only_steps >= r.num_rollout:
            raise ValueError(
                f"num_critic_only_steps ({a.num_critic_only_steps}) must be < num_rollout ({r.num_rollout}),"
                " else the policy never trains"
            )
        if self.algorithm.use_kl_loss and self.algorithm.kl_loss_coef == 0.0:
            raise ValueError("use_kl_loss is set but kl_loss_coef is 0: set --kl-loss-coef")
        self._check_opd(command)
        if r.over_sampling_batch_size is not None and r.over_sampling_batch_size < r.rollout_batch_size:
            raise ValueError(
                f"over_sampling_batch_size ({r.over_sampling_batch_size}) must be >= rollout_batch_size"
                f" ({r.rollout_batch_size})"
            )
        if self.reward.rm_type == "remote" and not self.reward.rm_url:
            raise ValueError("rm_type remote needs rm_url (--rm-url http://host:port/score)")
        if r.partial_rollout and r.custom_generate_function_path:
            raise ValueError("partial_rollout cannot continue custom (multi-turn) generations: use one or the other")
        if r.agent_function_path and r.custom_generate_function_path:
            raise ValueError("agent_function_path and custom_generate_function_path both replace the generate")
        if r.partial_rollout and r.agent_function_path:
            raise ValueError("partial_rollout cannot continue agent sessions: use one or the other")
        if r.rollout_num_engines == 0 and not r.rollout_external_engine_addrs:
            raise ValueError("no engines: set rollout_num_engines >= 1 or rollout_external_engine_addrs")
        self.remote_pools  # noqa: B018 - parses and checks each NAME=URL
        if r.rollout_pools and self.sync.update_weight_mode != "delta":
            raise ValueError(
                "rollout_pools need update_weight_mode delta: remote pools get weights only from the weight store"
            )
        self._check_parallel()
        if self.data.prompt_data is None and command == "run":
            raise ValueError("data.prompt_data is required (--prompt-data FILE or env:NAME)")
        if self.data.adaptive_difficulty and not (self.data.prompt_data or "").startswith("env:"):
            raise ValueError("adaptive_difficulty needs an environment as prompt_data (env:NAME or env:mix(...))")
        ev = self.eval.eval_prompt_data or []
        if len(ev) > 1 and len(ev) % 2:
            raise ValueError("eval_prompt_data takes NAME SOURCE pairs (or one SOURCE)")
        if len(ev) > 1 and len({n for n, _ in self.eval_sets}) != len(self.eval_sets):
            raise ValueError("eval_prompt_data: each evaluation set needs its own NAME")
        if self.eval.eval_interval and not self.eval.eval_prompt_data:
            raise ValueError("eval_interval is set but eval_prompt_data is not (--eval-prompt-data FILE or env:NAME)")
        return self

    def _check_sft_invariants(self) -> RunConfig:
        t, d = self.training, self.data
        if t.global_batch_size % t.micro_batch_size:
            raise ValueError(
                f"global_batch_size ({t.global_batch_size}) must be a multiple of micro_batch_size"
                f" ({t.micro_batch_size})"
            )
        if d.prompt_data is None or d.prompt_data.startswith("env:"):
            raise ValueError("SFT needs a JSONL or Parquet data file (--prompt-data FILE)")
        self._check_parallel()
        if self.algorithm.use_kl_loss or self.eval.eval_interval:
            raise ValueError("SFT has no KL loss and no evaluation yet: unset use_kl_loss and eval_interval")
        return self

    def _check_opd(self, command: str) -> None:
        """On-policy distillation: which teacher, where (a replay reads the stored teacher log-probs)."""
        a = self.algorithm
        given = [f for f in ("opd_type", "opd_teacher_load", "opd_teacher_url") if getattr(a, f) is not None]
        if not a.use_opd:
            if given:
                what = " and ".join(given)
                raise ValueError(f"{what} set(s) up on-policy distillation: also set use_opd (--use-opd)")
            return
        if a.opd_type is None:
            raise ValueError("use_opd needs opd_type (--opd-type sglang: a teacher engine; megatron: in the trainer)")
        if a.opd_type == "megatron":
            if a.opd_teacher_url is not None:
                raise ValueError("opd_type megatron loads the teacher into the trainer: give opd_teacher_load, "
                                 "not opd_teacher_url (that is opd_type sglang)")  # fmt: skip
            if a.opd_teacher_load is None:
                raise ValueError("opd_type megatron needs opd_teacher_load (the teacher's HF directory)")
            return
        if a.opd_teacher_url is not None and a.opd_teacher_load is not None:
            raise ValueError("opd_type sglang: give opd_teacher_url (a running teacher) or opd_teacher_load (the "
                             "run starts one), not both")  # fmt: skip
        if a.opd_teacher_url is None and a.opd_teacher_load is None and command == "run":
            raise ValueError("opd_type sglang needs a teacher: opd_teacher_url (a running engine) or opd_teacher_load "
                             "(an HF directory the run serves)")  # fmt: skip
        if a.opd_teacher_url is not None and not re.match(r"https?://[^/\s]+", a.opd_teacher_url):
            raise ValueError(f"opd_teacher_url: {a.opd_teacher_url!r} is not http://HOST:PORT")

    def _check_recompute(self) -> None:
        """Megatron's rules for its recompute flags: a method and a layer count belong to full recompute (which
        defaults them to uniform and 1 here); selective recomputes the core attention of every layer."""
        t = self.training
        rest = [f"recompute_{n}" for n in ("method", "num_layers") if getattr(t, f"recompute_{n}") is not None]
        if rest and t.recompute_granularity != "full":
            given = f"recompute_granularity {t.recompute_granularity}" if t.recompute_granularity else "no"
            raise ValueError(f"{' and '.join(rest)} need recompute_granularity full ({given} given)")

    def _check_parallel(self) -> None:
        res, t = self.resources, self.training
        if res.pipeline_model_parallel_size > 1:
            raise ValueError("pipeline_model_parallel_size > 1 is not supported yet (tensor and data parallel are)")
        world, tp = res.actor_num_nodes * res.actor_num_gpus_per_node, res.tensor_model_parallel_size
        if world % tp:
            raise ValueError(
                f"actor_num_nodes x actor_num_gpus_per_node ({world}) must be a multiple of "
                f"tensor_model_parallel_size ({tp})"
            )
        if world > 1 and res.trainer_launcher == "in_process":
            raise ValueError("trainer_launcher in_process runs one process: set actor_num_gpus_per_node 1")
        dp = world // tp
        if dp > 1 and not t.max_tokens_per_gpu and t.global_batch_size % (t.micro_batch_size * dp):
            raise ValueError(
                f"global_batch_size ({t.global_batch_size}) must be a multiple of micro_batch_size x data parallel"
                f" size ({t.micro_batch_size} x {dp}), so every data-parallel rank gets whole micro-batches"
            )

    @property
    def remote_pools(self) -> list[tuple[str, str]]:
        """rollout_pools as (name, router URL) pairs."""
        out: list[tuple[str, str]] = []
        for spec in self.rollout.rollout_pools or []:
            name, sep, url = spec.partition("=")
            if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or not re.match(r"https?://[^/\s]+", url):
                raise ValueError(f"rollout_pools: {spec!r} is not NAME=http://HOST:PORT")
            if name == "local" or name in dict(out):
                raise ValueError(f"rollout_pools: pool name {name!r} is taken (each pool needs its own; 'local' "
                                 "is the run's own engines)")  # fmt: skip
            out.append((name, url.rstrip("/")))
        return out

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


def format_validation_error(err: ValidationError, source: str = "config") -> str:
    """One line naming each bad field and what was expected."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "model_type":  # a group given as a scalar or a list
            msg = f"expected a mapping of its fields, got {type(e['input']).__name__}"
        elif e["type"].endswith("_type"):  # say what was given: a list or a mapping where a number goes, say
            msg += f", got {type(e['input']).__name__}"
        if len(e["loc"]) == 2 and e["type"] != "extra_forbidden":  # a group field: also name its flag
            loc += f" (--{str(e['loc'][1]).replace('_', '-')})"
        parts.append(f"{loc}: {msg}" if loc else msg)
    if len(parts) > 3:  # a list of a million wrong items is still a short line
        parts[3:] = [f"and {len(parts) - 3} more"]
    return f"{source}: " + "; ".join(parts)


def load_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: config file not found")
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise UserError(f"{p}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{p}: not a text file (byte {e.start} is not UTF-8)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark else str(p)
        raise UserError(f"{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
    if data is None:  # an empty file: the defaults (a falsy [], 0 or false is a mistake, below)
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{p}: expected a mapping of config groups at the top level")
    return data


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


def build_config(
    base: dict, overrides: dict[tuple[str, str], object], source: str = "config", command: str = "run"
) -> RunConfig:
    """Merge CLI overrides (group, field) -> value into a YAML dict and validate, for `command`.

    The YAML's values and the flags' are each validated on their own first, so an error names where the bad
    value came from, and a wrong-typed YAML value is an error even when a flag overrides it (the file is
    still wrong, for the next command that reads it without that flag)."""
    flags: dict[str, dict] = {}
    for (group, field), value in overrides.items():
        flags.setdefault(group, {})[field] = value
    for values, where in ((base, source), (flags, "flags")):
        try:
            RunConfig.model_validate(values, context={"fields_only": True})
        except ValidationError as e:
            raise UserError(format_validation_error(e, where)) from None
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for (group, field), value in overrides.items():
        merged.setdefault(group, {})
        if not isinstance(merged[group], dict):
            raise UserError(f"{source}: '{group}' must be a mapping")
        merged[group][field] = value
    try:
        return RunConfig.model_validate(merged, context={"command": command})
    except ValidationError as e:
        raise UserError(format_validation_error(e, source)) from None
