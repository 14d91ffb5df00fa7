"""Custom multi-turn generation through a real router and engine: the engine's tokens are kept, the
environment's are masked."""

import asyncio
import os

import torch
from paths import DATA

from sluiceway.infra.engine_group import EngineGroup
from sluiceway.infra.router import SGLangRouter
from sluiceway.models.zoo import load_tokenizer, resolve_checkpoint
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import read_trajectories
from sluiceway.tasks.rollout.client import EngineClient
from sluiceway.tasks.rollout.dispatch import PoolDispatcher
from sluiceway.tasks.rollout.multiturn import load_custom_generate
from sluiceway.tasks.rollout.pool_target import own_engines
from sluiceway.tasks.rollout.rollout import PromptItem, RolloutSettings, plan_step, run_rollout


def test_two_turns_keep_engine_tokens_and_mask_the_environment(tmp_path):
    model_dir = resolve_checkpoint("tiny-llama", cache_dir=tmp_path / "cache")
    tok = load_tokenizer(model_dir)
    store = ObjectStore.from_uri(str(tmp_path / "tables"))
    agent = load_custom_generate(f"{DATA / 'two_turn_agent.py'}:generate")
    prompts = [
        PromptItem(f"p{i}", f"What is {i} + 1?", tok.encode(f"What is {i} + 1?"), str(i + 1), {}) for i in range(2)
    ]
    s = RolloutSettings(
        n_samples=2,
        max_new_tokens=32,
        temperature=1.0,
        top_p=1.0,
        stop_token_ids=[],
        seed=3,
        groups_needed=2,
        groups_submitted=2,
        custom_generate=agent,
        tokenizer=tok,
    )
    env = dict(os.environ, SLUICEWAY_CACHE=str(tmp_path / "cache"))
    with (
        SGLangRouter(tmp_path / "logs") as router,
        EngineGroup(str(model_dir), 1, tmp_path / "logs", router=router, env=env) as pool,
    ):

        async def go():
            async with EngineClient(router.url, pool.urls) as client:
                return await run_rollout(
                    dispatcher=PoolDispatcher([own_engines(client, s.max_concurrency)]),
                    store=store,
                    run_id="mt",
                    step=0,
                    work=plan_step(store, "mt", 0, prompts, s, []),
                    settings=s,
                    decode=tok.decode,
                )

        asyncio.run(go())

    rows = read_trajectories(store, "mt", 0).to_pylist()
    env_ids = tok.encode("<result>42</result>", add_special_tokens=False)
    assert len(rows) == 4
    for r in rows:
        ids, mask = r["response_token_ids"], r["loss_mask"]
        assert len(ids) == 5 + len(env_ids) + 5 and len(r["rollout_logprobs"]) == len(ids)
        assert ids[5 : 5 + len(env_ids)] == env_ids  # the environment's tokens, as encoded, between the turns
        assert mask == [1] * 5 + [0] * len(env_ids) + [1] * 5

    # The model tokens' log-probs are what the trainer computes on the whole sequence, environment included:
    # the engine saw exactly these ids (nothing was re-tokenized between turns).
    from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
    from sluiceway.models.megatron_logprobs import token_logprobs
    from sluiceway.tasks.train.collation import collate
    from sluiceway.tasks.train.samples import TrainSample
    from sluiceway.tasks.train.trainer import PolicyTrainer

    trainer = PolicyTrainer(
        model_dir,
        TrainingConfig(global_batch_size=4, micro_batch_size=4),
        AlgorithmConfig(),
        temperature=1.0,
        pad_token_id=tok.pad_token_id,
    )
    batch = collate(
        [
            TrainSample(r["prompt_token_ids"], r["response_token_ids"], r["loss_mask"], 0.0, r["rollout_logprobs"])
            for r in rows
        ],
        tok.pad_token_id,
    )
    with torch.no_grad():
        lp = token_logprobs(trainer.model, batch.input_ids)
    m = batch.loss_mask.bool()
    assert float((lp[m] - batch.rollout_logprobs[m]).abs().max()) <= 1e-4
