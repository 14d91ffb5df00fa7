"""The step's rollout (tasks/rollout/rollout.py: Rollout) driven by a scripted engine client, writing real Delta
tables in tmp_path: over-sampling with a filter, abort with partial tokens, continuing a partial rollout, a dead
remote pool and a hedged slow one, a multi-turn generate function, each in well under a second.
tests/integration/test_rollout.py, test_pool_rollouts.py and test_multiturn_engine.py run the same paths through
real routers and engines.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from fake_engine import FakeEngine, Reply, by_group

from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import read_trajectories
from sluiceway.tasks.rollout.dispatch import HedgePolicy, PoolDispatcher
from sluiceway.tasks.rollout.pool_target import PoolTarget, own_engines
from sluiceway.tasks.rollout.rollout import (
    PromptItem,
    Rollout,
    RolloutSettings,
    group_key,
    plan_step,
    run_rollout,
    sample_seed,
)


@pytest.fixture
def store(tmp_path) -> ObjectStore:
    return ObjectStore.from_uri(str(tmp_path / "tables"))


def prompts(n: int) -> list[PromptItem]:
    return [PromptItem(f"p{i}", f"prompt {i}", [1, 2, 3, 10 + i], str(i), {"i": i}) for i in range(n)]


def settings(**kw) -> RolloutSettings:
    base = dict(n_samples=2, max_new_tokens=8, temperature=1.0, top_p=1.0, stop_token_ids=[2], seed=7,
                groups_needed=2, groups_submitted=2, max_concurrency=64)  # fmt: skip
    return RolloutSettings(**(base | kw))


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def pools(client, s, remote_pools=(), min_version=None, hedge=None) -> PoolDispatcher:
    """The run's own engines (``client``, the settings' max_concurrency at once) and ``remote_pools``."""
    return PoolDispatcher([own_engines(client, s.max_concurrency), *remote_pools], min_version, hedge=hedge)


def rollout(client, store, step, work, s, remote_pools=(), min_version=None, **kw):
    return run_rollout(dispatcher=pools(client, s, remote_pools, min_version), store=store, run_id="r", step=step,
                       work=work, settings=s, decode=decode, **kw)  # fmt: skip


def rows_by_group(store, step) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r in read_trajectories(store, "r", step).to_pylist():
        out.setdefault(r["group_id"], []).append(r)
    return {g: sorted(rs, key=lambda r: r["sample_index"]) for g, rs in out.items()}


def sample_of(rid: str) -> tuple[int, int]:
    _, _, g, i = rid.split("#")[0].split("/")
    return int(g), int(i)


def test_over_sampling_with_a_filter_stops_at_the_groups_needed(store):
    s = settings(groups_needed=2, groups_submitted=5)
    engine = FakeEngine(script=by_group({
        0: Reply(delay_s=0.01),
        1: Reply(),  # first to finish, but the filter drops it
        2: Reply(delay_s=0.02),
        3: Reply(hang=True, partial=3),  # in flight when the step has enough: aborted
        4: Reply(delay_s=0.08),  # the abort missed it: finishes after the step had enough
    }))  # fmt: skip
    progress = []

    def zero_std(rows):  # stands in for dynamic sampling's filter
        return "zero_std" if rows[0]["prompt_id"] == "p1" else None

    work = plan_step(store, "r", 0, prompts(5), s, [])
    result = asyncio.run(
        rollout(engine, store, 0, work, s, group_filter=zero_std, on_progress=lambda *a: progress.append(a))
    )

    assert (result.groups_completed, result.groups_aborted, result.samples_written) == (2, 1, 10)
    assert progress == [(1, 2), (2, 2)] and engine.aborts == 1
    groups = rows_by_group(store, 0)
    reasons = {g: {r["filter_reason"] for r in rs} for g, rs in groups.items()}
    assert reasons == {0: {None}, 1: {"zero_std"}, 2: {None}, 3: {None}, 4: {"surplus"}}
    assert {r["status"] for g in (0, 1, 2, 4) for r in groups[g]} == {"completed"}
    assert {r["status"] for r in groups[3]} == {"aborted"}
    # Each sample is one request with its own rid and seed; a group's samples share a routing key.
    for c in engine.calls:
        g, i = sample_of(c.rid)
        assert c.params["sampling_seed"] == sample_seed(7, 0, g, i) and c.routing_key == group_key("r", 0, g)
        assert c.input_ids == work[g].prompt.token_ids and c.params["max_new_tokens"] == 8
    assert len(engine.calls) == 10

    # A re-run finds every group in the table: nothing is generated twice.
    again = asyncio.run(rollout(engine, store, 0, work, s))
    assert again.groups_skipped == 5 and again.samples_written == 0 and len(engine.calls) == 10


def test_abort_keeps_partial_tokens_and_cuts_whole_groups(store):
    def script(rid):
        g, i = sample_of(rid)
        if g == 1 and i == 0:
            return Reply(tokens=4)  # finished, but its group is cut: stored as a partial too
        return Reply(delay_s=0.01) if g == 0 else Reply(hang=True, partial=3 if g == 1 else 0)

    s = settings(groups_needed=1, groups_submitted=3)
    engine = FakeEngine(script=script, version=4)
    result = asyncio.run(rollout(engine, store, 0, plan_step(store, "r", 0, prompts(3), s, []), s))

    assert (result.groups_completed, result.groups_aborted) == (1, 2)
    groups = rows_by_group(store, 0)
    assert {r["status"] for r in groups[0]} == {"completed"}
    cut = groups[1]
    assert [r["status"] for r in cut] == ["aborted", "aborted"]
    assert [r["finish_reason"] for r in cut] == ["stop", "abort"]
    assert cut[1]["response_token_ids"] == [100, 101, 102] and cut[1]["response_text"] == "100 101 102"
    assert cut[1]["rollout_logprobs"] == pytest.approx([-0.01, -0.02, -0.03]) and cut[1]["loss_mask"] == [1, 1, 1]
    assert cut[1]["weight_versions"] == [4] and cut[1]["weight_version"] == 4
    assert all(r["response_token_ids"] == [] and r["weight_versions"] == [4] for r in groups[2])


def test_groups_not_yet_sent_when_the_step_has_enough_are_stored_aborted(store):
    # Room for one group at a time: groups 1 and 2 get a pool only after group 0 ended the step.
    s = settings(groups_needed=1, groups_submitted=3, max_concurrency=2)
    engine = FakeEngine(version=3)
    result = asyncio.run(rollout(engine, store, 0, plan_step(store, "r", 0, prompts(3), s, []), s))
    assert (result.groups_completed, result.groups_aborted) == (1, 2) and len(engine.calls) == 2
    groups = rows_by_group(store, 0)
    for g in (1, 2):
        assert all(r["status"] == "aborted" and r["response_token_ids"] == [] for r in groups[g])
        assert all(r["weight_version"] == 3 for r in groups[g])  # the latest version the step saw


def test_a_partial_rollout_continues_from_its_tokens_in_the_next_step(store):
    ps = prompts(4)
    s0 = settings(groups_needed=1, groups_submitted=2, partial_rollout=True, mask_offpolicy=True)
    s1 = settings(**{**s0.__dict__, "groups_needed": 2, "groups_submitted": 2})

    def step0(rid):
        g, i = sample_of(rid)
        if g == 0:
            return Reply(delay_s=0.01)
        return Reply(hang=True, partial=3 if i == 0 else 8)  # sample 1 was cut at the full length

    engine = FakeEngine(script=step0, version=0)

    async def go():
        await rollout(engine, store, 0, plan_step(store, "r", 0, ps[:2], s0, ps), s0)
        engine.version, engine.script = 1, lambda rid: Reply(tokens=2, first_token=200)  # new weights
        work1 = plan_step(store, "r", 1, ps[2:], s1, ps)
        return work1, await rollout(engine, store, 1, work1, s1)

    work1, result = asyncio.run(go())
    assert [w.prompt.prompt_id for w in work1] == ["p1", "p2"]  # the carried group first, then new prompts
    assert result.groups_completed == 2

    sent = engine.call("r/1/0/0")
    assert sent.input_ids == ps[1].token_ids + [100, 101, 102]  # the prompt and the partial's tokens
    assert sent.params["max_new_tokens"] == 8 - 3
    assert not [c for c in engine.calls if c.rid == "r/1/0/1"]  # already at full length: not sent again

    cont, full = rows_by_group(store, 1)[0]
    assert cont["response_token_ids"] == [100, 101, 102, 200, 201] and cont["status"] == "completed"
    assert cont["loss_mask"] == [0, 0, 0, 1, 1]  # the old policy's tokens are masked out of the loss
    assert len(cont["rollout_logprobs"]) == 5
    assert cont["weight_versions"] == [0, 1] and cont["weight_version"] == 1
    assert json.loads(cont["metadata"]) == {"i": 1, "continued_from_step": 0, "offpolicy_tokens": 3}
    assert full["status"] == "truncated" and full["finish_reason"] == "length"
    assert len(full["response_token_ids"]) == 8 and full["weight_versions"] == [0]
    fresh = rows_by_group(store, 1)[1]
    assert all(r["prompt_id"] == "p2" and r["response_token_ids"] == [200, 201] for r in fresh)


def test_a_dead_remote_pool_is_benched_and_its_group_goes_elsewhere(store, caplog):
    s = settings(groups_needed=6, groups_submitted=6, max_concurrency=2)  # one group at a time per pool
    local = FakeEngine("local", script=lambda rid: Reply(delay_s=0.005), version=5)
    east = FakeEngine("east", script=lambda rid: Reply(delay_s=0.005), version=5)
    dead = FakeEngine("dead", dead=True)
    remote = [PoolTarget("east", east, 2, version=5), PoolTarget("dead", dead, 2, version=5)]
    with caplog.at_level(logging.INFO, logger="sluiceway"):
        result = asyncio.run(rollout(local, store, 0, plan_step(store, "r", 0, prompts(6), s, []), s,
                                     remote_pools=remote, min_version=5))  # fmt: skip

    assert result.groups_completed == 6 and dead.calls, (result, dead.calls)  # the dead pool was given a group ...
    assert "pool dead failed" in caplog.text  # ... failed it, and was benched
    rows = read_trajectories(store, "r", 0).to_pylist()
    assert len(rows) == 12 and {r["status"] for r in rows} == {"completed"}
    assert {r["pool"] for r in rows} == {"local", "east"}, [(r["group_id"], r["pool"]) for r in rows]
    assert {r["engine"] for r in rows if r["pool"] == "east"} == {"router"}  # never a pool URL (credentials)
    assert {r["engine"] for r in rows if r["pool"] == "local"} == {"router"}
    assert len({sample_of(c.rid)[0] for c in dead.calls}) == 1, dead.calls  # benched: no second group


def test_a_slow_remote_pool_is_hedged_on_the_run_s_own_engines(store, caplog):
    s = settings(groups_needed=4, groups_submitted=4, max_concurrency=2)  # one group at a time per pool
    local = FakeEngine("local", script=lambda rid: Reply(delay_s=0.01))
    slow = FakeEngine("slow", script=lambda rid: Reply(delay_s=30.0))
    work = plan_step(store, "r", 0, prompts(4), s, [])
    run = Rollout(dispatcher=pools(local, s, [PoolTarget("slow", slow, 2, version=0)], min_version=0,
                                   hedge=HedgePolicy(min_s=0.05, poll_s=0.01)),
                  store=store, run_id="r", step=0, work=work, settings=s, decode=decode)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="sluiceway"):
        result = asyncio.run(asyncio.wait_for(run.run(), 10))

    assert slow.calls  # the slow pool was given a group ...
    assert "pool slow slow" in caplog.text  # ... which the run's engines generated too, and finished first
    assert {c.outcome for c in slow.calls} == {"cancelled"}  # the slow copy was dropped, not waited for
    rows = read_trajectories(store, "r", 0).to_pylist()
    assert result.groups_completed == 4 and len(rows) == 8
    assert {r["pool"] for r in rows} == {"local"} and {r["status"] for r in rows} == {"completed"}
    hedged = {c.rid for c in slow.calls}
    assert hedged <= {c.rid for c in local.calls}  # same rids on both: the same samples


def test_a_remote_pool_s_requests_are_dropped_once_the_step_has_enough(store):
    # Its router cannot abort them: they are cancelled on our side and the group is stored as aborted.
    s = settings(groups_needed=1, groups_submitted=2, max_concurrency=2)
    local = FakeEngine("local", script=lambda rid: Reply(delay_s=0.01), version=3)
    far = FakeEngine("far", script=lambda rid: Reply(delay_s=30.0), version=3)
    work = plan_step(store, "r", 0, prompts(2), s, [])
    result = asyncio.run(asyncio.wait_for(
        rollout(local, store, 0, work, s, remote_pools=[PoolTarget("far", far, 2, version=3)], min_version=3), 10
    ))  # fmt: skip
    assert (result.groups_completed, result.groups_aborted) == (1, 1)
    assert {c.outcome for c in far.calls} == {"cancelled"} and local.aborts == 1
    far_rows = rows_by_group(store, 0)[1]
    assert all(r["status"] == "aborted" and r["pool"] == "far" and r["weight_version"] == 3 for r in far_rows)


def test_a_pool_serving_an_older_version_than_it_reported_refuses_the_pinned_requests(store):
    # Every request names the oldest version it may be sampled at: the pool's engine refuses, the group goes
    # to a pool that is current, and nothing stale is generated.
    s = settings(groups_needed=2, groups_submitted=2, max_concurrency=2)
    local = FakeEngine("local", script=lambda rid: Reply(delay_s=0.01), version=5)
    behind = FakeEngine("behind", script=lambda rid: Reply(delay_s=0.01), version=4)  # reports 5, serves 4
    work = plan_step(store, "r", 0, prompts(2), s, [])
    result = asyncio.run(
        rollout(local, store, 0, work, s, remote_pools=[PoolTarget("behind", behind, 2, version=5)], min_version=5)
    )
    rows = read_trajectories(store, "r", 0).to_pylist()
    assert {r["pool"] for r in rows} == {"local"} and result.groups_completed == 2
    assert behind.calls and {c.outcome for c in behind.calls} == {"refused"}
    assert all(c.min_weight_version == 5 for c in behind.calls + local.calls)


def test_a_pool_that_ignores_the_pin_and_serves_an_older_version_is_filtered_as_stale(store):
    # SGLang engines do not enforce the pin: the version in each answer is still checked after the fact.
    s = settings(groups_needed=2, groups_submitted=2, max_concurrency=2)
    local = FakeEngine("local", script=lambda rid: Reply(delay_s=0.01), version=5)
    behind = FakeEngine("behind", script=lambda rid: Reply(delay_s=0.01), version=4, enforces_pin=False)
    work = plan_step(store, "r", 0, prompts(2), s, [])
    result = asyncio.run(
        rollout(local, store, 0, work, s, remote_pools=[PoolTarget("behind", behind, 2, version=5)], min_version=5)
    )
    reasons = {r["pool"]: r["filter_reason"] for r in read_trajectories(store, "r", 0).to_pylist()}
    assert reasons == {"local": None, "behind": "stale"} and result.groups_completed == 1


def test_a_custom_generate_function_drives_the_engine_turn_by_turn(store):
    async def agent(ctx, prompt, params):
        buf = ctx.new_buffer(prompt.token_ids)
        await ctx.generate(buf, params)
        buf.add_env([7, 7])  # a tool's answer: not trained on
        await ctx.generate(buf, params)
        return buf

    s = settings(groups_needed=1, groups_submitted=1, max_new_tokens=16, custom_generate=agent)
    engine = FakeEngine(script=lambda rid: Reply(tokens=3), version=2)
    work = plan_step(store, "r", 0, prompts(1), s, [])
    asyncio.run(rollout(engine, store, 0, work, s))

    second = engine.call("r/0/0/0#1")
    assert second.input_ids == [1, 2, 3, 10, 100, 101, 102, 7, 7] and second.params["max_new_tokens"] == 16 - 5
    assert second.routing_key == group_key("r", 0, 0)  # every turn of the group goes to one engine
    for r in rows_by_group(store, 0)[0]:
        assert r["response_token_ids"] == [100, 101, 102, 7, 7, 100, 101, 102]
        assert r["loss_mask"] == [1, 1, 1, 0, 0, 1, 1, 1] and len(r["rollout_logprobs"]) == 8
        assert r["weight_versions"] == [2] and r["status"] == "completed"


def test_a_fan_out_is_more_rows_of_the_group(store):
    """A generation carrying siblings (a slime generate's list of Samples): every one a row of the same group,
    sample_index after the planned ones; the group is judged and stored whole, a re-run finds it stored, and its
    advantages are normalised over all its rows."""
    from dataclasses import dataclass, field

    from sluiceway.tasks.rollout.generation import GenerationDefaults
    from sluiceway.tasks.train.batch import build_train_samples

    @dataclass
    class Made(GenerationDefaults):
        token_ids: list[int] = field(default_factory=list)
        logprobs: list[float] = field(default_factory=list)
        finish_reason: str = "stop"
        latency_s: float = 0.0
        weight_version: int = 1
        siblings: list | None = None

    async def agents(ctx, prompt, params):
        i = int(ctx.rid.rsplit("/", 1)[1])
        return Made([50 + i], [-0.5], siblings=[Made([60 + i], [-0.25]), Made([70 + i], [-0.125])])

    s = settings(groups_needed=1, groups_submitted=1, custom_generate=agents)
    work = plan_step(store, "r", 0, prompts(1), s, [])
    first = asyncio.run(rollout(FakeEngine(), store, 0, work, s))
    rows = rows_by_group(store, 0)[0]
    assert [r["sample_index"] for r in rows] == list(range(6)) and first.samples_written == 6
    assert [r["response_token_ids"] for r in rows] == [[50], [51], [60], [70], [61], [71]]
    assert all(r["filter_reason"] is None and r["status"] == "completed" for r in rows)
    again = asyncio.run(rollout(FakeEngine(), store, 0, work, s))
    assert again.groups_skipped == 1 and again.samples_written == 0
    from sluiceway.storage.trajectories import set_rewards

    set_rewards(store, "r", 0, [(0, r["sample_index"], float(r["sample_index"] % 2), None) for r in rows])
    samples = build_train_samples(read_trajectories(store, "r", 0), "grpo", False)
    assert len(samples) == 6 and abs(sum(x.advantage for x in samples)) < 1e-6
