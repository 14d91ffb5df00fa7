"""Megatron-core's attention for the CPU path: the GPT layer spec with SDPA core attention (models/megatron_gpt.py
builds the model from it).

megatron's stock local spec uses `DotProductAttention`, which needs a CUDA memory buffer and CUDA RNG forks;
`SDPACoreAttention` runs `F.scaled_dot_product_attention` instead, on CPU and CUDA alike, and in bf16 on CPU short
sequences take an explicit product (`_explicit_causal_attention`) that gives the embedded engine's numbers bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from sluiceway.models.batch_invariant import masked_attention, padded_span
from sluiceway.models.megatron_import import megatron_import

with megatron_import():  # quiet, and torch.compile deferred (models/megatron_import.py)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["SDPACoreAttention", "cpu_layer_spec"]


class SDPACoreAttention(MegatronModule):
    """`core_attention` for megatron's SelfAttention built on `F.scaled_dot_product_attention`.

    Inputs are megatron's [s, b, heads, head_dim] (query: heads of this TP rank, key/value: KV groups of this
    rank); the output is [s, b, heads * head_dim]. Works on CPU (math/flash kernels) and CUDA.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError("SDPACoreAttention does not support context parallelism")
        if config.softmax_type != "vanilla":
            raise NotImplementedError(f"softmax_type={config.softmax_type!r}")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        # apply_query_key_layer_scaling only rescales inside megatron's softmax (a no-op mathematically): ignored.

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences need TE attention; SDPACoreAttention takes [s, b, h, d]")
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by SDPACoreAttention")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        sq, b, nh, hd = query.shape
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if k.size(1) != nh:
            # GQA: query head i uses KV group i // (nh / ng) -- megatron's and HF's grouping alike.
            rep = nh // k.size(1)
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        sk = k.size(2)
        if causal and _explicit_attention_pays(q, sk, attention_mask, self.dropout_p if self.training else 0.0):
            out = _explicit_causal_attention(q, k, v, self.softmax_scale, attention_mask)
            return out.permute(2, 0, 1, 3).reshape(sq, b, nh * hd)
        attn_mask = None
        if attention_mask is not None or (causal and sq != sk):
            # Explicit boolean mask (True = may attend). megatron masks are True where attention is *forbidden*;
            # SDPA's is_causal aligns top-left, so queries at the end of a longer key (decode) need this too.
            allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
            if causal:
                allowed = allowed.tril(sk - sq)
            if attention_mask is not None:
                allowed = allowed & ~attention_mask.bool()
            attn_mask, causal = allowed, False
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=causal,
            scale=self.softmax_scale,
        )
        # [b, h, s, d] -> [s, b, h * d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, nh * hd)


# Largest score matrix (batch x heads x queries x keys) the explicit attention below builds; its fp32 softmax is
# kept for backward, so this bounds it at ~16 MiB a layer.
_EXPLICIT_ATTENTION_MAX_SCORES = 1 << 22


def _explicit_attention_pays(q: Tensor, sk: int, attention_mask: Tensor | None, dropout_p: float) -> bool:
    """Whether to skip SDPA for the explicit product: on CPU in bf16/fp16 with short sequences, SDPA's flash
    kernel is 3x slower forward + backward (SmolLM2 shapes, 72 tokens: 26 vs 8 ms a layer), with a packing mask
    2-3x (150 tokens, 4 rows: 12.3 vs 6.5 ms); in fp32 SDPA is as fast or faster (9.0 vs 10.9 ms)."""
    b, nh, sq, _ = q.shape
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.bfloat16, torch.float16)
        and dropout_p == 0.0
        and sq == sk
        and b * nh * sq * sk <= _EXPLICIT_ATTENTION_MAX_SCORES
    )


def _explicit_causal_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float, forbidden: Tensor | None = None
) -> Tensor:
    """softmax(q k^T * scale + causal mask) v with the softmax in fp32, [b, h, s, d] in and out. `forbidden`
    ([b, 1, s, s], True = may not attend) adds a packing mask; every query may still attend to itself.

    The embedded engine's arithmetic (models/batch_invariant.py): a sample in a row of its own gets the bits the
    engine gave it. In a laid-out row (packed samples, shared prompts) the queries that see the same keys are
    attended as one group over just those keys, gathered: a response then meets its prompt's keys and its own at
    positions 0, 1, ... as in the engine, not spread along the row, where the sums ran in another order (a 0.01
    per-token log-prob gap in bf16 with shared prompts, issue 31).
    """
    s = q.size(2)
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    if forbidden is None:
        return masked_attention(q, k, v, causal, scale)
    # [b * s, h, d]: a query's or key's heads are one gather away (index_select, whose backward is index_add_).
    b, h, s, d = q.shape
    qs, ks, vs = (t.transpose(1, 2).reshape(b * s, h, d) for t in (q, k, v))
    kept_at, kept = [], []
    def pick(t: Tensor, at: Tensor) -> Tensor:  # rows `at` [G, n] of t [b * s, h, d] -> [G, h, n, d]
        return t.index_select(0, at.flatten()).view(*at.shape, h, d).transpose(1, 2)

    for queries, query_real, keys, key_pad in _group_batches(forbidden):
        blocked = (keys[:, None, :] > queries[:, :, None]) | key_pad[:, None, :]  # causal, in the row's positions
        got = masked_attention(pick(qs, queries), pick(ks, keys), pick(vs, keys), blocked[:, None], scale)
        # A padded query slot repeats a real one: only the real slots are kept (and get a gradient).
        kept_at.append(queries[query_real])
        kept.append(got.transpose(1, 2)[query_real])
    out = qs.new_zeros(qs.shape).index_copy(0, torch.cat(kept_at), torch.cat(kept))
    return out.view(b, s, h, d).transpose(1, 2)


def _group_batches(forbidden: Tensor) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """The attention groups of every row of `forbidden` ([b, 1, s, s], True = may not attend), batched: groups
    whose query counts round to the same `padded_span` share one product (a long prompt's group does not pad a
    hundred short responses' to its length). Each batch is (queries [G, Q], query_real [G, Q], keys [G, K],
    key_pad [G, K]): queries and keys as positions in the flattened [b * s] rows, short groups padded with their
    last query (computed, not kept) and with masked keys. A query meets its keys at positions 0, 1, ... of the
    product as in the engine's cache; the padding only widens the key span, which masked_attention makes
    bit-neutral. Made once per mask and kept on it: every layer of a forward (and its recompute) gets the same
    mask object, and this is a Python loop over rows and groups."""
    cached = getattr(forbidden, "_sluiceway_group_batches", None)
    if cached is not None:
        return cached
    b, s = forbidden.size(0), forbidden.size(-1)
    buckets: dict[int, list[tuple[Tensor, Tensor]]] = {}
    for row in range(b):
        for queries, keys in _attention_groups(forbidden[row, 0]):
            buckets.setdefault(padded_span(queries.numel()), []).append((queries + row * s, keys + row * s))
    batches = []
    for groups in buckets.values():
        nq = max(g[0].numel() for g in groups)
        nk = max(g[1].numel() for g in groups)
        queries = torch.stack([F.pad(g[0], (0, nq - g[0].numel()), value=int(g[0][-1])) for g in groups])
        keys = torch.stack([F.pad(g[1], (0, nk - g[1].numel()), value=int(g[1][0])) for g in groups])
        counts_q = torch.tensor([g[0].numel() for g in groups], device=forbidden.device)
        counts_k = torch.tensor([g[1].numel() for g in groups], device=forbidden.device)
        query_real = torch.arange(nq, device=forbidden.device) < counts_q[:, None]
        key_pad = torch.arange(nk, device=forbidden.device) >= counts_k[:, None]
        batches.append((queries, query_real, keys, key_pad))
    forbidden._sluiceway_group_batches = batches
    return batches


def _attention_groups(forbidden: Tensor) -> list[tuple[Tensor, Tensor]]:
    """(queries, keys) index pairs of one laid-out row's [s, s] mask (True = may not attend): queries whose mask rows
    are equal see the same keys (a prompt; one response and its prompt; one packed sample), causality aside."""
    rows, group = torch.unique(forbidden, dim=0, return_inverse=True)
    return [((group == g).nonzero().flatten(), (~rows[g]).nonzero().flatten()) for g in range(rows.size(0))]


def cpu_layer_spec(qk_layernorm: bool = False) -> ModuleSpec:
    """megatron's local (no Transformer Engine) GPT layer spec with RMSNorm and SDPA core attention.

    With `qk_layernorm` the attention's `q_layernorm` / `k_layernorm` are `WrappedTorchNorm`, which builds a
    `torch.nn.RMSNorm(head_dim, eps=config.layernorm_epsilon)` when `config.normalization == "RMSNorm"` (as
    `transformer_config_from_hf` sets): per-head, replicated across TP ranks, CPU-safe. Pinned explicitly so
    the spec does not depend on which norm megatron's backend provider picks.
    """
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)
    attn = spec.submodules.self_attention.submodules
    attn.core_attention = SDPACoreAttention
    if qk_layernorm:
        attn.q_layernorm = WrappedTorchNorm
        attn.k_layernorm = WrappedTorchNorm
    return spec
