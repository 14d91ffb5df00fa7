"""Logits and token log-probs of a megatron-core GPTModel (models/megatron_gpt.py builds it): the output layer's
logits for the positions asked for, packed rows' attention masks, and log-probs (and entropy) of the target tokens
computed without materialising the whole vocabulary's log-softmax where it can be avoided, across the tensor-parallel
group when the vocabulary is split."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from sluiceway.models.fused_logprobs import (
    linear_token_logprob_entropy,
    token_logprob_entropy,
)
from sluiceway.models.megatron_import import megatron_import

with megatron_import():  # quiet, and torch.compile deferred (models/megatron_import.py)
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


__all__ = [
    "gpt_logits",
    "logprobs_at",
    "packed_attention_mask",
    "token_logprobs",
    "token_logprobs_and_entropy",
]


def gpt_logits(
    model: GPTModel,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    first_position: int = 0,
    seq_first: bool = False,
    keep: Tensor | None = None,
    position_ids: Tensor | None = None,
    hidden_only: bool = False,
) -> Tensor:
    """Logits [b, s - first_position, vocab / tp] (this rank's vocab shard under TP), causal, no padding mask needed.

    `attention_mask` ([b, 1, s, s], True where attention is forbidden) is only for packed rows (see
    `packed_attention_mask`); causal masking is always applied on top of it. `position_ids` ([b, s]) are the
    RoPE positions of each token (default 0..s-1 in every row). `first_position` > 0 skips the
    output layer for the positions before it: with a 49k vocabulary the head and its log-softmax cost as much
    as several layers, and a policy loss needs no logits at prompt positions. `seq_first` returns the output
    layer's own [s - first_position, b, vocab] tensor, saving the model's batch-first copy of it. `keep` (flat
    indices into the [s, b] positions, seq-major) computes logits at those positions only: [len(keep), 1, vocab],
    seq-first. `hidden_only` returns the output layer's input instead (seq-first, hidden wide), for callers that
    apply the output layer themselves (`logprobs_at`'s fused path); the layer then runs on one row.
    """
    b, s = input_ids.shape
    default_positions = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
    captured: list[Tensor] = []
    seq_first = seq_first or keep is not None

    def keep_tail(_module, args, kwargs):  # hidden states [s, b, h] reach the output layer as its first input
        h = args[0]
        h = h.reshape(-1, 1, h.size(-1)).index_select(0, keep) if keep is not None else h[max(first_position, 0) :]
        if hidden_only:
            captured.append(h)
            h = h[:1, :1]
        return (h, *args[1:]), kwargs

    def capture(_module, _args, output):  # (logits [s, b, v], bias): the model transposes a one-column view
        captured.append(output[0])
        return output[0][..., :1], output[1]

    hooks = []
    if first_position > 0 or keep is not None or hidden_only:
        hooks.append(model.output_layer.register_forward_pre_hook(keep_tail, with_kwargs=True))
    if seq_first and not hidden_only:
        hooks.append(model.output_layer.register_forward_hook(capture))
    rope = model.rotary_pos_emb
    rope.positions = position_ids.t() if position_ids is not None else None
    try:
        out = model(input_ids, default_positions, attention_mask=attention_mask)
    finally:
        rope.positions = None
        for h in hooks:
            h.remove()
    return captured[0] if seq_first or hidden_only else out


# Whether `logprobs_at` applies the output layer itself in chunks (`linear_token_logprob_entropy`): None means
# on GPUs only. On CPU the output layer's logits and the cache-sized chunks of `token_logprob_entropy` are as
# fast and give the embedded engine's numbers bit for bit; tests set True to check the fused path there.
FUSED_OUTPUT_LAYER: bool | None = None


def fused_output_weight(model: GPTModel, device: torch.device) -> Tensor | None:
    """The output layer's weight (the tied embedding's where shared) when `logprobs_at` may fuse the output layer
    with the log-prob: one tensor-parallel rank (the vocab whole), megatron's own bias-free output layer (not a
    value head), and FUSED_OUTPUT_LAYER (or, unset, a GPU). None: the output layer makes the logits."""
    wanted = FUSED_OUTPUT_LAYER if FUSED_OUTPUT_LAYER is not None else device.type != "cpu"
    layer = getattr(model, "output_layer", None)
    if not wanted or type(layer) is not ColumnParallelLinear or getattr(layer, "bias", None) is not None:
        return None
    if parallel_state.get_tensor_model_parallel_world_size() != 1:
        return None
    # megatron's shared_embedding_or_output_weight() is the embedding's on the first stage, tied or not.
    return model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else layer.weight


def logprobs_at(
    model: GPTModel,
    input_ids: Tensor,
    rows: Tensor,
    positions: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(log p(target), entropy) fp32 [k] of the next-token distribution at the k positions (rows[i], positions[i]).

    The general form of `token_logprobs`: the output layer runs at the listed positions only, and each names
    its own target, so one position may score several tokens (in a row where responses share a prompt, the
    prompt's last position predicts every response's first token). Under TP the logits are vocab-parallel.
    """
    b = input_ids.size(0)
    weight = fused_output_weight(model, input_ids.device)
    if weight is not None:  # neither the [k, vocab] logits nor their gradient are ever whole
        hidden = gpt_logits(model, input_ids, attention_mask, keep=positions * b + rows, position_ids=position_ids,
                            hidden_only=True)[:, 0]  # fmt: skip
        return linear_token_logprob_entropy(hidden, weight, targets, temperature)
    logits = gpt_logits(model, input_ids, attention_mask, keep=positions * b + rows, position_ids=position_ids)[:, 0]
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return token_logprob_entropy(logits, targets, temperature)
    return _vocab_parallel_logprob_entropy(logits, targets, temperature, True)


def packed_attention_mask(segment_ids: Tensor, members: Tensor | None = None) -> Tensor:
    """[b, 1, s, s] mask forbidding attention across the samples packed into one row (True = forbidden).

    `segment_ids` [b, s] numbers the samples of each row. Positions keep counting across a row: RoPE scores
    depend only on the distance between query and key, so a sample at an offset attends exactly as it would alone.
    With `members` [b, s], a segment is a prompt (member -1) shared by several responses (members 0, 1, ...):
    a response attends to its prompt and to itself, never to the other responses.
    """
    allowed = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)
    if members is not None:
        key, query = members.unsqueeze(-2), members.unsqueeze(-1)
        allowed &= (key == -1) | (key == query)
    return (~allowed).unsqueeze(1)


class _LocalSoftmaxStats(torch.autograd.Function):
    """Per-rank (sum_j exp(s_j), sum_j exp(s_j) s_j) of a vocab shard of shifted logits `s`, saving only `s`.

    Both are recomputed from `s` in backward: d/ds_j = exp(s_j) * (g_sum + g_wsum * (s_j + 1)).
    """

    @staticmethod
    def forward(ctx: Any, shifted: Tensor, with_weighted: bool) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(shifted)
        ctx.with_weighted = with_weighted
        exp = torch.exp(shifted)
        sum_exp = exp.sum(-1)
        weighted = exp.mul_(shifted).sum(-1) if with_weighted else torch.zeros_like(sum_exp)
        return sum_exp, weighted

    @staticmethod
    def backward(ctx: Any, g_sum: Tensor | None, g_weighted: Tensor | None) -> tuple[Tensor, None]:
        (shifted,) = ctx.saved_tensors
        out = torch.exp(shifted)
        if ctx.with_weighted and g_weighted is not None:
            coef = shifted + 1.0
            coef.mul_(g_weighted.unsqueeze(-1))
            if g_sum is not None:
                coef.add_(g_sum.unsqueeze(-1))
            out.mul_(coef)
        elif g_sum is not None:
            out.mul_(g_sum.unsqueeze(-1))
        else:
            out.zero_()
        return out, None


def _shifted_logprobs(
    model: GPTModel,
    input_ids: Tensor,
    temperature: float,
    with_entropy: bool,
    attention_mask: Tensor | None = None,
    first_target: int = 0,
    needed: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """log p(input_ids[:, t+1]) and entropy at t from the model's (possibly vocab-parallel) logits [b, s, v_local].

    Memory: the logits are produced here, so this frame holds the only reference and each full-vocab tensor is
    dropped as soon as the next is made. At TP=1 the fused `token_logprob_entropy` keeps only the output layer's
    logits for backward (in the model's dtype); under TP one fp32 tensor of shifted logits stays saved, and the
    entropy reuses it.

    `first_target` > 0: positions before it get log-prob and entropy 0 without logits computed there (callers
    mask them out: they predict prompt tokens). `needed` (bool [b, s-1]) goes further: logits only where it is
    True (the positions a loss reads: no prompt, no padding), zeros elsewhere.
    """
    if needed is not None:
        b_idx, t_idx = needed.nonzero(as_tuple=True)
        logp, entropy = logprobs_at(model, input_ids, b_idx, t_idx, input_ids[b_idx, t_idx + 1], temperature,
                                    attention_mask)  # fmt: skip
        zeros = torch.zeros(needed.shape, dtype=logp.dtype, device=logp.device)
        logp = zeros.index_put((b_idx, t_idx), logp)
        return logp, zeros.index_put((b_idx, t_idx), entropy) if with_entropy else None
    first = max(0, min(first_target, input_ids.size(1) - 2))
    targets = input_ids[:, first + 1 :]
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        # Seq-first [s, b, v] as the output layer made it: the fused function reads it in place (no copies).
        logits = gpt_logits(model, input_ids, attention_mask, first_position=first, seq_first=True)[:-1]
        logp, entropy = token_logprob_entropy(logits, targets.t(), temperature)
        return _pad_left(logp.t(), first), _pad_left(entropy.t() if with_entropy else None, first)
    logits = gpt_logits(model, input_ids, attention_mask, first_position=first)[:, :-1]
    logp, entropy = _vocab_parallel_logprob_entropy(logits, targets, temperature, with_entropy)
    return _pad_left(logp, first), _pad_left(entropy, first)


def _vocab_parallel_logprob_entropy(
    logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """log p(targets) and entropy from this TP rank's vocab shard of the logits [..., v_local]; fp32 [...]."""
    if logits.dtype != torch.float32:
        logits = logits.float()  # the low-precision copy is freed on rebinding (ToCopyBackward saves nothing)
    if temperature != 1.0:
        logits = logits / temperature  # DivBackward by a scalar saves nothing: the undivided copy is freed
    # Vocab-parallel: each rank holds a slice of the vocab. Per-rank partial sums are all-reduced with megatron's
    # mapping (all-reduce forward, identity backward) and only combined *after* the reduction. That keeps the
    # identity backward exact: a reduced value fed back into rank-local terms would miss the other ranks'
    # gradient contributions. The max is a detached stabiliser (the results do not depend on it).
    group = parallel_state.get_tensor_model_parallel_group()
    v_local = logits.size(-1)
    start = parallel_state.get_tensor_model_parallel_rank() * v_local
    m = logits.detach().amax(-1)
    torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = logits - m.unsqueeze(-1)
    del logits
    local = targets - start
    in_shard = (local >= 0) & (local < v_local)
    tgt = shifted.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1) * in_shard
    local_sum, local_weighted = _LocalSoftmaxStats.apply(shifted, with_entropy)
    sum_exp = reduce_from_tensor_model_parallel_region(local_sum)
    log_z = sum_exp.log()
    logp = reduce_from_tensor_model_parallel_region(tgt) - log_z
    entropy = None
    if with_entropy:
        # H = log Z - sum_i exp(s_i) s_i / Z
        weighted = reduce_from_tensor_model_parallel_region(local_weighted)
        entropy = log_z - weighted / sum_exp
    return logp, entropy


def _pad_left(t: Tensor | None, n: int) -> Tensor | None:
    """Zeros for the `n` skipped positions, so callers keep the [b, s-1] layout."""
    return t if t is None or n == 0 else F.pad(t, (n, 0))


def token_logprobs(
    model: GPTModel,
    input_ids: Tensor,
    temperature: float = 1.0,
    attention_mask: Tensor | None = None,
    first_target: int = 0,
    needed: Tensor | None = None,
) -> Tensor:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) as fp32 [b, s-1], from logits / temperature.

    Right padding is harmless: causal attention keeps valid positions independent of later pad tokens, so
    callers mask out the pad positions of the result. Differentiable (use under no_grad for inference).
    `first_target` and `needed` skip positions no caller reads (see `_shifted_logprobs`).
    """
    logp, _ = _shifted_logprobs(model, input_ids, temperature, False, attention_mask, first_target, needed)
    return logp


def token_logprobs_and_entropy(
    model: GPTModel,
    input_ids: Tensor,
    temperature: float = 1.0,
    attention_mask: Tensor | None = None,
    first_target: int = 0,
    needed: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(log-probs [b, s-1], entropy [b, s-1]) of the next-token distribution at logits / temperature, fp32.

    One pass over the logits feeds both outputs, and no full-vocab fp32 tensor is kept for backward (see
    `_shifted_logprobs`).
    """
    logp, entropy = _shifted_logprobs(model, input_ids, temperature, True, attention_mask, first_target, needed)
    assert entropy is not None
    return logp, entropy
