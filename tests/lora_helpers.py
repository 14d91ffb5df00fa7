"""LoRA parity helpers: the same HF weights and adapter under peft's LoraModel and under our megatron adapters.

Imported by name (tests/ is on pytest's pythonpath) by the TP=1 unit test and the TP=2 integration test."""

from __future__ import annotations

import torch
from model_helpers import VOCAB, padded_batch, tiny_hf_model
from transformers import Qwen2Config, Qwen2ForCausalLM

from sluiceway.models.lora import LoraAdapters, LoraSpec
from sluiceway.models.megatron_gpt import build_gpt_model
from sluiceway.models.megatron_logprobs import token_logprobs_and_entropy

TEMPERATURE = 0.7
LENGTHS = [12, 7, 3]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def qwen2_model() -> Qwen2ForCausalLM:
    """Qwen2-shaped: q/k/v biases, grouped-query attention, untied head."""
    cfg = Qwen2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        vocab_size=VOCAB, max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval()


def hf_model(kind: str) -> torch.nn.Module:
    return qwen2_model() if kind == "qwen2" else tiny_hf_model(tied=kind == "llama-tied")


def peft_model(kind: str, targets=TARGETS, rank: int = 4, alpha: float = 8.0):
    """peft's LoraModel on the HF model, with random A *and* B (init_lora_weights=False), so the adapter matters."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets),
                     init_lora_weights=False)  # fmt: skip
    return get_peft_model(hf_model(kind), cfg).eval()


def peft_adapter(model) -> dict[str, torch.Tensor]:
    """The adapter's weights under the keys peft saves them (adapter_model.safetensors)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def peft_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """[b, t-1] log-probs of the next tokens at TEMPERATURE (token_logprobs' layout)."""
    logits = model(input_ids=ids).logits[:, :-1].float() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def megatron_with_adapter(hf, adapter: dict, targets=TARGETS, rank: int = 4, alpha: float = 8.0):
    """A GPTModel with the HF weights (frozen) and our adapters holding `adapter`; needs init_parallel_state()."""
    from sluiceway.models.hf_megatron import load_hf_weights

    gpt = build_gpt_model(hf.config).eval()
    load_hf_weights(gpt, hf.state_dict(), hf.config)
    gpt.requires_grad_(False)
    lora = LoraAdapters(hf.config, LoraSpec(rank, alpha, 0.0, tuple(targets)), seed=0)
    lora.load_whole(adapter)
    lora.attach(gpt)
    return gpt, lora


def megatron_logprobs(gpt, ids: torch.Tensor) -> torch.Tensor:
    return token_logprobs_and_entropy(gpt, ids, TEMPERATURE)[0]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and the [b, t-1] mask of real next tokens."""
    ids, mask = padded_batch(LENGTHS)
    return ids, mask[:, 1:].float()
