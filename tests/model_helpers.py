"""Helpers shared by the megatron-core parity and critic tests (imported by name: tests/ is on pytest's pythonpath)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 300
LENGTHS = [12, 7, 3]  # right-padded batch: valid lengths per row


def tiny_config(tied: bool) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )


def tiny_hf_model(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(tied)).eval()
    # Random init leaves norms at 1; perturb them so a swapped norm mapping cannot pass.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def padded_batch(lengths: list[int], seed: int = 1, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids, right-padded with 0 to the longest of `lengths`, and the mask of real tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(lengths), max(lengths)), generator=g)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
        ids[row, n:] = 0
    return ids, mask
