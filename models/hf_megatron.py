"""HF Llama-family (Llama, Qwen2, Qwen3) <-> megatron-core GPTModel weight mapping, with tensor-parallel sharding.

Layout facts the mapping relies on (megatron-core 0.16 local spec, see megatron_attention.cpu_layer_spec):
- `linear_qkv` rows are interleaved per KV group: [q heads of group 0, k0, v0, q heads of group 1, k1, v1, ...];
  a TP rank owns whole groups, so sharding splits along groups.
- `linear_fc1` rows are cat(gate, up) *per TP rank*: each rank splits its output in half for SwiGLU, so gate and
  up are sharded separately and then concatenated.
- Norms are separate modules (`input_layernorm`, `pre_mlp_layernorm`), replicated across TP ranks. Qwen3's per-head
  `q_norm` / `k_norm` ([head_dim]) become `self_attention.q_layernorm` / `k_layernorm`, also replicated.
- Qwen3's `head_dim` may differ from hidden / heads: q/k/v and o_proj shapes follow head_dim throughout.
- Embedding and output layer are vocab-parallel (rows split); `linear_proj` and `linear_fc2` are row-parallel
  (input columns split).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "hf_to_megatron",
    "load_hf_weights",
    "megatron_state_dict",
    "megatron_to_hf",
    "merge_tp_shards",
]

_HF_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _dims(hf_config: Any) -> tuple[int, int, int, int]:
    """(num_heads, num_kv_groups, head_dim, hidden)."""
    nh = hf_config.num_attention_heads
    ng = getattr(hf_config, "num_key_value_heads", None) or nh
    hd = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // nh
    return nh, ng, int(hd), hf_config.hidden_size


def _has_qkv_bias(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", "") == "qwen2"


def _has_qk_norm(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", "") == "qwen3"


# (HF key under self_attn., GPTModel key under self_attention.)
_QK_NORMS = (("q_norm.weight", "q_layernorm.weight"), ("k_norm.weight", "k_layernorm.weight"))


def _tied(hf_config: Any) -> bool:
    return bool(getattr(hf_config, "tie_word_embeddings", False))


def _chunk(t: Tensor, dim: int, rank: int, size: int, what: str) -> Tensor:
    if t.size(dim) % size:
        raise ValueError(f"{what}: dim {dim} of size {t.size(dim)} is not divisible by tp_size={size}")
    return t.chunk(size, dim=dim)[rank]


def megatron_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """A GPTModel's state dict without megatron's `_extra_state` entries (TE/fp8 metadata, None here)."""
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def hf_to_megatron(
    hf_state_dict: Mapping[str, Tensor], hf_config: Any, tp_rank: int = 0, tp_size: int = 1
) -> dict[str, Tensor]:
    """Map an HF `*ForCausalLM` state dict onto the GPTModel state dict of one TP rank (pipeline size 1).

    Returns exactly GPTModel's keys (without `_extra_state`); tensors are fresh (no aliasing of the input).
    """
    nh, ng, hd, _hidden = _dims(hf_config)
    if ng % tp_size or nh % tp_size:
        raise ValueError(f"num_key_value_heads={ng} / num_attention_heads={nh} must divide by tp_size={tp_size}")
    q_per_group = nh // ng
    sd = {k: v for k, v in hf_state_dict.items() if not k.endswith(_HF_IGNORED_SUFFIXES)}
    used: set[str] = set()

    def take(key: str) -> Tensor:
        if key not in sd:
            raise KeyError(f"HF state dict has no {key!r} (expected a Llama/Qwen2/Qwen3 *ForCausalLM checkpoint)")
        used.add(key)
        return sd[key]

    def row_shard(t: Tensor, what: str) -> Tensor:  # split output rows (column-parallel / vocab-parallel)
        return _chunk(t, 0, tp_rank, tp_size, what).clone()

    def col_shard(t: Tensor, what: str) -> Tensor:  # split input columns (row-parallel)
        return _chunk(t, 1, tp_rank, tp_size, what).clone()

    def qkv(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # [ng, q_per_group*hd | hd | hd, ...] then keep this rank's groups.
        tail = q.shape[1:]
        grouped = torch.cat(
            [q.reshape(ng, q_per_group * hd, *tail), k.reshape(ng, hd, *tail), v.reshape(ng, hd, *tail)],
            dim=1,
        )
        return _chunk(grouped, 0, tp_rank, tp_size, "linear_qkv").reshape(-1, *tail).clone()

    out: dict[str, Tensor] = {}
    embed = take("model.embed_tokens.weight")
    out["embedding.word_embeddings.weight"] = row_shard(embed, "embedding")
    for i in range(hf_config.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = take(h + "input_layernorm.weight").clone()
        att = h + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = qkv(
            take(att + "q_proj.weight"), take(att + "k_proj.weight"), take(att + "v_proj.weight")
        )
        if _has_qkv_bias(hf_config):
            out[m + "self_attention.linear_qkv.bias"] = qkv(
                take(att + "q_proj.bias"), take(att + "k_proj.bias"), take(att + "v_proj.bias")
            )
        if _has_qk_norm(hf_config):
            for hf_key, mg_key in _QK_NORMS:
                out[m + "self_attention." + mg_key] = take(att + hf_key).clone()
        out[m + "self_attention.linear_proj.weight"] = col_shard(take(att + "o_proj.weight"), "linear_proj")
        out[m + "pre_mlp_layernorm.weight"] = take(h + "post_attention_layernorm.weight").clone()
        gate = _chunk(take(h + "mlp.gate_proj.weight"), 0, tp_rank, tp_size, "gate_proj")
        up = _chunk(take(h + "mlp.up_proj.weight"), 0, tp_rank, tp_size, "up_proj")
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[m + "mlp.linear_fc2.weight"] = col_shard(take(h + "mlp.down_proj.weight"), "linear_fc2")
    out["decoder.final_layernorm.weight"] = take("model.norm.weight").clone()
    if _tied(hf_config):
        used.add("lm_head.weight")  # HF lists the tied head too; GPTModel reuses the embedding.
    else:
        out["output_layer.weight"] = row_shard(take("lm_head.weight"), "output_layer")
    extra = sorted(set(sd) - used)
    if extra:
        raise ValueError(f"HF state dict has keys the Llama/Qwen2/Qwen3 mapping does not know: {extra[:8]}")
    return out


def merge_tp_shards(shards: Sequence[Mapping[str, Tensor]], hf_config: Any) -> dict[str, Tensor]:
    """Merge the GPTModel state dicts of all TP ranks (in rank order) into the TP=1 state dict."""
    tp = len(shards)
    if tp == 1:
        return {k: v for k, v in shards[0].items() if not k.endswith("_extra_state")}
    merged: dict[str, Tensor] = {}
    for key in shards[0]:
        if key.endswith("_extra_state"):
            continue
        parts = [s[key] for s in shards]
        if key.endswith(("layernorm.weight", "final_layernorm.weight")):
            merged[key] = parts[0].clone()
        elif key.endswith(("linear_proj.weight", "linear_fc2.weight")):
            merged[key] = torch.cat(parts, dim=1)
        elif key.endswith("linear_fc1.weight"):
            halves = [p.chunk(2, dim=0) for p in parts]
            merged[key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:  # embedding, output layer, linear_qkv (rank-major groups): plain row concatenation
            merged[key] = torch.cat(parts, dim=0)
    return merged


def megatron_to_hf(
    megatron_state_dict: Mapping[str, Tensor] | Sequence[Mapping[str, Tensor]],
    hf_config: Any,
    include_tied_lm_head: bool = True,
) -> dict[str, Tensor]:
    """Inverse of `hf_to_megatron`: a TP=1 GPTModel state dict (or a list of all TP ranks' state dicts)
    to HF `*ForCausalLM` keys. With tied embeddings `lm_head.weight` is the embedding tensor itself, as in
    HF's own `state_dict()` (pass include_tied_lm_head=False for what `save_pretrained` writes)."""
    if isinstance(megatron_state_dict, Mapping):
        sd = dict(megatron_state_dict)
    else:
        sd = merge_tp_shards(list(megatron_state_dict), hf_config)
    nh, ng, hd, _hidden = _dims(hf_config)
    q_per_group = nh // ng

    def split_qkv(t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        tail = t.shape[1:]
        grouped = t.reshape(ng, (q_per_group + 2) * hd, *tail)
        q, k, v = grouped.split([q_per_group * hd, hd, hd], dim=1)
        return (
            q.reshape(nh * hd, *tail).contiguous(),
            k.reshape(ng * hd, *tail).contiguous(),
            v.reshape(ng * hd, *tail).contiguous(),
        )

    out: dict[str, Tensor] = {}
    out["model.embed_tokens.weight"] = sd["embedding.word_embeddings.weight"].clone()
    for i in range(hf_config.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = split_qkv(sd[m + "self_attention.linear_qkv.weight"])
        out[h + "self_attn.q_proj.weight"], out[h + "self_attn.k_proj.weight"] = q, k
        out[h + "self_attn.v_proj.weight"] = v
        if _has_qkv_bias(hf_config):
            qb, kb, vb = split_qkv(sd[m + "self_attention.linear_qkv.bias"])
            out[h + "self_attn.q_proj.bias"], out[h + "self_attn.k_proj.bias"] = qb, kb
            out[h + "self_attn.v_proj.bias"] = vb
        if _has_qk_norm(hf_config):
            for hf_key, mg_key in _QK_NORMS:
                out[h + "self_attn." + hf_key] = sd[m + "self_attention." + mg_key].clone()
        out[h + "self_attn.o_proj.weight"] = sd[m + "self_attention.linear_proj.weight"].clone()
        gate, up = sd[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate.clone(), up.clone()
        out[h + "mlp.down_proj.weight"] = sd[m + "mlp.linear_fc2.weight"].clone()
        out[h + "input_layernorm.weight"] = sd[m + "input_layernorm.weight"].clone()
        out[h + "post_attention_layernorm.weight"] = sd[m + "pre_mlp_layernorm.weight"].clone()
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"].clone()
    if not _tied(hf_config):
        out["lm_head.weight"] = sd["output_layer.weight"].clone()
    elif include_tied_lm_head:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def load_hf_weights(
    gpt_model: torch.nn.Module,
    hf_model_or_state_dict: torch.nn.Module | Mapping[str, Tensor],
    hf_config: Any = None,
) -> None:
    """Load HF weights into `gpt_model` for this process's TP rank; every GPTModel weight must be covered."""
    if isinstance(hf_model_or_state_dict, torch.nn.Module):
        hf_config = hf_config if hf_config is not None else hf_model_or_state_dict.config
        hf_sd = hf_model_or_state_dict.state_dict()
    else:
        hf_sd = hf_model_or_state_dict
    if hf_config is None:
        raise ValueError("load_hf_weights: hf_config is required when passing a state dict")
    from megatron.core import parallel_state

    tp_rank, tp_size = 0, 1
    if parallel_state.model_parallel_is_initialized():
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
    mapped = hf_to_megatron(hf_sd, hf_config, tp_rank=tp_rank, tp_size=tp_size)
    expected = megatron_state_dict(gpt_model)
    missing, unexpected = sorted(set(expected) - set(mapped)), sorted(set(mapped) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"HF->Megatron key mismatch: GPTModel keys not produced {missing[:8]}, "
            f"produced keys GPTModel lacks {unexpected[:8]}"
        )
    for key, tensor in mapped.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise ValueError(
                f"HF->Megatron shape mismatch for {key}: mapped {tuple(tensor.shape)}, "
                f"GPTModel has {tuple(expected[key].shape)}"
            )
    result = gpt_model.load_state_dict(mapped, strict=False)
    left = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if left or result.unexpected_keys:
        raise ValueError(f"load_state_dict left {left[:8]} missing, {result.unexpected_keys[:8]} unexpected")
