"""slime's Megatron model-architecture flags (its `scripts/models/*.sh`), each checked against the HF checkpoint's
config.json: the model is always built from config.json, so a flag can only agree with it or contradict it."""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sluiceway.flows.slime.treatments import ARCHITECTURE, NOT_APPLICABLE, Flag
from sluiceway.infra.errors import UserError

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
