"""A tiny Qwen3 (q/k norms, a head_dim that is not hidden / heads) for the Megatron mapping tests, and the loss
both the single-process and the data-parallel test take gradients of."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

VOCAB = 300
HEAD_DIM = 24  # != hidden / heads = 16
LENGTHS = [12, 9, 3, 6]  # right-padded; the two DP halves hold 21 and 9 tokens
TEMPERATURE = 0.7


def qwen3_config(tied: bool = False) -> Qwen3Config:
    return Qwen3Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        intermediate_size=96,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )


def qwen3_model(tied: bool = False) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(qwen3_config(tied)).eval()
    with torch.no_grad():  # norms start at 1: perturb them so a swapped or dropped q/k norm cannot pass
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def masked_loss(logp: torch.Tensor, ent: torch.Tensor, valid: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Token-mean policy-gradient-like loss with an entropy bonus, normalised by a given (global) token count."""
    return -((logp + 0.01 * ent) * valid).sum() / n_tokens
