"""slime's flags that are not sluiceway config fields: what each one means here (docs/slime.md lists them).

Every config field is already a flag with slime's name where slime has one (flows/cli.py); this module is the
one place that knows the rest of the flags slime's launch scripts (`scripts/*.sh`, `examples/*/*.sh`,
`scripts/models/*.sh`) pass, and treats each one in one of these ways:

- implemented: slime's meaning holds here (a value that would mean something sluiceway does not do is one error
  line, never silently dropped);
- mapped: rewritten onto a sluiceway field (`--save DIR` is `--output-dir DIR`);
- not applicable: a setting of how GPU kernels, collectives or placement run, which does not change results here;
  accepted and reported once in the run's log;
- refused: a setting that changes results and is not implemented here: one error line saying so (none of
  slime's `scripts/run-qwen3-4B.sh`-style RL scripts needs one; see docs/slime.md);
- architecture: a Megatron model-architecture flag, checked against `--hf-checkpoint`'s config.json before
  anything starts: agreeing is accepted, a contradiction is one line naming both values.

The model is always built from the HF checkpoint's config.json; architecture flags never change it.
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluiceway.infra.errors import UserError

SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"  # the THUDM/slime commit the table was checked against
DEST = "slime:"  # argparse dest prefix of these flags (no dot: flows/cli.py's config overrides are `group.field`)

IMPLEMENTED, MAPPED, NOT_APPLICABLE, ARCHITECTURE = "implemented", "mapped", "not applicable", "architecture"
REFUSED = "refused"  # changes results in a way sluiceway does not implement: one error line saying so

log = logging.getLogger("sluiceway.slime")
WHITENED_ESTIMATORS = ("ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")  # docs/algorithms.md


@dataclass(frozen=True)
class Flag:
    kind: str
    note: str  # what it means here (the --help text and docs/slime.md)
    nargs: int | str = 1  # 0: a switch
    # implemented / mapped: value(s) -> {(group, field): value} overrides, or raises UserError
    apply: Callable[[Any], dict[tuple[str, str], Any]] | None = None
    # architecture: (hf config dict, value) -> (agrees, what the checkpoint says)
    check: Callable[[dict, Any], tuple[bool, str]] | None = None


# -- architecture checks ------------------------------------------------------------------------------------


def _num(x: Any) -> float:
    return float(x)


def _get(cfg: dict, *keys: str, default: Any = None) -> Any:
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
        rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if isinstance(rp, dict) and k in rp and rp[k] is not None:
            return rp[k]
    return default


def _eq(*keys: str, default: Any = None, cast: Callable = _num) -> Callable[[dict, Any], tuple[bool, str]]:
    def check(cfg: dict, value: Any) -> tuple[bool, str]:
        have = _get(cfg, *keys, default=default)
        if have is None:
            return False, f"no {keys[0]}"
        try:
            ok = cast(value) == cast(have)
        except (TypeError, ValueError):
            ok = False
        return ok, f"{keys[0]} {have}"

    return check


def _head_dim(cfg: dict, value: Any) -> tuple[bool, str]:
    if "kv_lora_rank" in cfg:  # multi-latent attention: Megatron does not use kv_channels
        return True, "multi-latent attention (kv_channels unused)"
    have = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return int(value) == int(have), f"head_dim {have}"


def _switch(predicate: Callable[[dict], bool], says: Callable[[dict], str]) -> Callable[[dict, Any], tuple[bool, str]]:
    return lambda cfg, value: (predicate(cfg), says(cfg))


def _model_type(cfg: dict) -> str:
    return str(cfg.get("model_type", ""))


def _is_moe(cfg: dict) -> bool:
    return any(k in cfg for k in ("num_experts", "n_routed_experts", "num_local_experts"))


def _moe_layer_freq(cfg: dict, value: Any) -> tuple[bool, str]:
    n = int(cfg.get("num_hidden_layers", 0))
    if not _is_moe(cfg):
        return False, "no experts (a dense model)"
    dense = int(cfg.get("first_k_dense_replace") or 0)
    step = int(cfg.get("decoder_sparse_step") or 1)
    only_mlp = set(cfg.get("mlp_only_layers") or [])
    have = [0 if (i < dense or i in only_mlp or (i + 1) % step) else 1 for i in range(n)]
    try:  # Megatron's forms: an int (every Nth layer), "[1,1,0]" or "[0]*1+[1]*46"
        tree = ast.parse(str(value), mode="eval")
        allowed = (ast.Expression, ast.List, ast.Constant, ast.BinOp, ast.Mult, ast.Add, ast.Load)
        if not all(isinstance(node, allowed) for node in ast.walk(tree)):
            raise ValueError
        got = eval(compile(tree, "<moe-layer-freq>", "eval"), {"__builtins__": {}})
        if isinstance(got, int):
            got = [1 if i % got == 0 else 0 for i in range(n)]
    except (SyntaxError, ValueError, TypeError):
        return False, "a layer pattern (cannot read this value)"
    summary = f"{have.count(0)} dense then {have.count(1)} MoE layers" if have == sorted(have) else str(have)
    return list(got) == have, f"MoE layer pattern: {summary}"


def _moe(key_check: Callable[[dict, Any], tuple[bool, str]]) -> Callable[[dict, Any], tuple[bool, str]]:
    def check(cfg: dict, value: Any) -> tuple[bool, str]:
        if not _is_moe(cfg):
            return False, "no experts (a dense model)"
        return key_check(cfg, value)

    return check


def _mla(key_check: Callable[[dict, Any], tuple[bool, str]]) -> Callable[[dict, Any], tuple[bool, str]]:
    def check(cfg: dict, value: Any) -> tuple[bool, str]:
        if "kv_lora_rank" not in cfg:
            return False, "no kv_lora_rank (not multi-latent attention)"
        return key_check(cfg, value)

    return check


def _shared_expert_size(cfg: dict, value: Any) -> tuple[bool, str]:
    have = cfg.get("shared_expert_intermediate_size")
    if have is None and cfg.get("n_shared_experts"):
        have = int(cfg["n_shared_experts"]) * int(cfg.get("moe_intermediate_size", 0))
    if not have:
        return False, "no shared expert"
    return int(value) == int(have), f"shared expert intermediate size {have}"


_TRUE = (lambda cfg: True, lambda cfg: "")


def _arch(note: str, check, nargs: int | str = 1) -> Flag:
    return Flag(ARCHITECTURE, note, nargs=nargs, check=check)


ARCH_FLAGS: dict[str, Flag] = {
    "--num-layers": _arch("num_hidden_layers", _eq("num_hidden_layers")),
    "--hidden-size": _arch("hidden_size", _eq("hidden_size")),
    "--ffn-hidden-size": _arch("intermediate_size", _eq("intermediate_size")),
    "--num-attention-heads": _arch("num_attention_heads", _eq("num_attention_heads")),
    "--num-query-groups": _arch("num_key_value_heads", _eq("num_key_value_heads", "num_attention_heads")),
    "--group-query-attention": _arch(
        "num_key_value_heads present",
        _switch(lambda c: "num_key_value_heads" in c, lambda c: "no num_key_value_heads"),
        nargs=0,
    ),  # fmt: skip
    "--kv-channels": _arch("head_dim (hidden_size / num_attention_heads if absent)", _head_dim),
    "--vocab-size": _arch("vocab_size", _eq("vocab_size")),
    "--make-vocab-size-divisible-by": Flag(
        NOT_APPLICABLE,
        "Megatron's padding of the embedding table; the checkpoint's vocab_size is used as is "
        "(padded rows are never sampled, so results are the same)",
    ),  # fmt: skip
    "--norm-epsilon": _arch("rms_norm_eps", _eq("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")),
    "--normalization": _arch(
        "RMSNorm: rms_norm_eps present",
        lambda c, v: (v == "RMSNorm" and "rms_norm_eps" in c, "RMSNorm" if "rms_norm_eps" in c else "LayerNorm"),
    ),
    "--swiglu": _arch(
        "hidden_act silu",
        _switch(
            lambda c: c.get("hidden_act", "silu") in ("silu", "swish"), lambda c: f"hidden_act {c.get('hidden_act')}"
        ),
        nargs=0,
    ),  # fmt: skip
    "--disable-bias-linear": _arch(
        "no mlp_bias", _switch(lambda c: not c.get("mlp_bias", False), lambda c: "mlp_bias true"), nargs=0
    ),  # fmt: skip
    "--add-qkv-bias": _arch(
        "q/k/v biases (qwen2, or attention_bias true)",
        _switch(
            lambda c: _model_type(c) in ("qwen2", "qwen2_moe") or bool(c.get("attention_bias")),
            lambda c: f"model_type {_model_type(c)} without attention_bias",
        ),
        nargs=0,
    ),  # fmt: skip
    "--qk-layernorm": _arch(
        "q/k norms (qwen3, or multi-latent attention's q/kv norms)",
        _switch(
            lambda c: _model_type(c).startswith("qwen3") or "kv_lora_rank" in c or bool(c.get("use_qk_norm")),
            lambda c: f"model_type {_model_type(c)} without q/k norms",
        ),
        nargs=0,
    ),  # fmt: skip
    "--untie-embeddings-and-output-weights": _arch(
        "tie_word_embeddings false",
        _switch(lambda c: c.get("tie_word_embeddings", True) is False, lambda c: "tie_word_embeddings true"),
        nargs=0,
    ),  # fmt: skip
    "--use-rotary-position-embeddings": _arch(
        "rope_theta present", _switch(lambda c: _get(c, "rope_theta") is not None, lambda c: "no rope_theta"), nargs=0
    ),  # fmt: skip
    "--position-embedding-type": _arch(
        "rope: rope_theta present",
        lambda c, v: (
            v == "rope" and _get(c, "rope_theta") is not None,
            "rope" if _get(c, "rope_theta") else "no rope_theta",
        ),
    ),
    "--no-position-embedding": _arch(
        "no learned position table (a rope model)",
        _switch(lambda c: _get(c, "rope_theta") is not None, lambda c: "no rope_theta"),
        nargs=0,
    ),  # fmt: skip
    "--rotary-base": _arch("rope_theta", _eq("rope_theta", default=10000.0)),
    "--rotary-percent": _arch("partial_rotary_factor (1.0 if absent)", _eq("partial_rotary_factor", default=1.0)),
    "--rotary-interleaved": _arch(
        "GLM-4's interleaved rotary (model_type glm4)",
        _switch(lambda c: _model_type(c) == "glm4", lambda c: f"model_type {_model_type(c)} (rotary not interleaved)"),
        nargs=0,
    ),  # fmt: skip
    "--post-self-attn-layernorm": _arch(
        "GLM-4's post-attention norm (model_type glm4)",
        _switch(lambda c: _model_type(c) == "glm4", lambda c: f"model_type {_model_type(c)}"),
        nargs=0,
    ),  # fmt: skip
    "--post-mlp-layernorm": _arch(
        "GLM-4's post-MLP norm (model_type glm4)",
        _switch(lambda c: _model_type(c) == "glm4", lambda c: f"model_type {_model_type(c)}"),
        nargs=0,
    ),  # fmt: skip
    "--spec": _arch(
        "slime's layer spec module and function: GLM-4's (model_type glm4)",
        lambda c, v: (_model_type(c) == "glm4" or "glm4" not in " ".join(v), f"model_type {_model_type(c)}"),
        nargs=2,
    ),
    "--attention-dropout": _arch(
        "attention_dropout (0 if absent): the trainer uses the checkpoint's", _eq("attention_dropout", default=0.0)
    ),  # fmt: skip
    # mixture of experts
    "--num-experts": _arch(
        "num_experts / n_routed_experts", _moe(_eq("num_experts", "n_routed_experts", "num_local_experts"))
    ),  # fmt: skip
    "--moe-ffn-hidden-size": _arch("moe_intermediate_size", _moe(_eq("moe_intermediate_size"))),
    "--moe-router-topk": _arch("num_experts_per_tok", _moe(_eq("num_experts_per_tok"))),
    "--moe-shared-expert-intermediate-size": _arch(
        "n_shared_experts x moe_intermediate_size", _moe(_shared_expert_size)
    ),  # fmt: skip
    "--moe-layer-freq": _arch("first_k_dense_replace / decoder_sparse_step / mlp_only_layers", _moe_layer_freq),
    "--moe-router-score-function": _arch(
        "scoring_func (softmax if absent)", _moe(_eq("scoring_func", default="softmax", cast=str))
    ),  # fmt: skip
    "--moe-router-pre-softmax": _arch("a MoE router", _moe(lambda c, v: (True, "")), nargs=0),
    "--moe-router-enable-expert-bias": _arch(
        "topk_method noaux_tc (the router's expert score bias)",
        _moe(lambda c, v: (c.get("topk_method") == "noaux_tc", f"topk_method {c.get('topk_method')}")),
        nargs=0,
    ),
    "--moe-router-topk-scaling-factor": _arch("routed_scaling_factor", _moe(_eq("routed_scaling_factor"))),
    "--moe-router-num-groups": _arch("n_group (grouped routing)", _moe(_eq("n_group"))),
    "--moe-router-group-topk": _arch("topk_group (grouped routing)", _moe(_eq("topk_group"))),
    "--moe-shared-expert-gate": _arch(
        "a gated shared expert (qwen2_moe, qwen3_next, qwen3_5_moe)",
        _moe(
            lambda c, v: (_model_type(c) in ("qwen2_moe", "qwen3_next", "qwen3_5_moe"), f"model_type {_model_type(c)}")
        ),
        nargs=0,
    ),  # fmt: skip
    "--max-position-embeddings": _arch("max_position_embeddings", _eq("max_position_embeddings")),
    "--rotary-scaling-factor": _arch("rope_scaling.factor (YaRN)", _eq("factor")),
    "--mscale": _arch("rope_scaling.mscale (YaRN)", _eq("mscale")),
    "--mscale-all-dim": _arch("rope_scaling.mscale_all_dim (YaRN)", _eq("mscale_all_dim")),
    "--use-gated-attention": _arch(
        "Qwen3-Next / Qwen3.5 gated attention (model_type qwen3_next, qwen3_5*)",
        _switch(
            lambda c: _model_type(c).startswith(("qwen3_next", "qwen3_5")), lambda c: f"model_type {_model_type(c)}"
        ),
        nargs=0,
    ),  # fmt: skip
    "--attention-output-gate": _arch(
        "Qwen3-Next / Qwen3.5 attention output gate (model_type qwen3_next, qwen3_5*)",
        _switch(
            lambda c: _model_type(c).startswith(("qwen3_next", "qwen3_5")), lambda c: f"model_type {_model_type(c)}"
        ),
        nargs=0,
    ),  # fmt: skip
    "--apply-layernorm-1p": _arch(
        "zero-centred norms, weight + 1 (model_type qwen3_next, qwen3_5*)",
        _switch(
            lambda c: _model_type(c).startswith(("qwen3_next", "qwen3_5")), lambda c: f"model_type {_model_type(c)}"
        ),
        nargs=0,
    ),  # fmt: skip
    "--mtp-num-layers": _arch(
        "num_nextn_predict_layers (multi-token prediction layers, not trained here)",
        _eq("num_nextn_predict_layers", default=0),
    ),  # fmt: skip
    # multi-latent attention
    "--multi-latent-attention": _arch("kv_lora_rank present", _mla(lambda c, v: (True, "")), nargs=0),
    "--q-lora-rank": _arch("q_lora_rank", _mla(_eq("q_lora_rank"))),
    "--kv-lora-rank": _arch("kv_lora_rank", _mla(_eq("kv_lora_rank"))),
    "--qk-head-dim": _arch("qk_nope_head_dim", _mla(_eq("qk_nope_head_dim"))),
    "--qk-pos-emb-head-dim": _arch("qk_rope_head_dim", _mla(_eq("qk_rope_head_dim"))),
    "--v-head-dim": _arch("v_head_dim", _mla(_eq("v_head_dim"))),
}


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
    "--rollout-max-context-len": Flag(
        REFUSED,
        "a context cap that shortens responses of long prompts is not "
        "implemented: set --rollout-max-prompt-len and --rollout-max-response-len",
    ),
    "--use-rollout-logprobs": Flag(
        REFUSED,
        "using the engine's log-probs as the old policy's is not implemented "
        "(the trainer recomputes them; --use-tis corrects for the engine's)",
        nargs=0,
    ),
    "--custom-reward-post-process-path": Flag(
        REFUSED,
        "a custom reward post-processing hook is not implemented "
        "(--custom-rm-path with --group-rm scores whole groups)",
    ),
    "--custom-config-path": Flag(
        REFUSED, "slime's YAML of custom-function arguments: put settings in the sluiceway YAML config or flags"
    ),  # fmt: skip
    "--loss-mask-type": Flag(
        REFUSED,
        "slime's per-template multi-turn loss masks are not implemented: sluiceway's "
        "SFT masks the assistant turns its chat template marks",
    ),  # fmt: skip
    "--fp8-format": Flag(REFUSED, "FP8 training is not implemented (its numerics differ from bf16/fp32)"),
    "--fp8-recipe": Flag(REFUSED, "FP8 training is not implemented (its numerics differ from bf16/fp32)"),
    "--moe-router-load-balancing-type": _na("the auxiliary loss kind, which --moe-aux-loss-coeff 0 switches off"),
}

SLIME_FLAGS: dict[str, Flag] = {**RUN_FLAGS, **ARCH_FLAGS}


# -- the CLI's side -----------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """slime's flags in a group of their own: `sluiceway run --help` says how each is treated."""
    section = parser.add_argument_group(
        "slime compatibility",
        "flags of slime's launch scripts that are not sluiceway fields (docs/slime.md): implemented, mapped onto "
        "a field, not applicable here (reported once in the run's log), or model architecture (checked against "
        "--hf-checkpoint's config.json)",
    )
    for flag, spec in SLIME_FLAGS.items():
        kind = spec.kind if spec.kind != ARCHITECTURE else "architecture, checked against config.json"
        kwargs: dict = {"dest": DEST + flag, "default": argparse.SUPPRESS, "help": f"[{kind}] {spec.note}"}
        if spec.nargs == 0:
            kwargs["action"] = "store_true"
        else:
            kwargs["nargs"] = None if spec.nargs == 1 else spec.nargs
            kwargs["metavar"] = "VALUE"
        section.add_argument(flag, **kwargs)


@dataclass
class Given:
    """The slime flags of one command line, once `take` has applied the mapped ones."""

    flags: dict[str, Any] = field(default_factory=dict)  # flag -> value (True for a switch)
    placement: dict[str, Any] = field(default_factory=dict)  # sluiceway fields not applicable in this layout
    notes: list[str] = field(default_factory=list)  # what a slime command line's fields became here

    def of_kind(self, kind: str) -> dict[str, Any]:
        return {f: v for f, v in self.flags.items() if SLIME_FLAGS[f].kind == kind}


def _shown(value: Any) -> str:
    if value is True:
        return ""
    return " " + " ".join(map(str, value)) if isinstance(value, list) else f" {value}"


def take(args: argparse.Namespace) -> Given:
    """Remove slime's flags from `args`, writing the mapped ones as config overrides (`group.field` keys)."""
    ns = vars(args)
    given = Given({k[len(DEST) :]: ns.pop(k) for k in list(ns) if k.startswith(DEST)})
    for flag, value in given.flags.items():
        spec = SLIME_FLAGS[flag]
        if spec.kind == REFUSED:
            raise UserError(f"{flag}{_shown(value)}: {spec.note}")
        for (group, name), v in (spec.apply(value) if spec.apply else {}).items():
            key = f"{group}.{name}"
            if key in ns and ns[key] != v:
                raise UserError(f"{flag}{_shown(value)} contradicts --{name.replace('_', '-')} {ns[key]}: give one")
            ns[key] = v
    if "--disable-compute-advantages-and-returns" in given.flags and ns.get("algorithm.loss_type") != "sft_loss":
        raise UserError("--disable-compute-advantages-and-returns trains without advantages: only with "
                        "--loss-type sft_loss (slime's SFT scripts); the policy loss needs them")  # fmt: skip
    estimator = ns.get("algorithm.advantage_estimator") or "grpo"
    if "--normalize-advantages" in given.flags and estimator not in WHITENED_ESTIMATORS:
        raise UserError(f"--normalize-advantages with --advantage-estimator {estimator}: whitening its advantages "
                        f"over the batch is not implemented (only {', '.join(WHITENED_ESTIMATORS)}, which always "
                        "whiten)")  # fmt: skip
    if "--lr-warmup-fraction" in given.flags:
        iters = _warmup_iters(ns, given.flags["--lr-warmup-fraction"])
        if "training.lr_warmup_iters" in ns and _n(ns["training.lr_warmup_iters"]) != iters:
            raise UserError(f"--lr-warmup-fraction {given.flags['--lr-warmup-fraction']} ({iters} steps) "
                            f"contradicts --lr-warmup-iters {ns['training.lr_warmup_iters']}: give one")  # fmt: skip
        ns["training.lr_warmup_iters"] = iters
    if given.flags:
        _slime_layout(ns, given, _ray_address(args))
        _slime_defaults(ns, given, _yaml_keys(args))
    save, load = given.flags.get("--save"), given.flags.get("--load")
    if load is not None:
        out = ns.get("storage.output_dir", save)
        if out is None or Path(load).resolve() != Path(out).resolve():
            _load_elsewhere(load, out)
        elif save is None:
            ns["storage.output_dir"] = load
    return given


def _warmup_iters(ns: dict, fraction: str) -> int:
    keys = ("rollout.num_rollout", "rollout.rollout_batch_size", "rollout.n_samples_per_prompt",
            "training.global_batch_size")  # fmt: skip
    values = [_n(ns.get(k), None) for k in keys]
    frac = _n(fraction, None)
    if frac is None or not 0 <= frac <= 1 or any(v is None or v <= 0 for v in values):
        raise UserError(f"--lr-warmup-fraction {fraction}: needs a fraction in [0, 1] and --num-rollout, "
                        "--rollout-batch-size, --n-samples-per-prompt, --global-batch-size (or give "
                        "--lr-warmup-iters)")  # fmt: skip
    rollouts, batch, n, gbs = values
    return round(frac * (rollouts * batch * n // gbs))


def _n(value: Any, default: float | None = 1) -> float | None:
    """A flag's number as argparse left it (a string), None if it is not one (the config then says so)."""
    try:
        return float(value if value is not None else default) if (value, default) != (None, None) else None
    except (TypeError, ValueError):
        return None


def _slime_layout(ns: dict, given: Given, ray: bool) -> None:
    """A slime command line's placement on one machine without a Ray cluster (same results, fewer devices)."""
    if not ray and "rollout.rollout_num_gpus" in ns:  # slime's GPUs for SGLang; the engines here are embedded
        given.placement["--rollout-num-gpus"] = ns.pop("rollout.rollout_num_gpus")
    nodes = _n(ns.get("resources.actor_num_nodes"))
    per_node = _n(ns.get("resources.actor_num_gpus_per_node"))
    if not ray and nodes and nodes > 1 and nodes.is_integer() and per_node and per_node.is_integer():
        # the same trainer ranks (so the same data-parallel size) as processes on this machine
        nodes, per_node = int(nodes), int(per_node)
        ns["resources.actor_num_nodes"], ns["resources.actor_num_gpus_per_node"] = 1, nodes * per_node
        given.notes.append(f"slime --actor-num-nodes {nodes} --actor-num-gpus-per-node {per_node}: "
                           f"{nodes * per_node} trainer processes on this machine (no --ray-address)")  # fmt: skip
    pp = _n(ns.get("resources.pipeline_model_parallel_size"))
    if pp and pp > 1:  # pipeline stages split the layers over devices: the same computation at 1
        given.placement["--pipeline-model-parallel-size"] = ns.pop("resources.pipeline_model_parallel_size")
    cp = _n(given.flags.get("--context-parallel-size"))
    tp, ranks = _n(ns.get("resources.tensor_model_parallel_size")), _n(ns.get("resources.actor_num_gpus_per_node"))
    if all(x and x.is_integer() for x in (pp, cp, tp, ranks)) and pp * cp > 1 and ranks % (tp * pp * cp) == 0:
        # slime's data-parallel size, without its pipeline stages and context-parallel ranks
        pp, cp, tp, ranks = int(pp), int(cp), int(tp), int(ranks)
        ns["resources.actor_num_gpus_per_node"] = ranks // (pp * cp)
        given.notes.append(f"slime's {ranks} trainer GPUs at TP {tp} x PP {pp} x CP {cp}: {ranks // (pp * cp)} "
                           f"trainer processes here (TP {tp}, the same data-parallel size)")  # fmt: skip
    if ns.get("algorithm.use_kl_loss") and _n(ns.get("algorithm.kl_loss_coef"), None) == 0:
        # slime computes the KL against the reference and logs it with weight 0; the loss, so the run, is the same
        ns["algorithm.use_kl_loss"] = False
        given.notes.append(
            "slime --use-kl-loss --kl-loss-coef 0: the KL term has weight 0, so it is left out of "
            "the loss as slime leaves it (no reference model runs; slime would log its value)"
        )


def _yaml_keys(args: argparse.Namespace) -> dict[str, Any]:
    """`group.field` -> value of the YAML config file, if one was given."""
    if not getattr(args, "config_file", None):
        return {}
    from sluiceway.flows.config import load_yaml

    base = load_yaml(args.config_file)
    return {f"{g}.{k}": v for g, fields in base.items() if isinstance(fields, dict) for k, v in fields.items()}


def _ray_address(args: argparse.Namespace) -> bool:
    return bool(vars(args).get("resources.ray_address") or _yaml_keys(args).get("resources.ray_address"))


# slime's defaults (its arguments.py, and Megatron's for the optimizer) where sluiceway's differ and the result
# depends on them: a slime command line that leaves one out means slime's value.
SLIME_DEFAULTS: dict[str, Any] = {
    "rollout.rollout_temperature": 1.0,
    "rollout.n_samples_per_prompt": 1,
    "algorithm.kl_loss_type": "k1",
    "training.weight_decay": 0.01,  # Megatron's
    "training.adam_beta2": 0.999,  # Megatron's
    "training.lr_decay_style": "linear",  # Megatron's, over the run's optimizer steps as slime sets lr_decay_iters
    "training.micro_batch_size": 1,  # Megatron's (no effect on results: gradient accumulation)
    # slime's loss is the mean over samples of each sample's token mean unless --calculate-per-token-loss
    "algorithm.loss_agg_mode": "seq_mean_token_mean",
}


def _slime_defaults(ns: dict, given: Given, yaml_keys: dict) -> None:
    if "--calculate-per-token-loss" in given.flags:
        if ns.get("algorithm.loss_agg_mode", "token_mean") != "token_mean":
            raise UserError(f"--calculate-per-token-loss contradicts --loss-agg-mode {ns['algorithm.loss_agg_mode']}")
        ns["algorithm.loss_agg_mode"] = "token_mean"
    applied = []
    for key, value in SLIME_DEFAULTS.items():
        if key not in ns and key not in yaml_keys:
            ns[key] = value
            applied.append(f"--{key.split('.', 1)[1].replace('_', '-')} {value}")
    if applied:
        given.notes.append("slime's defaults for what this slime command line leaves out: " + ", ".join(applied))
    if "--rollout-shuffle" not in given.flags:
        given.notes.append("slime reads the prompts in file order without --rollout-shuffle; sluiceway shuffles "
                           "them each epoch (seeded by --seed), as slime does with it")  # fmt: skip
    undropped = [f for f in ("--attention-dropout", "--hidden-dropout") if f not in given.flags]
    if undropped:
        given.notes.append(f"slime leaves {' and '.join(undropped)} at Megatron's default 0.1 here; sluiceway "
                           "trains without dropout (deterministic log-probs): give them as 0.0, as slime's "
                           "scripts/ do, to say so")  # fmt: skip


def _load_elsewhere(load: str, out: str | None) -> None:
    """--load not the run directory: fine only while it holds nothing to continue from (slime's first run)."""
    p = Path(load)
    if not p.exists() or (p.is_dir() and not any(p.iterdir())):
        return
    from sluiceway.flows.resume import RECORD

    if (p / RECORD).is_file():
        raise UserError(f"--load {load} holds a sluiceway run: continue it with `sluiceway resume {load}`")
    raise UserError(f"--load {load}: sluiceway continues only its own runs (from the run directory, --save/"
                    f"--output-dir{' ' + out if out else ''}); to start from converted Megatron weights, convert "
                    "them to HF (slime's tools/convert_torch_dist_to_hf.py) and pass --hf-checkpoint")  # fmt: skip


def hf_config_of(checkpoint: str) -> dict:
    p = Path(checkpoint).expanduser()
    if not (p / "config.json").is_file():
        from sluiceway.models.zoo import resolve_checkpoint

        p = resolve_checkpoint(checkpoint)  # a zoo name (built once and cached) or a model directory
    try:
        cfg = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--hf-checkpoint {checkpoint}: cannot read config.json ({e})") from None
    text = cfg.get("text_config")
    return {**cfg, **text} if isinstance(text, dict) else cfg


def check_architecture(given: Given, hf_checkpoint: str) -> None:
    """One error line for the first architecture flag the checkpoint's config.json contradicts."""
    arch = given.of_kind(ARCHITECTURE)
    if not arch:
        return
    cfg = hf_config_of(hf_checkpoint)
    for flag, value in arch.items():
        ok, says = SLIME_FLAGS[flag].check(cfg, value)
        if not ok:
            raise UserError(f"{flag}{_shown(value)} contradicts --hf-checkpoint {hf_checkpoint}: its config.json "
                            f"has {says}")  # fmt: skip


_PENDING: list[str] = []


def report(given: Given, cfg) -> list[str]:
    """The lines the run logs once: flags not applicable here, and what the mapped ones became."""
    hf_checkpoint = cfg.training.hf_checkpoint
    lines = []
    na = {**given.of_kind(NOT_APPLICABLE), **given.placement}
    if cfg.rollout.sglang_server_args and cfg.rollout.rollout_engine != "sglang":
        na["--sglang-*"] = cfg.rollout.sglang_server_args  # SGLang's own settings; the engines here are embedded
    if given.flags.get("--update-weight-transport") == "nccl":
        na["--update-weight-transport"] = "nccl"
    if na:
        lines.append("slime flags not applicable on this device (accepted, no effect on results): "
                     + ", ".join(f"{f}{_shown(v)}" for f, v in na.items()))  # fmt: skip
    lines.extend(given.notes)
    if "--ref-load" in given.flags:
        lines.append(f"slime --ref-load {given.flags['--ref-load']}: the reference model is --hf-checkpoint "
                     f"{hf_checkpoint}")  # fmt: skip
    arch = given.of_kind(ARCHITECTURE)
    if arch:
        lines.append(f"slime architecture flags agree with {hf_checkpoint}'s config.json: " + ", ".join(arch))
    _PENDING[:] = lines
    return lines


def log_pending() -> None:
    """Called once the run's logging is configured (flows/cli.py `_dispatch`)."""
    for line in _PENDING:
        log.info(line)
    _PENDING.clear()


def classify(flag: str) -> str | None:
    """How sluiceway treats one of slime's flags: implemented (a config field of that name, or handled here),
    mapped, not applicable, architecture; None: unknown."""
    from sluiceway.flows.cli import field_flags

    if flag in SLIME_FLAGS:
        return SLIME_FLAGS[flag].kind
    if flag in field_flags() or flag.startswith("--sglang-"):
        return IMPLEMENTED
    return None


# sluiceway fields whose value is a user function: slime's take slime's own types and need porting
_PORT = {
    "--custom-generate-function-path": "a sluiceway field, but this is slime's function (args, Sample, "
    "sampling_params) and imports slime: port it to tasks/rollout/multiturn.py's interface (module:function); "
    "the run stops with one line until then",
    "--custom-rm-path": "a sluiceway field, but this is slime's function (args, Sample): port it to "
    "fn(response, label, sample) (module:function); the run stops with one line until then",
}


def describe(argv: list[str]) -> list[str]:
    """One line per flag of a slime command line: how it is treated (what --from-slime-script prints)."""
    out = []
    for i, word in enumerate(argv):
        if not word.startswith("--"):
            continue
        values = []
        for w in argv[i + 1 :]:
            if w.startswith("--"):
                break
            values.append(w)
        kind = classify(word)
        spec = SLIME_FLAGS.get(word)
        if word in _PORT and values and ":" not in values[0]:
            how = _PORT[word]
        elif word.startswith("--sglang-"):
            how = "passed to SGLang engines (--rollout-engine sglang); the embedded engine's own settings otherwise"
        elif spec is None:
            how = "a sluiceway field of the same name" if kind else "unknown to sluiceway"
        elif spec.kind == ARCHITECTURE:
            how = f"checked against config.json: {spec.note}"
        else:
            how = spec.note
        shown = ["***"] if word == "--wandb-key" else values  # a secret is never printed
        out.append(f"  {' '.join([word, *shown])}  ->  {kind or 'unknown'}: {how}")
    return out


def model_args(cfg: dict) -> list[str]:
    """slime's MODEL_ARGS (scripts/models/*.sh) for a dense Llama/Qwen-style HF config: what a model file for
    this checkpoint would say (examples/run_slime_example_cpu.py writes one for tiny-llama)."""
    heads = cfg["num_attention_heads"]
    args = [
        "--swiglu", "--num-layers", str(cfg["num_hidden_layers"]), "--hidden-size", str(cfg["hidden_size"]),
        "--ffn-hidden-size", str(cfg["intermediate_size"]), "--num-attention-heads", str(heads),
        "--group-query-attention", "--num-query-groups", str(cfg.get("num_key_value_heads", heads)),
        "--kv-channels", str(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        "--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm",
        "--norm-epsilon", str(cfg["rms_norm_eps"]), "--rotary-base", str(_get(cfg, "rope_theta", default=10000)),
        "--vocab-size", str(cfg["vocab_size"]),
    ]  # fmt: skip
    if _model_type(cfg) in ("qwen2",) or cfg.get("attention_bias"):
        args.append("--add-qkv-bias")
    if _model_type(cfg).startswith("qwen3"):
        args.append("--qk-layernorm")
    if cfg.get("tie_word_embeddings", True) is False:
        args.append("--untie-embeddings-and-output-weights")
    return args


def _rows(kind: str) -> list[str]:
    rows = []
    for flag, spec in sorted(SLIME_FLAGS.items()):
        if spec.kind == kind:
            note = spec.note.replace("|", "\\|")
            rows.append(f"| `{flag}` | {note} |")
    return rows


def render_table() -> list[str]:
    """The flags of this module as one markdown table (docs/configuration.md's last section)."""
    lines = ["| flag | treatment | meaning here |", "| --- | --- | --- |"]
    for kind in (IMPLEMENTED, MAPPED, NOT_APPLICABLE, ARCHITECTURE, REFUSED):
        for row in _rows(kind):
            flag, note = row[2:].split(" | ", 1)
            lines.append(f"| {flag} | {kind} | {note}")
    return lines


def render_markdown() -> str:
    """docs/slime.md (python -m sluiceway.flows.slime_compat > docs/slime.md; a test keeps it current)."""
    lines = [
        "# slime compatibility",
        "",
        "Generated from `flows/slime_compat.py` by `python -m sluiceway.flows.slime_compat`; do not edit by hand.",
        "",
        "A slime launch script's flags run through `sluiceway run` as they are, or the script itself:",
        "",
        "    sluiceway run --from-slime-script scripts/run-qwen3-4B.sh [--flag value ...]",
        "",
        "reads its `*_ARGS=( ... )` arrays, the model files it `source`s and its `python3 train.py ...` line",
        "(flows/slime_script.py: simple assignments, `${VAR:-default}`, `$((...))`, `$(seq ...)` and the",
        "environment; a value computed by other shell code is one error line naming the file and line), prints",
        "how each flag is treated, then runs. Flags after the script override it.",
        "`examples/run_slime_example_cpu.py` runs slime's fully-async example this way on the CPU with tiny-llama.",
        "",
        f"Checked against THUDM/slime `{SLIME_COMMIT[:12]}`: every flag of `scripts/run-qwen3-4B.sh`,",
        "`run-glm4-9B.sh`, `run-qwen3-30B-A3B.sh`, `examples/fully_async/run-qwen2.5-0.5B-fully_async.sh`,",
        "`examples/search-r1/run_qwen2.5_3B.sh`, `examples/delta_weight_sync/run-glm4.7-30B-A3B-delta.sh` and the",
        "model files they source is accepted (tests/unit/config/test_slime_flags.py; the flag lists are in",
        "tests/data/slime_flags/). Across all 44 launch scripts of slime's `scripts/` and `examples/` at that",
        "commit every flag has a treatment in the tables below; 43 of them are read as they are (the geo3k VLM",
        "example computes `MODEL_NAME_LOWER` with shell code: give it in the environment). A few flags of the",
        "rest change results in ways not implemented here and are refused (last table).",
        "",
        "## Flags that are sluiceway fields",
        "",
        "Every config field is a flag of the same name (docs/configuration.md), which is slime's name where slime",
        "has the setting: `--rollout-batch-size`, `--n-samples-per-prompt`, `--global-batch-size`, `--lr`,",
        "`--eps-clip-high`, `--kl-loss-type`, `--tensor-model-parallel-size`, `--recompute-*`, `--eval-*`, ... These",
        "mean what they mean in slime. `--sglang-X V` flags are passed to SGLang engines as `--X V`",
        "(`--rollout-engine sglang`); with the embedded engine they are listed once in the log as not applicable.",
        "`--rm-type deepscaler` grades the answer after `</think>` as slime's rm_hub does.",
        "",
        "A slime command line on one machine without `--ray-address` (it has flags of the tables below):",
        "`--rollout-num-gpus` is not applicable (the engines are embedded here), `--actor-num-nodes N",
        "--actor-num-gpus-per-node G` is N x G trainer processes here, pipeline and context parallel GPUs become",
        "the same data-parallel size without them (`--pipeline-model-parallel-size` > 1 runs at 1: the same",
        "computation), and `--use-kl-loss --kl-loss-coef 0` leaves the zero-weight KL term out (slime logs its",
        "value; the loss is the same). Each of these is one line in the run's log.",
        "",
        "slime's defaults: a slime command line (one with a flag of the tables below, as slime's scripts all have)",
        "that leaves one of these out gets slime's (or Megatron's) value instead of sluiceway's, and the run logs",
        "which: "
        + ", ".join(f"`--{k.split('.', 1)[1].replace('_', '-')} {v}`" for k, v in SLIME_DEFAULTS.items())
        + " (slime's loss is the mean of per-sample token means unless `--calculate-per-token-loss`). Two of",
        "slime's defaults are not honoured, and the run's log says so when a command line relies on them: prompts",
        "in file order without `--rollout-shuffle` (sluiceway shuffles each epoch), and Megatron's dropout 0.1",
        "without `--attention-dropout 0.0 --hidden-dropout 0.0` (sluiceway trains without dropout).",
        "",
        "Custom functions: `--custom-generate-function-path` and `--custom-rm-path` are sluiceway fields, but the",
        "functions slime's examples name (`generate_with_search.generate`, slime's dotted form) take slime's",
        "`(args, Sample, ...)` and import slime; they are not run as they are. Port them to sluiceway's",
        "interfaces (tasks/rollout/multiturn.py; a scorer is `fn(response, label, sample)`) and pass",
        "`module:function`; a slime-style dotted path stops the run with one line saying so.",
        "",
        "## Implemented",
        "",
        "slime's meaning holds here; a value sluiceway does not implement is one error line.",
        "",
        "| flag | meaning here |",
        "| --- | --- |",
        *_rows(IMPLEMENTED),
        "",
        "## Mapped onto sluiceway fields",
        "",
        "| flag | becomes |",
        "| --- | --- |",
        *_rows(MAPPED),
        "",
        "`--load`/`--save`/`--ref-load`: slime's checkpoint directories. `--save DIR` is the run directory, where",
        "sluiceway's checkpoints go; `--load` naming the same directory (slime's usual `--load X --save X`) is",
        "accepted, and a run in it is continued with `sluiceway resume DIR`; a `--load` elsewhere that holds",
        "anything (a Megatron torch_dist checkpoint) is refused with one line: convert it to HF and pass",
        "`--hf-checkpoint`. `--ref-load` is the torch_dist conversion of the HF checkpoint in slime's scripts:",
        "the reference model here is `--hf-checkpoint` itself (logged once).",
        "",
        "## Not applicable on this device",
        "",
        "GPU kernels, collectives, memory layouts and placement: accepted, no effect on results here, listed",
        "once in the run's log (`slime flags not applicable on this device ...`).",
        "",
        "| flag | what it does in slime |",
        "| --- | --- |",
        *_rows(NOT_APPLICABLE),
        "",
        "## Model architecture",
        "",
        "The model is built from `--hf-checkpoint`'s config.json. These flags (slime's `scripts/models/*.sh`)",
        "are checked against it before anything starts: agreeing flags are accepted (listed once in the log), a",
        "contradiction is one error line naming both values, e.g.",
        "`error: --hidden-size 4096 contradicts --hf-checkpoint DIR: its config.json has hidden_size 2560`.",
        "",
        "| flag | config.json |",
        "| --- | --- |",
        *_rows(ARCHITECTURE),
        "",
        "## Refused",
        "",
        "Settings that change results and are not implemented here: one error line, never ignored. None of the",
        "six scripts above uses one; across the rest of slime's `scripts/` and `examples/` these appear:",
        "",
        "| flag | why |",
        "| --- | --- |",
        *_rows(REFUSED),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_markdown(), end="")
