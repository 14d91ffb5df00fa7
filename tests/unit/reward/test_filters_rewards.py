"""Filters (exact counts, reasons kept in the table), the reward stage's failure handling, pass@k, adaptive
sources and reward shaping."""

import asyncio
import json
import time
from datetime import UTC, datetime

import pytest

from sluiceway.flows.config import RolloutConfig
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import append_trajectories, read_trajectories
from sluiceway.tasks.filter.apply import filter_step
from sluiceway.tasks.filter.filters import build_filters, user_filter
from sluiceway.tasks.reward.score import RewardSettings, score_rows, score_step


def row(group, sample, reward, status="completed", versions=(3,), n_tokens=4, reason=None):
    return {
        "run_id": "f",
        "step": 0,
        "group_id": group,
        "sample_index": sample,
        "prompt_id": f"p{group}",
        "prompt": "q",
        "label": "1",
        "prompt_token_ids": [1, 2],
        "response_token_ids": list(range(n_tokens)),
        "response_text": "x" * n_tokens,
        "rollout_logprobs": [-1.0] * n_tokens,
        "loss_mask": [1] * n_tokens,
        "reward": reward,
        "status": status,
        "finish_reason": "stop" if status == "completed" else "length",
        "weight_version": versions[-1],
        "weight_versions": list(versions),
        "engine": "e",
        "pool": "p",
        "gen_time_s": 0.1,
        "created_at": datetime.now(UTC),
        "filter_reason": reason,
    }


@pytest.fixture
def batch(tmp_path):
    """Eight groups of two: each built to meet exactly one fate."""
    store = ObjectStore.from_uri(str(tmp_path / "tables"))
    rows = [
        row(0, 0, 1.0),
        row(0, 1, 0.0),  # kept
        row(1, 0, 0.5),
        row(1, 1, 0.25),  # kept
        row(2, 0, 1.0),
        row(2, 1, 1.0),  # zero_std
        row(3, 0, 0.0),
        row(3, 1, 0.0),  # zero_std
        row(4, 0, 1.0),
        row(4, 1, 0.0, status="truncated"),  # truncated
        row(5, 0, 1.0, versions=(0, 3)),
        row(5, 1, 0.0),  # stale: a token from version 0, trainer at 3
        row(6, 0, 1.0, n_tokens=50),
        row(6, 1, 0.0),  # overlong
        row(7, 0, 1.0, reason="surplus"),
        row(7, 1, 0.0, reason="surplus"),  # decided at rollout
        row(8, 0, None, status="aborted"),
        row(8, 1, None, status="aborted"),  # unfinished: not a group here
    ]
    append_trajectories(store, rows, app_id="f/0")
    return store


def test_filter_counts_are_exact_and_reasons_stored(batch):
    cfg = RolloutConfig(
        dynamic_sampling_filter_path="zero_std", max_staleness=2, filter_truncated=True, filter_overlong_len=20
    )
    res = filter_step(store=batch, run_id="f", step=0, filters=build_filters(cfg, current_version=3))
    assert res.groups_kept == 2
    assert res.groups_dropped == {"zero_std": 2, "truncated": 1, "stale": 1, "overlong": 1, "surplus": 1}
    assert res.metrics()["filter/dropped_zero_std"] == 2.0
    stored = {
        (r["group_id"], r["sample_index"]): r["filter_reason"] for r in read_trajectories(batch, "f", 0).to_pylist()
    }
    assert stored[(2, 1)] == "zero_std" and stored[(5, 0)] == "stale" and stored[(0, 0)] is None
    assert stored[(8, 0)] is None  # aborted partials are left for the step that finishes them
    again = filter_step(store=batch, run_id="f", step=0, filters=build_filters(cfg, current_version=3))
    assert (again.groups_kept, again.groups_dropped, again.newly_dropped) == (2, res.groups_dropped, 0)


def test_user_filter_from_a_file(batch, tmp_path):
    f = tmp_path / "my_filter.py"
    f.write_text("def small_rewards(rows):\n    return max(r['reward'] for r in rows) >= 1.0 or 'low_reward'\n")
    res = filter_step(store=batch, run_id="f", step=0, filters=[user_filter(f"{f}:small_rewards")])
    assert res.groups_dropped == {"low_reward": 2, "surplus": 1}  # groups 1 (max .5) and 3 (max 0)


def test_scorer_errors_and_timeouts_mark_the_sample(tmp_path):
    def scorer(response, label, sample):
        if response == "boom":
            raise RuntimeError("scorer crashed")
        if response == "slow":
            time.sleep(5)
        return {"acc": 1.0, "len": len(response)}

    rows = [
        {"group_id": 0, "sample_index": i, "response_text": t, "label": "1"}
        for i, t in enumerate(["ok", "boom", "slow"])
    ]
    out = score_rows(rows, RewardSettings(scorer, timeout_s=0.5, reward_key="acc"))
    assert out[0] == (1.0, {"len": 2})
    assert out[1][0] == 0.0 and out[1][1]["reward_status"] == "error" and "scorer crashed" in out[1][1]["message"]
    assert out[2][0] == 0.0 and out[2][1]["reward_status"] == "timeout"
    missing_key = score_rows(rows[:1], RewardSettings(scorer, timeout_s=5))
    assert missing_key[0][1]["reward_status"] == "error" and "--reward-key" in missing_key[0][1]["message"]


@pytest.mark.parametrize(
    "out, shown",
    [
        (float("nan"), "nan"),
        (float("inf"), "inf"),
        ((float("-inf"), {"why": "log 0"}), "-inf"),
        ({"acc": float("nan")}, "nan"),
        ("nan", "nan"),  # float("nan") of the scorer's text
    ],
)
def test_a_non_finite_reward_is_the_samples_failure(out, shown):
    """NaN or inf from a scorer is that sample's failure with its reason, as a scorer that raises: never a reward."""
    rows = [{"group_id": 0, "sample_index": i, "response_text": t, "label": "1"} for i, t in enumerate(["ok", "bad"])]
    scorer = lambda response, label, sample: out if response == "bad" else {"acc": 1.0}  # noqa: E731
    got = score_rows(rows, RewardSettings(scorer, reward_key="acc"))
    assert got[0] == (1.0, {})
    assert got[1] == (0.0, {"reward_status": "error", "message": f"the scorer returned a non-finite reward {shown}"})
    group = score_rows(rows, RewardSettings(lambda rs, ls, ss: [1.0, out], reward_key="acc", group_rm=True))
    assert group[0] == (1.0, {}) and group[1][1]["reward_status"] == "error"  # its group's other samples count


@pytest.mark.parametrize("out", [1e308, -1e39, {"acc": 1e300}])  # an int of 400 digits: OverflowError, its failure
def test_a_reward_beyond_float32_is_the_samples_failure(out):
    """Finite in Python but not in float32, where advantages and losses are computed (issue 40: 1e308 became inf
    and every loss of the step NaN): the sample's failure with its reason, as NaN is."""
    rows = [{"group_id": 0, "sample_index": i, "response_text": t, "label": "1"} for i, t in enumerate(["ok", "bad"])]
    scorer = lambda response, label, sample: out if response == "bad" else {"acc": 1.0}  # noqa: E731
    got = score_rows(rows, RewardSettings(scorer, reward_key="acc"))
    assert got[0] == (1.0, {})
    assert got[1][0] == 0.0 and got[1][1]["reward_status"] == "error"
    assert "beyond float32's range" in got[1][1]["message"] and len(got[1][1]["message"]) < 200
    assert score_rows(rows[:1], RewardSettings(lambda *a: 3.0e38)) == [(3.0e38, {})]  # within the range: a reward


def test_set_rewards_refuses_a_reward_beyond_float32(tmp_path):
    from sluiceway.storage.trajectories import set_rewards

    store = ObjectStore.from_uri(str(tmp_path / "tables"))
    append_trajectories(store, [row(0, 0, None)], app_id="f/0")
    with pytest.raises(
        ValueError, match=r"reward 1e\+308 beyond float32's range .* for f step 0 \(group 0, sample 0\)"
    ):
        set_rewards(store, "f", 0, [(0, 0, 1e308, None)])


def test_a_nan_scorer_fails_one_sample_and_the_step_goes_on(tmp_path):
    store = ObjectStore.from_uri(str(tmp_path / "tables"))
    append_trajectories(store, [row(g, i, None) for g in range(2) for i in range(2)], app_id="f/0")

    def scorer(response, label, sample):
        return float("nan") if (sample["group_id"], sample["sample_index"]) == (1, 0) else 0.5

    res = score_step(store=store, run_id="f", step=0, settings=RewardSettings(scorer))
    assert (res.scored, res.errors) == (4, 1)
    stored = {(r["group_id"], r["sample_index"]): r for r in read_trajectories(store, "f", 0).to_pylist()}
    assert [stored[k]["reward"] for k in sorted(stored)] == [0.5, 0.5, 0.0, 0.5]
    assert json.loads(stored[(1, 0)]["reward_details"]) == {
        "reward_status": "error",
        "message": "the scorer returned a non-finite reward nan",
    }


def _with_stored_nan(tmp_path):
    """A step as a build before the reward check left it: sample (1, 0) holds reward NaN, the rest are scored."""
    from sluiceway.storage.tables import append_idempotent, conform
    from sluiceway.storage.trajectories import PARTITION_BY, TRAJECTORIES, TRAJECTORY_SCHEMA, _rows_to_table

    store = ObjectStore.from_uri(str(tmp_path / "tables"))
    rows = [row(g, i, float("nan") if (g, i) == (1, 0) else 0.5) for g in range(2) for i in range(2)]
    table = conform(_rows_to_table(rows), TRAJECTORY_SCHEMA, what="trajectory")  # past the writer's check
    append_idempotent(store, TRAJECTORIES, table, app_id="f/0", partition_by=PARTITION_BY)
    return store


def test_a_stored_reward_beyond_float32_is_scored_again(tmp_path):
    """A resume after a build that stored 1e308 (issue 40): the stored reward counts as unscored, as NaN does."""
    from sluiceway.storage.tables import append_idempotent, conform
    from sluiceway.storage.trajectories import PARTITION_BY, TRAJECTORIES, TRAJECTORY_SCHEMA, _rows_to_table
    from sluiceway.tasks.reward.score import has_reward, rescore_non_finite

    store = ObjectStore.from_uri(str(tmp_path / "tables"))
    rows = [row(g, i, 1e308 if (g, i) == (1, 0) else 0.5) for g in range(2) for i in range(2)]
    table = conform(_rows_to_table(rows), TRAJECTORY_SCHEMA, what="trajectory")  # past the writer's check
    append_idempotent(store, TRAJECTORIES, table, app_id="f/0", partition_by=PARTITION_BY)
    assert not has_reward(rows[2]) and has_reward(rows[0])
    table = rescore_non_finite(store=store, run_id="f", step=0, settings=RewardSettings(lambda *a: 0.25),
                               table=read_trajectories(store, "f", 0))  # fmt: skip
    assert table["reward"].to_pylist() == [0.5, 0.5, 0.25, 0.5]


@pytest.mark.parametrize("fixed", [True, False])
def test_a_stored_nan_reward_is_scored_again(tmp_path, fixed):
    """A NaN reward an older build stored counts as unscored: a fixed scorer gives the real reward; one still
    returning NaN makes it the sample's failure. Either way the step trains (no NaN, no all-failed stop)."""
    from sluiceway.tasks.reward.score import rescore_non_finite
    from sluiceway.tasks.train.batch import build_train_samples

    store = _with_stored_nan(tmp_path)
    scorer = lambda response, label, sample: 0.25 if fixed else float("nan")  # noqa: E731
    table = rescore_non_finite(
        store=store, run_id="f", step=0, settings=RewardSettings(scorer), table=read_trajectories(store, "f", 0)
    )
    assert table["reward"].to_pylist() == [0.5, 0.5, 0.25 if fixed else 0.0, 0.5]  # only (1, 0) scored again
    samples = build_train_samples(table, "grpo", True)
    assert all(s.advantage == s.advantage for s in samples)


def test_group_scorer_and_step_scoring_is_idempotent(batch):
    def rank_in_group(responses, labels, samples):
        return [float(i == 0) for i in range(len(responses))]

    # Clear the rewards of group 0 so the stage has something to score.
    from sluiceway.storage.trajectories import set_rewards

    set_rewards(batch, "f", 0, [(0, 0, None, None), (0, 1, None, None)])
    s = RewardSettings(rank_in_group, group_rm=True)
    first = score_step(store=batch, run_id="f", step=0, settings=s)
    second = score_step(store=batch, run_id="f", step=0, settings=s)
    assert (first.scored, second.scored) == (2, 0)
    got = {(r["group_id"], r["sample_index"]): r["reward"] for r in read_trajectories(batch, "f", 0).to_pylist()}
    assert (got[(0, 0)], got[(0, 1)]) == (1.0, 0.0)


def test_pass_at_k_is_the_unbiased_estimate():
    from sluiceway.tasks.evaluate.evaluate import pass_at_k

    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 1, 2) == 0.5  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 2, 3) == 1.0


def test_adaptive_source_levels_rise_persist_and_replay(tmp_path):
    from sluiceway.tasks.environments.adaptive_source import AdaptivePromptSource

    state = tmp_path / "curriculum.json"
    kw = dict(window=8, min_samples=8, raise_above=0.8, lower_below=0.2)
    src = AdaptivePromptSource("env:mix(arithmetic=1,reverse=1)", state, seed=5, **kw)
    step0 = src.records_for_step(0, 8)
    assert {r["metadata"]["level"] for r in step0} == {1}
    rows = [{"reward": 1.0, "status": "completed", "metadata": json.dumps(r["metadata"])} for r in step0 * 2]
    levels = src.observe_step(0, rows)
    assert levels == {"difficulty/arithmetic": 2.0, "difficulty/reverse": 2.0}
    assert src.observe_step(0, rows) == levels  # the same step observed twice counts once
    # A restarted run reloads the levels and generates the same prompts for the next step.
    again = AdaptivePromptSource("env:mix(arithmetic=1,reverse=1)", state, seed=5, **kw)
    assert again.records_for_step(1, 8) == src.records_for_step(1, 8)
    assert {r["metadata"]["level"] for r in again.records_for_step(1, 8)} == {2}


def test_async_scorers_per_sample_and_per_group():
    async def judge(response, label, sample):
        await asyncio.sleep(0)
        return float(response == label)

    async def judge_group(responses, labels, samples):
        return [float(r == lab) for r, lab in zip(responses, labels)]

    rows = [{"group_id": 0, "sample_index": i, "response_text": t, "label": "7"} for i, t in enumerate(["7", "8"])]
    assert [r for r, _ in score_rows(rows, RewardSettings(judge))] == [1.0, 0.0]
    assert [r for r, _ in score_rows(rows, RewardSettings(judge_group, group_rm=True))] == [1.0, 0.0]


def test_length_shaping_scales_rewards_by_response_tokens():
    rows = [
        {"group_id": 0, "sample_index": i, "response_text": "7", "label": "7", "response_token_ids": [5] * n}
        for i, n in enumerate([4, 10, 12, 40])
    ]
    out = score_rows(rows, RewardSettings(lambda r, lab, s: 1.0, length_budget=10, length_window=4))
    assert [reward for reward, _ in out] == [1.0, 1.0, 0.5, 0.0]  # penalty 0 up to 10 tokens, 1 at 14
    assert out[2][1] == {"length": 12, "length_penalty": 0.5, "unpenalized_reward": 1.0}
