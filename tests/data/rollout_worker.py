"""A rollout process for the SIGKILL test: runs step 0 of run 'r' slowly enough to be killed midway."""

import asyncio
import json
import sys

from sluiceway.models.zoo import load_tokenizer
from sluiceway.storage.object_store import ObjectStore
from sluiceway.tasks.environments.arithmetic import generate as arithmetic
from sluiceway.tasks.rollout.client import EngineClient
from sluiceway.tasks.rollout.dispatch import PoolDispatcher
from sluiceway.tasks.rollout.pool_target import own_engines
from sluiceway.tasks.rollout.rollout import PromptItem, RolloutSettings, plan_step, run_rollout


async def main(spec: dict) -> None:
    tok = load_tokenizer(spec["model_dir"])
    store = ObjectStore.from_uri(spec["tables"])
    n = spec["groups"]
    prompts = [
        PromptItem(f"arith:{i}", r["input"], tok.encode(r["input"]), r["label"], r["metadata"])
        for i, r in enumerate(arithmetic(n, seed=5))
    ]
    # Same settings as the test's re-run, but one group at a time so the kill lands between groups.
    s = RolloutSettings(
        n_samples=4,
        max_new_tokens=12,
        temperature=1.0,
        top_p=1.0,
        stop_token_ids=[2],
        seed=11,
        groups_needed=n,
        groups_submitted=n,
        max_concurrency=4,
    )
    async with EngineClient(spec["router"], spec["engines"]) as client:
        await run_rollout(
            dispatcher=PoolDispatcher([own_engines(client, s.max_concurrency)]),
            store=store,
            run_id="r",
            step=0,
            work=plan_step(store, "r", 0, prompts, s, []),
            settings=s,
            decode=tok.decode,
        )


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
