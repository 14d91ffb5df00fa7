"""A sample that failed is never trained, and a step whose attempt stored nothing to train is generated again
(tasks/rollout/rollout.py `Rollout.retries`, storage/trajectories.py `is_usable`): issue 52 points 1 and 4.

Driven by the scripted engine client of test_rollout_fake_engine.py on real Delta tables; the real runs are
tests/integration/test_nothing_to_train_run.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from fake_engine import FakeEngine, Reply, by_group
from test_rollout_fake_engine import decode, pools, prompts, rows_by_group, settings

from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import RETRIED, read_trajectories, set_rewards
from sluiceway.tasks.filter.apply import filter_step
from sluiceway.tasks.filter.filters import zero_std
from sluiceway.tasks.reward.score import RewardSettings, score_step
from sluiceway.tasks.rollout.rollout import plan_step, run_rollout
from sluiceway.tasks.train.batch import build_train_samples, rollout_metrics


@pytest.fixture
def store(tmp_path) -> ObjectStore:
    return ObjectStore.from_uri(str(tmp_path / "tables"))


def rollout(engine, store, step, work, s):
    return asyncio.run(run_rollout(dispatcher=pools(engine, s), store=store, run_id="r", step=step, work=work,
                                   settings=s, decode=decode))  # fmt: skip


def test_a_step_whose_every_group_aborted_is_generated_again_when_run_again(store):
    s = settings(groups_needed=2, groups_submitted=2)
    work = plan_step(store, "r", 0, prompts(2), s, [])
    broken = FakeEngine(script=lambda rid: Reply(finish_reason="abort", tokens=1))
    first = rollout(broken, store, 0, work, s)
    assert (first.groups_completed, first.groups_aborted) == (0, 2)

    # The cause is fixed; the same step runs again (a resume): the two prompts are generated under new ids.
    fixed = FakeEngine()
    again = rollout(fixed, store, 0, work, s)
    assert (again.groups_completed, again.groups_aborted, again.samples_written) == (2, 0, 4)
    groups = rows_by_group(store, 0)
    assert sorted(groups) == [0, 1, 2, 3]
    assert {r["filter_reason"] for g in (0, 1) for r in groups[g]} == {RETRIED}  # kept, for the record
    assert [groups[g][0]["prompt_id"] for g in (2, 3)] == ["p0", "p1"]
    assert {r["status"] for g in (2, 3) for r in groups[g]} == {"completed"}

    set_rewards(store, "r", 0, [(g, i, float(i), None) for g in (2, 3) for i in range(2)])
    trained = build_train_samples(read_trajectories(store, "r", 0), "grpo", False)
    assert len(trained) == 4 and rollout_metrics(read_trajectories(store, "r", 0))["samples"] == 4

    # A third run of the step finds enough groups: nothing more is generated.
    calls = len(fixed.calls)
    assert rollout(fixed, store, 0, work, s).samples_written == 0 and len(fixed.calls) == calls


def test_retried_groups_are_not_continued_by_the_next_step(store):
    s = settings(groups_needed=1, groups_submitted=1, partial_rollout=True)
    work = plan_step(store, "r", 0, prompts(1), s, [])
    rollout(FakeEngine(script=lambda rid: Reply(finish_reason="abort", tokens=2)), store, 0, work, s)
    assert plan_step(store, "r", 1, prompts(3)[1:], s, prompts(3))[0].partials[0].token_ids  # carried while open
    rollout(FakeEngine(), store, 0, work, s)
    nxt = plan_step(store, "r", 1, prompts(3)[1:], s, prompts(3))
    assert [w.prompt.prompt_id for w in nxt] == ["p1"] and not nxt[0].partials[0].token_ids


def test_a_failed_sample_is_stored_with_its_group_but_never_scored_or_trained(store):
    s = settings(groups_needed=2, groups_submitted=2, n_samples=3)

    def script(rid):
        _, _, g, i = rid.split("/")
        return Reply(finish_reason="failed", tokens=3) if (g, i) == ("0", "1") else Reply(tokens=2 + int(i))

    rollout(FakeEngine(script=script), store, 0, plan_step(store, "r", 0, prompts(2), s, []), s)
    rows = rows_by_group(store, 0)
    assert [r["status"] for r in rows[0]] == ["completed", "failed", "completed"]

    scored = []

    def reward(text, label, row):  # the sample's index as its reward, and a note of who was scored
        scored.append((row["group_id"], row["sample_index"]))
        return float(row["sample_index"])

    score_step(store=store, run_id="r", step=0, settings=RewardSettings(scorer=reward))
    assert (0, 1) not in scored and len(scored) == 5
    filter_step(store=store, run_id="r", step=0, filters=[zero_std])
    table = read_trajectories(store, "r", 0)
    trained = build_train_samples(table, "grpo", False)
    assert sorted((t.group_id, t.sample_index) for t in trained) == [(0, 0), (0, 2), (1, 0), (1, 1), (1, 2)]
    m = rollout_metrics(table)
    assert (m["samples_failed"], m["samples"], m["reward_mean"]) == (1.0, 5.0, 1.0)


def test_a_group_whose_every_sample_failed_fills_no_place_of_the_step(store):
    s = settings(groups_needed=1, groups_submitted=2)
    engine = FakeEngine(script=by_group({0: Reply(finish_reason="failed")}, default=Reply(delay_s=0.05)))
    res = rollout(engine, store, 0, plan_step(store, "r", 0, prompts(2), s, []), s)
    assert (res.groups_completed, res.groups_failed) == (1, 1)
    rows = rows_by_group(store, 0)
    assert {r["filter_reason"] for r in rows[1]} == {None}  # group 1 took the place; not "surplus"


def test_a_custom_generate_that_raises_hangs_or_returns_garbage_fails_its_sample_alone(store):
    """Issue 52 point 8: code we did not write costs its own sample (a failed row naming why), never the step."""
    from dataclasses import dataclass, field

    from sluiceway.tasks.rollout.generation import GenerationDefaults

    @dataclass
    class Made(GenerationDefaults):
        token_ids: list = field(default_factory=lambda: [5, 6])
        logprobs: list = field(default_factory=lambda: [-0.1, -0.2])
        finish_reason: str = "stop"
        latency_s: float = 0.0
        weight_version: int = 0

    async def plugin(ctx, prompt, params):
        g, i = (int(x) for x in ctx.rid.rsplit("/", 2)[-2:])
        if g == 0:
            return Made()
        if i == 0:
            raise KeyError("own-bug")
        if i == 1:
            return None
        if i == 2:
            await asyncio.sleep(3600)
        if i == 3:
            return Made(token_ids=list(range(10**6)), logprobs=[])
        return Made(logprobs=[-0.1])  # one log-prob for two tokens

    s = settings(groups_needed=2, groups_submitted=2, n_samples=5, custom_generate=plugin, timeout_s=0.5)
    res = rollout(FakeEngine(), store, 0, plan_step(store, "r", 0, prompts(2), s, []), s)
    assert (res.groups_completed, res.groups_failed) == (1, 1)
    rows = rows_by_group(store, 0)
    assert {r["status"] for r in rows[0]} == {"completed"}
    assert [r["status"] for r in rows[1]] == ["failed"] * 5
    reasons = [json.loads(r["metadata"])["failure_reason"] for r in rows[1]]
    assert "plugin raised KeyError: 'own-bug'" in reasons[0]
    assert "returned NoneType, not a generation" in reasons[1]
    assert "did not return within 0.5 s (--rollout-timeout-s)" in reasons[2]
    assert "returned 1000000 response tokens, more than the 8 a sample may have" in reasons[3]
    assert "returned 1 log-probs for 2 tokens" in reasons[4]
    assert all(r["response_token_ids"] == [] for r in rows[1])


def test_the_engines_own_errors_still_reach_the_dispatcher(store):
    """A dead engine is not the plugin's fault: the run's own engines' error stops the step, as before."""
    from sluiceway.tasks.rollout.client import EngineCallError

    async def plugin(ctx, prompt, params):
        buf = ctx.new_buffer(prompt.token_ids)
        await ctx.generate(buf, params)
        return buf

    s = settings(groups_needed=1, groups_submitted=1, custom_generate=plugin)
    with pytest.raises(EngineCallError):
        rollout(FakeEngine(dead=True), store, 0, plan_step(store, "r", 0, prompts(1), s, []), s)


def test_the_stop_line_names_the_failing_sample_not_a_sibling_cut_short(store):
    """Issue 52 point 13: an OpenEnv step whose groups all aborted named a sibling's 'finish reason length' (a
    sample cut short because another failed) instead of the cause."""
    from sluiceway.flows.rl import _nothing_to_train
    from sluiceway.infra.errors import Fault

    s = settings(groups_needed=1, groups_submitted=1)

    def script(rid):
        return Reply(tokens=9) if rid.endswith("/0") else Reply(finish_reason="abort", tokens=1)

    rollout(FakeEngine(script=script), store, 0, plan_step(store, "r", 0, prompts(1), s, []), s)
    rows = read_trajectories(store, "r", 0).to_pylist()
    assert [r["finish_reason"] for r in rows] == ["length", "abort"]  # the first, cut at 8 tokens, comes first
    import pyarrow as pa

    from sluiceway.storage.trajectories import update_samples

    update_samples(store, "r", 0, [(0, 1)], {"metadata": pa.array(['{"abort_reason": "openenv: the server died"}'])},
                   "test")  # fmt: skip
    with pytest.raises(Fault, match=r"none of the 1 groups of step 0 has a sample to train: .*\(the first: openenv: "
                                    r"the server died\)"):  # fmt: skip
        _nothing_to_train(store, "r", 0, 1)
