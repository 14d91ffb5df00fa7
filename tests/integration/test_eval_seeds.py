"""Eval repeats through a real router and engine: the same seed gives the same numbers."""

import asyncio
import json
import os

from sluiceway.tasks.reward.score import RewardSettings


def test_eval_numbers_repeat_with_the_same_seed(tmp_path):
    from sluiceway.infra.engine_group import EngineGroup
    from sluiceway.infra.router import SGLangRouter
    from sluiceway.models.zoo import load_tokenizer, resolve_checkpoint
    from sluiceway.tasks.environments.arithmetic import generate
    from sluiceway.tasks.evaluate.evaluate import evaluate
    from sluiceway.tasks.rollout.client import EngineClient
    from sluiceway.tasks.rollout.rollout import PromptItem, RolloutSettings

    model_dir = resolve_checkpoint("tiny-llama", cache_dir=tmp_path / "cache")
    tok = load_tokenizer(model_dir)
    prompts = [
        PromptItem(str(i), r["input"], tok.encode(r["input"]), r["label"], {})
        for i, r in enumerate(generate(6, seed=1))
    ]

    def vowels(response, label, sample):
        letters = [c for c in response.lower() if c.isalpha()]
        return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0

    def settings(seed):
        return RolloutSettings(
            n_samples=1,
            max_new_tokens=10,
            temperature=1.0,
            top_p=1.0,
            stop_token_ids=[],
            seed=seed,
            groups_needed=1,
            groups_submitted=1,
        )

    env = dict(os.environ, SLUICEWAY_CACHE=str(tmp_path / "cache"))
    with (
        SGLangRouter(tmp_path / "logs") as router,
        EngineGroup(str(model_dir), 1, tmp_path / "logs", router=router, env=env) as pool,
    ):

        async def run(seed, tag):
            async with EngineClient(router.url, pool.urls) as client:
                return await evaluate(
                    client=client,
                    prompts=prompts,
                    settings=settings(seed),
                    reward_settings=RewardSettings(vowels),
                    n_samples=3,
                    tag=tag,
                    decode=tok.decode,
                )

        a, b, c = asyncio.run(run(7, "a")), asyncio.run(run(7, "b")), asyncio.run(run(8, "c"))
    assert a == b  # same seed, same weights: the same numbers, to the last bit
    assert a["eval/eval/reward_mean"] != c["eval/eval/reward_mean"]
    assert set(a) == {"eval/eval/reward_mean", "eval/eval/pass@1", "eval/eval/pass@2", "eval/eval/prompts"}
    assert json.dumps(a)  # plain floats, storable as metrics
