"""A value model on megatron-core: the policy's GPTModel with its LM output layer swapped for a scalar head.

The head sits in GPTModel's `output_layer` slot, so GPTModel's own forward (embedding, decoder, final norm) runs
unchanged and returns [b, s, 1]. It is a plain `hidden -> 1` weight, replicated on every tensor-parallel rank:
the decoder's output is already whole on each rank (the last row-parallel layer all-reduces it), so each rank
computes the same value and the same gradient, and the gradient flowing back into the decoder is the full one
(a vocab-parallel head would need megatron's copy-to-TP-region instead). Megatron does not mark it
`tensor_model_parallel`, so grad-norm code counts it once. Sequence parallelism (hidden states split along the
sequence) is not supported.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from sluiceway.models.hf_megatron import load_hf_weights
from sluiceway.models.megatron_gpt import build_gpt_model
from sluiceway.models.megatron_logprobs import gpt_logits

__all__ = ["ValueHead", "build_value_model", "init_value_head", "token_values"]


class ValueHead(torch.nn.Module):
    """hidden -> 1 without bias, called the way GPTModel calls its output layer: (hidden, weight=...) -> (out, None)."""

    def __init__(self, weight: Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)  # [1, hidden]

    def forward(self, hidden: Tensor, weight: Tensor | None = None, runtime_gather_output: Any = None):
        # `weight` is the tied embedding GPTModel offers its LM head; a value head has its own.
        return F.linear(hidden, self.weight), None


def init_value_head(hidden_size: int, seed: int) -> Tensor:
    """fp32 [1, hidden] ~ N(0, 1 / (hidden + 1)) (OpenRLHF's critic init): values start near 0, and unlike a zero
    head the first step's gradient reaches the decoder. A generator of its own makes it identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, hidden_size, generator=g) / (hidden_size + 1)


def build_value_model(
    hf_config: Any,
    hf_state: dict[str, Tensor],
    head: Tensor,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **config_overrides: Any,
) -> torch.nn.Module:
    """GPTModel with the HF weights (this rank's TP shard) and `head` ([1, hidden], fp32) as its output layer.
    `config_overrides`: TransformerConfig fields, as `build_gpt_model` takes (recompute: `recompute_overrides`)."""
    model = build_gpt_model(hf_config, dtype=dtype, device=device, **config_overrides)
    if model.config.sequence_parallel:
        raise ValueError("the value head does not support sequence parallelism")
    load_hf_weights(model, hf_state, hf_config)
    model.output_layer = ValueHead(head.to(dtype=dtype, device=torch.device(device)).clone())
    return model


def token_values(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
) -> Tensor:
    """fp32 [b, s-1]: at t, the value of the prefix input_ids[:, :t+1], i.e. of the state in which the token at t+1
    is chosen (the layout of `token_logprobs`). `attention_mask` and `position_ids` as in `gpt_logits` (laid-out
    rows only: packed samples, shared prompts)."""
    return gpt_logits(model, input_ids, attention_mask, position_ids=position_ids)[:, :-1, 0].float()
