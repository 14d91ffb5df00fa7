"""The table of slime's flags that are not sluiceway config fields: what each one means here (docs/slime.md lists
them, flows/slime/treatments.py says what each treatment means).

Every config field is already a flag with slime's name where slime has one (flows/cli/parser.py); this table is the
one place that knows the rest of the flags slime's launch scripts (`scripts/*.sh`, `examples/*/*.sh`,
`scripts/models/*.sh`) pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sluiceway.flows.slime.architecture import ARCH_FLAGS
from sluiceway.flows.slime.treatments import IMPLEMENTED, MAPPED, NOT_APPLICABLE, REFUSED, Flag
from sluiceway.infra.errors import UserError

# -- run flags ----------------------------------------------------------------------------------------------


def _only(flag: str, allowed: tuple, why: str) -> Callable[[Any], dict]:
    def apply(value: Any) -> dict:
        v = value if not isinstance(value, str) else value.strip()
        try:
            ok = any(float(v) == float(a) if isinstance(a, float) else v == a for a in allowed)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise UserError(f"{flag} {value}: {why}")
        return {}

    return apply


def _na(note: str, nargs: int | str = 1) -> Flag:
    return Flag(NOT_APPLICABLE, note, nargs=nargs)


_FULLY_ASYNC = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"
_DEFAULT_ROLLOUT = "slime.rollout.sglang_rollout.generate_rollout"


def _set_wandb_key(value: str) -> dict:
    import os

    os.environ["WANDB_API_KEY"] = value
    return {}


def _rollout_function(value: str) -> dict:
    if value == _FULLY_ASYNC:
        return {("rollout", "mode"): "fully-async"}
    if value == _DEFAULT_ROLLOUT:
        return {}
    raise UserError(f"--rollout-function-path {value}: sluiceway runs slime's default rollout ({_DEFAULT_ROLLOUT}) "
                    f"and its fully-async one ({_FULLY_ASYNC}); for your own, write a per-sample generate function "
                    "and pass --custom-generate-function-path")  # fmt: skip


RUN_FLAGS: dict[str, Flag] = {
    "--save": Flag(
        MAPPED,
        "onto --output-dir: the run directory, where sluiceway writes its checkpoints (every "
        "--save-interval steps and after the last) and its tables",
        apply=lambda v: {("storage", "output_dir"): v},
    ),  # fmt: skip
    "--load": Flag(
        IMPLEMENTED,
        "the checkpoint directory to continue from: it must be --save's directory (the run "
        "directory); one holding a run is continued with `sluiceway resume DIR`; empty or absent, the run "
        "starts from --hf-checkpoint as slime starts from --ref-load",
    ),  # fmt: skip
    "--ref-load": Flag(
        MAPPED,
        "onto --hf-checkpoint: the reference model (and, without --load, the initial one) "
        "is --hf-checkpoint's weights, of which slime's --ref-load is the torch_dist conversion; "
        "the directory is not read",
    ),  # fmt: skip
    "--rollout-shuffle": Flag(
        IMPLEMENTED, "prompts are shuffled each epoch (seeded by --seed); sluiceway always does", nargs=0
    ),  # fmt: skip
    "--rollout-function-path": Flag(
        IMPLEMENTED,
        f"{_DEFAULT_ROLLOUT} (the default) or {_FULLY_ASYNC} (= --mode fully-async); other paths are refused",
        apply=_rollout_function,
    ),
    "--optimizer": Flag(
        IMPLEMENTED,
        "adam: Megatron's Adam with decoupled weight decay, the trainer's optimizer; sgd is refused",
        apply=_only("--optimizer", ("adam",), "sluiceway's trainer optimizer is Adam (AdamW); sgd is not implemented"),
    ),  # fmt: skip
    "--hidden-dropout": Flag(
        IMPLEMENTED,
        "0: the trainer uses no hidden dropout (RL needs deterministic log-probs); other values are refused",
        apply=_only("--hidden-dropout", (0.0,), "sluiceway trains without hidden dropout (give 0.0)"),
    ),
    "--moe-aux-loss-coeff": Flag(
        IMPLEMENTED,
        "0: no MoE auxiliary load-balancing loss, as the trainer computes none; other values are refused",
        apply=_only("--moe-aux-loss-coeff", (0.0,), "sluiceway adds no MoE auxiliary loss (give 0)"),
    ),
    "--moe-router-bias-update-rate": Flag(
        IMPLEMENTED,
        "0: the router's expert bias stays as the checkpoint has it; other values are refused",
        apply=_only(
            "--moe-router-bias-update-rate", (0.0,), "sluiceway does not update the router's expert bias (give 0)"
        ),
    ),
    "--calculate-per-token-loss": Flag(
        MAPPED,
        "onto --loss-agg-mode token_mean (every token of the global batch weighs the same); without it slime's loss "
        "is the mean of per-sample token means, --loss-agg-mode seq_mean_token_mean, which a slime command line "
        "gets by default",
        nargs=0,
    ),
    "--use-dynamic-batch-size": Flag(
        MAPPED,
        "micro-batches packed up to --max-tokens-per-gpu tokens: sluiceway "
        "packs whenever --max-tokens-per-gpu is given",
        nargs=0,
    ),  # fmt: skip
    "--update-weight-transport": Flag(
        IMPLEMENTED,
        "disk: sluiceway's weight sync is disk-based (full versions "
        "via /update_weights_from_disk, deltas through the weight store); nccl, "
        "a GPU collective, carries the same weights and is not applicable here",
        apply=lambda v: {},
    ),  # fmt: skip
    "--update-weight-disk-dir": Flag(
        MAPPED,
        "onto --weights-uri: where the published weight versions (and deltas) are written",
        apply=lambda v: {("sync", "weights_uri"): v},
    ),
    "--update-weight-local-checkpoint-dir": _na(
        "where rollout hosts keep their synced copy; sluiceway's engines "
        "keep theirs under the run directory (same weights)"
    ),  # fmt: skip
    "--update-weight-delta-encoding": _na(
        "the delta's on-disk encoding (xor or overwrite): lossless either way; "
        "sluiceway's weight store has its own lossless encoding"
    ),  # fmt: skip
    "--update-weight-delta-checksum": _na(
        "the per-tensor checksum algorithm of a delta; sluiceway's weight store "
        "checks every version with its own digests"
    ),  # fmt: skip
    # placement and parallel layout
    "--colocate": _na(
        "trainer and engines share this machine; training and generation alternate as with slime's "
        "colocation (or overlap with --mode one-step-off / fully-async)",
        nargs=0,
    ),  # fmt: skip
    "--sequence-parallel": _na(
        "Megatron's sequence parallelism splits activations of tensor-parallel ranks (memory only: same results)",
        nargs=0,
    ),  # fmt: skip
    "--context-parallel-size": _na("splits long sequences over GPUs (memory only: same loss)"),
    "--expert-model-parallel-size": _na("places experts over GPUs (same results)"),
    "--expert-tensor-parallel-size": _na("tensor parallelism inside experts (same results)"),
    "--balance-data": _na(
        "balances tokens between data-parallel ranks; the global batch and its loss are the same", nargs=0
    ),  # fmt: skip
    "--optimizer-cpu-offload": _na("keeps the optimizer on the CPU, where it is here already", nargs=0),
    "--overlap-cpu-optimizer-d2h-h2d": _na("overlaps device-host copies of the offloaded optimizer", nargs=0),
    "--use-precision-aware-optimizer": _na(
        "Megatron's optimizer with its default state dtypes (fp32, the same as here); a memory layout", nargs=0
    ),  # fmt: skip
    # GPU kernels
    "--attention-backend": _na("the attention kernel (flash, fused, ...); here PyTorch's SDPA"),
    "--accumulate-allreduce-grads-in-fp32": _na(
        "gradients are accumulated and reduced in fp32: here they are "
        "fp32 already (the trainer's master weights and gradients)",
        nargs=0,
    ),  # fmt: skip
    "--attention-softmax-in-fp32": _na(
        "the attention softmax in fp32: PyTorch's SDPA on CPU computes it in fp32", nargs=0
    ),  # fmt: skip
    "--no-rope-fusion": _na("the fused rotary kernel (off here: the unfused path is exact)", nargs=0),
    "--moe-grouped-gemm": _na("grouped GEMM kernel for experts", nargs=0),
    "--moe-permute-fusion": _na("fused token permutation kernel", nargs=0),
    "--moe-token-dispatcher-type": _na("how tokens reach expert-parallel ranks (alltoall, allgather)"),
    "--moe-router-dtype": _na("the router's compute dtype (fp32 in slime's scripts)"),
    "--moe-token-drop-policy": _na(
        "which tokens are dropped past an expert capacity; without a capacity factor "
        "(slime's scripts set none) none are"
    ),  # fmt: skip
    "--moe-enable-deepep": _na("DeepEP's expert-parallel all-to-all kernels", nargs=0),
    "--no-masked-softmax-fusion": _na("the fused masked-softmax kernel (off here)", nargs=0),
    "--no-gradient-accumulation-fusion": _na("the fused weight-gradient accumulation kernel (off here)", nargs=0),
    "--no-check-for-nan-in-loss-and-grad": _na("Megatron's NaN check of the loss and gradients", nargs=0),
    "--no-offload-train": _na("keeps the trainer on the GPU while engines generate (colocation)", nargs=0),
    "--no-offload-rollout": _na("keeps the engines on the GPU while the trainer runs (colocation)", nargs=0),
    "--update-weight-buffer-size": _na("the chunk size of a weight update (same weights)"),
    "--decoder-last-pipeline-num-layers": _na("layers of the last pipeline stage (a pipeline layout)"),
    "--model-name": _na("names the model for slime's Megatron-to-HF weight converter; here the HF config says"),
    "--mtp-loss-scaling-factor": _na("the MTP loss weight, used only with --enable-mtp-training (refused)"),
    "--use-tensorboard": Flag(
        IMPLEMENTED,
        "TensorBoard event files: sluiceway always writes them (--tensorboard-dir, default OUTPUT_DIR/tensorboard)",
        nargs=0,
    ),  # fmt: skip
    "--enable-mtp-training": Flag(
        REFUSED,
        "trains multi-token-prediction layers alongside the policy: not implemented (the policy's loss would differ)",
        nargs=0,
    ),  # fmt: skip
    "--rollout-stop-token-ids": Flag(
        REFUSED,
        "extra stop tokens for generation: not implemented yet (responses "
        "would run past them); generation stops at the tokenizer's EOS",
        nargs="+",
    ),
    "--decoder-first-pipeline-num-layers": _na("layers of the first pipeline stage (a pipeline layout)"),
    "--save-debug-rollout-data": Flag(
        IMPLEMENTED,
        "keeps each step's rollouts: sluiceway stores every trajectory "
        "in the run's trajectories table anyway (the path is not written)",
    ),
    "--eval-config": Flag(
        REFUSED, "slime's YAML of eval datasets is not read: give them as --eval-prompt-data NAME FILE [NAME FILE ...]"
    ),  # fmt: skip
    "--transformer-impl": _na("Megatron's layer implementation (local or Transformer Engine kernels)"),
    "--enable-experimental": _na("Megatron's experimental kernels and paths", nargs=0),
    "--allgather-cp": _na("the all-gather implementation of context parallelism", nargs=0),
    "--data-pad-size-multiplier": _na("pads packed sequences to a multiple for GPU kernels (padding is masked)"),
    "--log-probs-chunk-size": _na("computes log-probs in chunks to save GPU memory (same values)"),
    "--prefill-num-servers": _na("SGLang prefill/decode disaggregation: prefill servers"),
    "--deterministic-mode": _na(
        "deterministic GPU kernels; the CPU path here gives the same result run to run", nargs=0
    ),  # fmt: skip
    "--wandb-key": Flag(
        IMPLEMENTED,
        "the W&B API key, set as WANDB_API_KEY for this process only (never logged "
        "or stored in the run record); prefer the environment variable",
        apply=lambda v: _set_wandb_key(v),
    ),  # fmt: skip
    "--lr-warmup-fraction": Flag(
        MAPPED,
        "onto --lr-warmup-iters: this fraction of the run's optimizer steps "
        "(num_rollout x rollout_batch_size x n_samples_per_prompt / global_batch_size, "
        "slime's train_iters); needs those four flags",
    ),  # fmt: skip
    "--disable-compute-advantages-and-returns": Flag(
        IMPLEMENTED,
        "slime's SFT scripts: with --loss-type sft_loss "
        "nothing computes advantages; with the policy loss it is "
        "refused",
        nargs=0,
    ),  # fmt: skip
    "--normalize-advantages": Flag(
        IMPLEMENTED,
        "whitening of the advantages over the batch's trained tokens, which ppo, reinforce_plus_plus and "
        "reinforce_plus_plus_baseline always do here (slime requires the flag for the two REINFORCE++ estimators); "
        "with grpo, gspo, dr_grpo or rloo it is refused (whitening their advantages is not implemented)",
        nargs=0,
    ),
    "--disable-grpo-std-normalization": Flag(
        MAPPED,
        "onto --normalize-advantages-by-std false: GRPO's centred rewards, not divided by the group's std",
        nargs=0,
        apply=lambda v: {("algorithm", "normalize_advantages_by_std"): False},
    ),
    "--disable-rewards-normalization": Flag(
        REFUSED,
        "slime then trains on the raw rewards, with no group baseline, which is not implemented: for centred "
        "rewards without the std use --disable-grpo-std-normalization or --advantage-estimator dr_grpo",
        nargs=0,
    ),
    "--debug-train-only": Flag(
        REFUSED, "trains on saved rollout data without engines: use `sluiceway replay` on a stored run", nargs=0
    ),  # fmt: skip
    "--eval-top-k": Flag(
        REFUSED,
        "top-k sampling in evaluation is not implemented (eval samples with --eval-temperature and --eval-top-p)",
    ),  # fmt: skip
    "--use-rollout-logprobs": Flag(
        REFUSED,
        "using the engine's log-probs as the old policy's is not implemented "
        "(the trainer recomputes them; --use-tis corrects for the engine's)",
        nargs=0,
    ),
    "--loss-mask-type": Flag(
        REFUSED,
        "slime's per-template multi-turn loss masks are not implemented: sluiceway's "
        "SFT masks the assistant turns its chat template marks",
    ),  # fmt: skip
    "--fp8-format": Flag(REFUSED, "FP8 training is not implemented (its numerics differ from bf16/fp32)"),
    "--fp8-recipe": Flag(REFUSED, "FP8 training is not implemented (its numerics differ from bf16/fp32)"),
    "--moe-router-load-balancing-type": _na("the auxiliary loss kind, which --moe-aux-loss-coeff 0 switches off"),
}


def _hook(why: str, nargs: int | str = 1) -> Flag:
    return Flag(REFUSED, f"a slime hook sluiceway does not run: {why}", nargs=nargs)


# slime's hooks (its arguments.py) that no sluiceway stage calls: each refused by name before anything starts. The
# ones that do run are sluiceway fields: --custom-generate-function-path, --custom-rm-path (with --group-rm) and
# --dynamic-sampling-filter-path take slime's functions (tasks/rollout/slime_plugins/, docs/slime.md), and
# --rollout-sample-filter-path, --rollout-all-samples-process-path, --custom-rollout-log-function-path and
# --custom-reward-post-process-path run after the filter stage (tasks/rollout/slime_plugins/hooks.py).
HOOK_FLAGS: dict[str, Flag] = {
    "--rollout-sample-hook-path": _hook("per-sample hooks before the reward are not called"),
    "--buffer-filter-path": _hook("sluiceway's buffer is the trajectories table; groups are taken in step order"),
    "--data-source-path": _hook("prompts come from --prompt-data through sluiceway's own dataset loader"),
    "--custom-eval-rollout-log-function-path": _hook("eval results go to the evals table"),
    "--custom-convert-samples-to-train-data-path": _hook("the trainer batches the stored rows itself"),
    "--eval-function-path": _hook("evaluation runs sluiceway's eval stage (--eval-prompt-data)"),
    "--rollout-data-postprocess-path": _hook("the megatron trainer takes no user code between its stages"),
    "--custom-loss-function-path": _hook("the policy losses are sluiceway's (--loss-type, docs/algorithms.md)"),
    "--custom-advantage-function-path": _hook("advantages are computed by --advantage-estimator"),
    "--custom-pg-loss-reducer-function-path": _hook("the loss is reduced by --loss-agg-mode"),
    "--custom-megatron-init-path": _hook("the trainer initializes megatron itself"),
    "--custom-megatron-before-log-prob-hook-path": _hook("the trainer calls no user code around log-probs"),
    "--custom-megatron-before-train-step-hook-path": _hook("the trainer calls no user code around a train step"),
    "--custom-model-provider-path": _hook("the model is built from --hf-checkpoint's config.json"),
    "--custom-update-weight-post-write-path": _hook("weight versions are published by sluiceway's weight sync"),
}

SLIME_FLAGS: dict[str, Flag] = {**RUN_FLAGS, **HOOK_FLAGS, **ARCH_FLAGS}


def slime_flag_switches() -> dict[str, bool]:
    """Every slime flag of the tables -> whether it is a switch: slime's `args` has them all
    (tasks/rollout/slime_plugins/args.py `slime_args`)."""
    return {flag: spec.nargs == 0 for flag, spec in SLIME_FLAGS.items()}
