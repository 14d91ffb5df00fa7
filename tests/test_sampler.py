"""The in-process sampler: KV-cached sampling agrees with a full forward pass, and seeds are per sample."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sluiceway.tasks.rollout.sampler import Sampler, SamplingParams, sample_top_p


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg).eval()


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]


def test_logprobs_match_a_full_forward_pass(model):
    sampler = Sampler(model, pad_token_id=0)
    params = SamplingParams(max_new_tokens=6, temperature=0.7)
    outs = sampler.generate(PROMPTS, params, seeds=[1, 2, 3])
    for prompt, c in zip(PROMPTS, outs):
        ids = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1] / 0.7
        ref = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-5)
        assert c.finish_reason == "length" and len(c.token_ids) == 6


def test_a_sample_depends_on_its_seed_not_its_batch(model):
    sampler = Sampler(model, pad_token_id=0)
    params = SamplingParams(max_new_tokens=5, temperature=1.0)
    together = sampler.generate(PROMPTS, params, seeds=[11, 22, 33])
    alone = sampler.generate(PROMPTS[1:2], params, seeds=[22])
    assert together[1].token_ids == alone[0].token_ids
    again = sampler.generate(PROMPTS, params, seeds=[11, 22, 33])
    assert [c.token_ids for c in again] == [c.token_ids for c in together]


def test_stop_tokens_end_a_sequence(model):
    sampler = Sampler(model, pad_token_id=0)
    first = sampler.generate([PROMPTS[0]], SamplingParams(max_new_tokens=4, temperature=1.0), seeds=[5])[0]
    stop = first.token_ids[1]
    c = sampler.generate(
        [PROMPTS[0]], SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=[stop]), seeds=[5]
    )[0]
    assert c.token_ids[-1] == stop and c.finish_reason == "stop"
    assert len(c.token_ids) == first.token_ids.index(stop) + 1


def test_top_p_keeps_only_the_nucleus():
    logp = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    gens = [torch.Generator().manual_seed(s) for s in range(1)]
    draws = {int(sample_top_p(logp, 0.5, gens)) for _ in range(50)}
    assert draws == {0}
    draws = {int(sample_top_p(logp, 0.85, gens)) for _ in range(200)}
    assert draws == {0, 1}


def test_weight_update_changes_the_version_and_outputs(model):
    import copy

    m = copy.deepcopy(model)
    sampler = Sampler(m, pad_token_id=0)
    before = sampler.generate(PROMPTS, SamplingParams(max_new_tokens=3), seeds=[1, 2, 3])
    sd = {k: v + 0.05 * torch.randn_like(v) for k, v in m.state_dict().items()}
    sampler.update_weights(sd, weight_version=3)
    after = sampler.generate(PROMPTS, SamplingParams(max_new_tokens=3), seeds=[1, 2, 3])
    assert after[0].weight_version == 3 and before[0].weight_version == 0
    assert [c.logprobs for c in after] != [c.logprobs for c in before]
