"""Prompts, rollout settings and a real router + engine pool on tiny-llama, for the rollout tests."""

import os

from sluiceway.infra.engine_group import EngineGroup
from sluiceway.infra.router import SGLangRouter
from sluiceway.tasks.environments.arithmetic import generate as arithmetic
from sluiceway.tasks.rollout.rollout import PromptItem, RolloutSettings


def make_prompts(tokenizer, n: int) -> list[PromptItem]:
    return [
        PromptItem(f"arith:{i}", r["input"], tokenizer.encode(r["input"]), r["label"], r["metadata"])
        for i, r in enumerate(arithmetic(n, seed=5))
    ]


def settings(**kw) -> RolloutSettings:
    base = dict(
        n_samples=4,
        max_new_tokens=12,
        temperature=1.0,
        top_p=1.0,
        stop_token_ids=[2],
        seed=11,
        groups_needed=8,
        groups_submitted=8,
        max_concurrency=8,
    )
    return RolloutSettings(**(base | kw))


def start_stack(tmp, model_dir, n_engines, max_total_len: int = 160):
    router = SGLangRouter(tmp / "logs").start()
    env = dict(os.environ, SLUICEWAY_CACHE=str(model_dir.parent.parent))
    pool = EngineGroup(
        str(model_dir),
        n_engines,
        tmp / "logs",
        router=router,
        env=env,
        engine_args=("--max-running-requests", "16", "--max-total-len", str(max_total_len)),
    ).start()
    return router, pool
