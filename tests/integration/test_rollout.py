"""The rollout stage through the real sglang-router and real embedded engines (tiny-llama, loopback).

- 32+ samples through the router over two engines; log-probs equal the trainer's; an engine killed
  mid-rollout costs nothing: no duplicate and no missing sample.
- A rollout process SIGKILLed midway: the re-run generates only the missing groups.
- Partial rollouts: aborted groups come back in the next step and finish, recording both weight versions.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch
from paths import DATA
from rollout_helpers import make_prompts, settings, start_stack

from sluiceway.models.zoo import load_tokenizer, resolve_checkpoint
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import read_trajectories
from sluiceway.tasks.rollout.client import EngineClient
from sluiceway.tasks.rollout.dispatch import PoolDispatcher
from sluiceway.tasks.rollout.pool_target import own_engines
from sluiceway.tasks.rollout.rollout import plan_step, run_rollout
from sluiceway.tasks.sync.disk import write_weight_version

WORKER = DATA / "rollout_worker.py"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def model_dir(cache):
    return resolve_checkpoint("tiny-llama", cache_dir=cache)


def finished_requests(url: str) -> int:
    info = httpx.get(f"{url}/server_info", timeout=10).json()
    return int(info["internal_states"][0].get("finished_requests", 0))


def rollout(router, pool, store, step, work, s, decode, **kw):
    async def go():
        async with EngineClient(router.url, pool.urls) as client:
            pools = PoolDispatcher([own_engines(client, s.max_concurrency)])
            return await run_rollout(
                dispatcher=pools, store=store, run_id="r", step=step, work=work, settings=s, decode=decode, **kw
            )

    return asyncio.run(go())


def test_router_two_engines_logprobs_and_engine_death(tmp_path, model_dir):
    tok = load_tokenizer(model_dir)
    store = ObjectStore.from_uri(str(tmp_path / "tables"))
    router, pool = start_stack(tmp_path, model_dir, 2)
    try:
        # 3 groups in flight: the router's manual policy puts a group's samples on one engine and spreads groups.
        s = settings(groups_needed=10, groups_submitted=10, max_new_tokens=24, max_concurrency=12)
        work = plan_step(store, "r", 0, make_prompts(tok, 10), s, [])

        async def go():
            async with EngineClient(router.url, pool.urls) as client:
                task = asyncio.create_task(
                    run_rollout(
                        dispatcher=PoolDispatcher([own_engines(client, s.max_concurrency)]),
                        store=store, run_id="r", step=0, work=work, settings=s, decode=tok.decode,
                    )  # fmt: skip
                )

                # Kill an engine once some groups are stored and both engines served, while others are in flight.
                def early() -> bool:
                    stored = read_trajectories(store, "r", 0).num_rows
                    return stored < 2 * s.n_samples or any(finished_requests(u) == 0 for u in pool.urls)

                while early() and not task.done():
                    await asyncio.sleep(0.2)
                served_before_kill = [finished_requests(u) for u in pool.urls]
                pool.kill(0)
                return await task, served_before_kill

        result, served = asyncio.run(go())
    finally:
        pool.close()
        router.close()
    assert all(n > 0 for n in served), f"both engines must have served requests: {served}"
    rows = read_trajectories(store, "r", 0).to_pylist()
    keys = [(r["group_id"], r["sample_index"]) for r in rows]
    assert len(keys) == len(set(keys)) == 40  # no duplicate, none missing
    assert result.groups_completed == 10 and all(r["status"] in ("completed", "truncated") for r in rows)

    # The engines' log-probs are the trainer's for the same tokens and weights.
    from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
    from sluiceway.models.megatron_logprobs import token_logprobs
    from sluiceway.tasks.train.collation import collate
    from sluiceway.tasks.train.samples import TrainSample
    from sluiceway.tasks.train.trainer import PolicyTrainer

    trainer = PolicyTrainer(
        model_dir,
        TrainingConfig(global_batch_size=40, micro_batch_size=8),
        AlgorithmConfig(),
        temperature=1.0,
        pad_token_id=tok.pad_token_id,
    )
    worst = 0.0
    for r in rows[:16]:
        sample = TrainSample(r["prompt_token_ids"], r["response_token_ids"], r["loss_mask"], 0.0, r["rollout_logprobs"])
        mb = collate([sample], tok.pad_token_id)
        with torch.no_grad():
            lp = token_logprobs(trainer.model, mb.input_ids)
        mask = mb.loss_mask.bool()
        worst = max(worst, float((lp[mask] - mb.rollout_logprobs[mask]).abs().max()))
    assert worst <= 1e-4


def test_sigkilled_rollout_resumes_only_missing_groups(tmp_path, model_dir):
    tok = load_tokenizer(model_dir)
    tables = tmp_path / "tables"
    store = ObjectStore.from_uri(str(tables))
    router, pool = start_stack(tmp_path, model_dir, 1)
    try:
        spec = {
            "tables": str(tables),
            "router": router.url,
            "engines": pool.urls,
            "model_dir": str(model_dir),
            "groups": 12,
        }
        proc = subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)], start_new_session=True)
        deadline = time.monotonic() + 120
        while read_trajectories(store, "r", 0).num_rows < 3 * 4:
            assert proc.poll() is None and time.monotonic() < deadline, "worker ended before it could be killed"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        before = read_trajectories(store, "r", 0).to_pylist()
        groups_before = {r["group_id"] for r in before}
        assert 3 <= len(groups_before) < 12 and len(before) == 4 * len(groups_before)  # whole groups only

        s = settings(groups_needed=12, groups_submitted=12, max_concurrency=4)
        work = plan_step(store, "r", 0, make_prompts(tok, 12), s, [])
        result = rollout(router, pool, store, 0, work, s, tok.decode)
    finally:
        pool.close()
        router.close()
    after = read_trajectories(store, "r", 0).to_pylist()
    assert result.groups_skipped == len(groups_before)
    assert result.samples_written == 4 * (12 - len(groups_before))
    assert len(after) == 48 and len({(r["group_id"], r["sample_index"]) for r in after}) == 48
    # The rows written before the kill are untouched.
    kept = {(r["group_id"], r["sample_index"]): r["response_token_ids"] for r in before}
    assert all(
        r["response_token_ids"] == kept[(r["group_id"], r["sample_index"])]
        for r in after
        if (r["group_id"], r["sample_index"]) in kept
    )


def test_partial_rollouts_continue_in_the_next_step(tmp_path, model_dir):
    tok = load_tokenizer(model_dir)
    store = ObjectStore.from_uri(str(tmp_path / "tables"))
    router, pool = start_stack(tmp_path, model_dir, 1, max_total_len=352)
    prompts = make_prompts(tok, 16)
    # No stop token, and the engine holds 16 of the 32 requests: groups 0-3 run first and finish together,
    # which ends the step; groups 4-7 start only then and need 300 decode steps, far longer than the abort
    # takes to arrive, so they are cut mid-way (with 110 steps, 0.4 s on an idle AMX machine, the abort of a
    # loaded test process once came after they had finished).
    s = settings(
        groups_needed=2,
        groups_submitted=8,
        max_new_tokens=300,
        stop_token_ids=[],
        max_concurrency=32,
        partial_rollout=True,
        mask_offpolicy=True,
    )
    try:
        step0 = rollout(router, pool, store, 0, plan_step(store, "r", 0, prompts[:8], s, prompts), s, tok.decode)
        rows0 = read_trajectories(store, "r", 0).to_pylist()
        aborted = [r for r in rows0 if r["status"] == "aborted"]
        assert step0.groups_completed == 2 and step0.groups_aborted >= 1
        assert any(0 < len(r["response_token_ids"]) < 300 for r in aborted)  # partial tokens were kept

        # New weights (same tensors, new version) reach the engine before step 1.
        from sluiceway.models.zoo import load_hf_state_dict

        v1 = write_weight_version(load_hf_state_dict(model_dir), model_dir, tmp_path / "weights", 1)

        async def update():
            async with EngineClient(router.url, pool.urls) as client:
                await client.update_weights_from_disk(str(v1), 1)

        asyncio.run(update())
        s1 = settings(**{**s.__dict__, "groups_needed": 8, "groups_submitted": 8})
        work1 = plan_step(store, "r", 1, prompts[8:], s1, prompts)
        rollout(router, pool, store, 1, work1, s1, tok.decode)
    finally:
        pool.close()
        router.close()
    carried = {r["group_id"] for r in aborted}
    assert [w.prompt.prompt_id for w in work1[: len(carried)]] == [
        next(r["prompt_id"] for r in aborted if r["group_id"] == g) for g in sorted(carried)
    ]
    rows1 = read_trajectories(store, "r", 1).to_pylist()
    continued = [r for r in rows1 if json.loads(r["metadata"]).get("continued_from_step") == 0]
    assert len(continued) == len(aborted)
    assert all(r["status"] in ("completed", "truncated") for r in continued)
    by_key = {(r["group_id"], r["sample_index"]): r for r in aborted}
    for r in continued:
        # Carried groups take the first group ids of the next step, in the order of their old ids.
        old = by_key[(sorted(carried)[r["group_id"]], r["sample_index"])]
        n_old = len(old["response_token_ids"])
        assert r["response_token_ids"][:n_old] == old["response_token_ids"]  # the partial tokens, kept exactly
        assert r["loss_mask"][:n_old] == [0] * n_old  # masked: they came from the old weights
        if 0 < n_old < len(r["response_token_ids"]):
            assert r["weight_versions"] == [0, 1]
