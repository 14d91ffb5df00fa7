"""In-process sampler: batched generation with a KV cache on a transformers causal LM.

It returns, for every sample, the token ids the model produced and their log-probs under the
temperature-scaled distribution (logits / T, before top-p truncation) -- the same quantity the trainer
computes, so the PPO ratio starts at 1 on-policy. The HTTP engine that speaks SGLang's API grows out of
this class in a later stage; the contract (token-in, token-out) is the same.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (hit a stop token) or "length" (hit max_new_tokens)
    weight_version: int
    gen_time_s: float = 0.0


@dataclass
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)


def sample_top_p(logprobs: torch.Tensor, top_p: float, generators: list[torch.Generator]) -> torch.Tensor:
    """Draw one token per row from exp(logprobs) restricted to the top-p nucleus.

    Gumbel-max with one generator per row: a row's sample depends only on its own seed, not on which
    other sequences share the batch, so a resumed or re-batched request reproduces its tokens.
    """
    scores = logprobs.clone()
    if top_p < 1.0:
        sorted_lp, order = logprobs.sort(dim=-1, descending=True)
        sorted_p = sorted_lp.exp()
        # Drop a token when the mass before it already reaches top_p (the most likely token always stays).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        scores.scatter_(-1, order, sorted_lp.masked_fill(drop, float("-inf")))
    u = torch.stack([torch.rand(scores.shape[-1], generator=g) for g in generators])
    gumbel = -torch.log(-torch.log(u.clamp_(1e-20, 1.0 - 1e-7)))
    return (scores + gumbel).argmax(dim=-1)


class Sampler:
    """Generates from a causal LM held in this process; weights are replaced in place by the trainer."""

    def __init__(self, model: torch.nn.Module, pad_token_id: int, dtype: torch.dtype | None = None):
        # Serving in bf16 (as SGLang does) halves memory traffic; log-probs are still taken in fp32.
        self.model = (model.to(dtype) if dtype is not None else model).eval()
        self.pad_token_id = pad_token_id
        self.weight_version = 0
        self.device = next(model.parameters()).device

    def update_weights(self, state_dict: dict[str, torch.Tensor], weight_version: int) -> None:
        """Load new weights (HF names). Strict: a missing or extra tensor is a bug in the mapping."""
        # Tied embeddings appear once in a state dict produced by the trainer; keep the tie.
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and self.model.config.tie_word_embeddings)]
        if missing or unexpected:
            raise RuntimeError(f"weight update mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
        self.weight_version = weight_version

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], micro_batch_size: int = 64
    ) -> list[Completion]:
        """One completion per prompt; `seeds[i]` alone decides prompt i's random draws."""
        out: list[Completion] = []
        for start in range(0, len(prompts), micro_batch_size):
            end = start + micro_batch_size
            out.extend(self._generate_batch(prompts[start:end], params, seeds[start:end]))
        return out

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        t0 = time.perf_counter()
        gens = [torch.Generator(device="cpu").manual_seed(s) for s in seeds]
        b = len(prompts)
        width = max(len(p) for p in prompts)
        # Left padding keeps every sequence's next token in the last column.
        input_ids = torch.full((b, width), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attn[i, width - len(p) :] = 1
        input_ids, attn = input_ids.to(self.device), attn.to(self.device)
        stop = torch.tensor(sorted(set(params.stop_token_ids)) or [-1], device=self.device)

        tokens = torch.zeros((b, params.max_new_tokens), dtype=torch.long)
        logps = torch.zeros((b, params.max_new_tokens), dtype=torch.float32)
        lengths = torch.full((b,), params.max_new_tokens, dtype=torch.long)
        finished = torch.zeros(b, dtype=torch.bool)
        cache = DynamicCache()
        step_ids = input_ids
        for t in range(params.max_new_tokens):
            positions = (attn.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
            logits = self.model(
                input_ids=step_ids,
                attention_mask=attn,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1, :]
            lp = torch.log_softmax(logits.float() / params.temperature, dim=-1).cpu()
            nxt = sample_top_p(lp, params.top_p, gens)
            tokens[:, t] = torch.where(finished, self.pad_token_id, nxt)
            logps[:, t] = lp.gather(-1, nxt[:, None]).squeeze(-1)
            hit_stop = torch.isin(nxt, stop.cpu()) & ~finished
            lengths[hit_stop] = t + 1
            finished |= hit_stop
            if bool(finished.all()):
                break
            step_ids = tokens[:, t : t + 1].to(self.device)
            attn = torch.cat([attn, (~finished).long()[:, None].to(self.device)], dim=1)
        elapsed = time.perf_counter() - t0
        return [
            Completion(
                token_ids=tokens[i, : lengths[i]].tolist(),
                logprobs=logps[i, : lengths[i]].tolist(),
                finish_reason="stop" if bool(finished[i]) else "length",
                weight_version=self.weight_version,
                gen_time_s=elapsed,
            )
            for i in range(b)
        ]
