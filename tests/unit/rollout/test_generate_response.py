"""An engine's /generate response parsed into a GenerateResult."""

from __future__ import annotations

import pytest

from sluiceway.tasks.rollout.client import EngineCallError, parse_generate_response


def test_parse_generate_response():
    body = {
        "text": "x",
        "output_ids": [7, 8],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 8},
            "output_token_logprobs": [[-0.5, 7, None], [-1.5, 8, None]],
            "weight_version": "default",  # SGLang's value before any update
            "prompt_tokens": 3,
        },
    }
    r = parse_generate_response(body, "r", 3, 0.1)
    assert (r.token_ids, r.logprobs, r.finish_reason, r.weight_version) == ([7, 8], [-0.5, -1.5], "stop", 0)
    body["meta_info"]["output_token_logprobs"] = body["meta_info"]["output_token_logprobs"][:1]
    with pytest.raises(EngineCallError, match="2 output ids but 1 logprobs"):
        parse_generate_response(body, "r", 3, 0.1)


@pytest.mark.parametrize(
    "body",
    [
        [],  # an empty batch
        "text",
        {"output_ids": "abc"},
        {"output_ids": [1, -1]},  # token ids a pool may not send
        {"output_ids": [10**12]},
        {"output_ids": [1], "meta_info": {"output_token_logprobs": [[None, 1, None]]}},
        {"output_ids": [1], "meta_info": {"prompt_tokens": "many"}},
        {"output_ids": [1], "meta_info": ["not", "a", "dict"]},
    ],
)
def test_an_answer_of_another_shape_is_an_engine_call_error(body):
    """Issue 40: a remote pool's answer is parsed defensively; anything that is not SGLang's /generate answer is
    an EngineCallError (the dispatcher benches the pool), never a TypeError or IndexError that ends the run."""
    with pytest.raises(EngineCallError, match="is not a /generate answer"):
        parse_generate_response(body, "r", 3, 0.1)
