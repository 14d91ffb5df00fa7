"""slime's per-step rollout hooks (tasks/rollout/slime_plugins/hooks.py) on a stored step: the sample filter's
remove_sample marks stored and masked, the all-samples process seeing filtered groups and a data source that says
what it cannot do, the log function's arguments; and the three flags are fields, no longer refused."""

from __future__ import annotations

import json
from argparse import Namespace
from datetime import UTC, datetime, timedelta

import pytest

from sluiceway.flows.config import RunConfig, field_flags
from sluiceway.flows.slime.flag_table import SLIME_FLAGS
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import append_trajectories, read_trajectories
from sluiceway.tasks.rollout.slime_plugins.hooks import NoDataSource, rollout_time, run_step_hooks

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def row(group: int, sample: int, reward: float, reason: str | None = None, mask=(1, 0, 1)) -> dict:
    n = len(mask)
    meta = {"slime_sample": {"index": group * 10 + sample, "group_index": group, "prompt": "q", "status": "completed",
                             "response_length": n, "rollout_id": group}}  # fmt: skip
    return {"run_id": "r", "step": 0, "group_id": group, "sample_index": sample, "prompt_id": f"p{group}",
            "prompt": "q", "label": "1", "prompt_token_ids": [1, 2], "response_token_ids": list(range(n)),
            "response_text": "x", "rollout_logprobs": [-1.0] * n, "loss_mask": list(mask), "reward": reward,
            "status": "completed", "finish_reason": "stop", "weight_version": 0, "weight_versions": [0],
            "engine": "e", "pool": "local", "gen_time_s": 2.0, "created_at": T0 + timedelta(seconds=group),
            "filter_reason": reason, "metadata": json.dumps(meta)}  # fmt: skip


SEEN: dict = {}


def sample_filter(args, data):
    SEEN["filter"] = [[(s.group_index, s.index) for s in group] for group in data]
    data[1][0].remove_sample = True


def process_all(args, all_samples, data_source):
    SEEN["all"] = [[s.remove_sample for s in group] for group in all_samples]
    for call in (lambda: data_source.get_samples(4), lambda: data_source.add_samples([]), lambda: data_source(2)):
        with pytest.raises(NotImplementedError, match="not supported in sluiceway"):
            call()


async def log_rollout(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    SEEN["log"] = (rollout_id, args.tag, len(samples), rollout_extra_metrics, rollout_time)
    return True


def test_hooks_on_a_stored_step(tmp_path):
    store = ObjectStore.from_uri(str(tmp_path / "tables"))
    rows = [row(0, 0, 1.0), row(0, 1, 0.0), row(1, 0, 1.0), row(1, 1, 0.5), row(1, 2, 0.2), row(2, 0, 1.0, "zero_std")]
    append_trajectories(store, rows, app_id="r/0")
    mod = __name__
    cfg = RunConfig(data={"prompt_data": "env:arithmetic"},
                    rollout={"rollout_sample_filter_path": f"{mod}.sample_filter",
                             "rollout_all_samples_process_path": f"{mod}.process_all",
                             "custom_rollout_log_function_path": f"{mod}.log_rollout"})  # fmt: skip
    SEEN.clear()
    out = run_step_hooks(cfg.rollout, Namespace(tag="args"), store, "r", 0, {"filter/groups_kept": 2.0})
    assert out == {"rollout/sample_filter/removed": 1.0}
    assert SEEN["filter"] == [[(0, 0), (0, 1)], [(1, 10), (1, 11), (1, 12)]]  # trained groups only, fan-out too
    assert SEEN["all"] == [[False, False], [True, False, False], [False]]  # the filtered group too, after the marks
    assert SEEN["log"] == (0, "args", 5, {"filter/groups_kept": 2.0}, 4.0)
    stored = {(r["group_id"], r["sample_index"]): r for r in read_trajectories(store, "r", 0).to_pylist()}
    removed = stored[(1, 0)]
    record = json.loads(removed["metadata"])["slime_sample"]
    assert removed["loss_mask"] == [0, 0, 0] and record["remove_sample"] and record["loss_mask"] == [1, 0, 1]
    assert removed["reward"] == 1.0 and stored[(1, 1)]["loss_mask"] == [1, 0, 1]
    from sluiceway.tasks.rollout.slime_plugins.reward import sample_of_row

    back = sample_of_row(removed)  # the Sample again: flagged, with the mask it had
    assert back.remove_sample and back.loss_mask == [1, 0, 1]


def scale_rewards(args, samples):
    """slime's shape: (raw_rewards, rewards), here rewards centred over the whole step and scaled by args."""
    SEEN["post"] = [(s.group_index, s.index, s.remove_sample) for s in samples]
    raw = [s.get_reward_value(args) for s in samples]
    mean = sum(raw) / len(raw)
    return raw, [args.scale * (r - mean) for r in raw]


def test_reward_post_process_gives_the_advantages(tmp_path):
    from sluiceway.tasks.train.batch import build_train_samples

    store = ObjectStore.from_uri(str(tmp_path / "tables"))
    rows = [row(0, 0, 1.0), row(0, 1, 0.0), row(1, 0, 1.0), row(1, 1, 0.5), row(2, 0, 1.0, "zero_std")]
    append_trajectories(store, rows, app_id="r/0")
    mod = __name__
    cfg = RunConfig(data={"prompt_data": "env:arithmetic"},
                    rollout={"rollout_sample_filter_path": f"{mod}.sample_filter",
                             "custom_reward_post_process_path": f"{mod}.scale_rewards"})  # fmt: skip
    SEEN.clear()
    out = run_step_hooks(cfg.rollout, Namespace(scale=2.0, reward_key=None), store, "r", 0, {})
    # The trained samples, the one the sample filter removed included (as slime passes them), not the dropped group.
    assert SEEN["post"] == [(0, 0, False), (0, 1, False), (1, 10, True), (1, 11, False)]
    assert out == {"rollout/sample_filter/removed": 1.0, "rollout/reward_post_process/mean": 0.0}
    table = read_trajectories(store, "r", 0)
    stored = {(r["group_id"], r["sample_index"]): r for r in table.to_pylist()}
    assert json.loads(stored[(0, 0)]["metadata"])["reward_post_process"] == {"raw": 1.0, "reward": 0.75}
    assert json.loads(stored[(1, 0)]["metadata"])["slime_sample"]["remove_sample"]  # both hooks' marks kept
    assert stored[(1, 0)]["loss_mask"] == [0, 0, 0] and stored[(0, 0)]["reward"] == 1.0  # reward column unchanged
    # mean of (1, 0, 1, 0.5) is 0.625: the processed rewards are the advantages as given, not group-normalised again.
    for estimator in ("grpo", "gspo", "rloo"):
        samples = build_train_samples(table, estimator, True)
        assert [s.advantage for s in samples] == pytest.approx([0.75, -1.25, 0.75, -0.25])
        assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.5]
    ppo = build_train_samples(table, "ppo", True)  # a per-token estimator starts from the processed reward
    assert [s.reward for s in ppo] == pytest.approx([0.75, -1.25, 0.75, -0.25])
    rpp = build_train_samples(table, "reinforce_plus_plus_baseline", True)
    assert sum(s.advantage * sum(s.loss_mask) for s in rpp) == pytest.approx(0.0, abs=1e-6)  # whitened over tokens


def bad_post_process(args, samples):
    return [1.0] * len(samples), [float("nan")] + [0.0] * (len(samples) - 1)


def short_post_process(args, samples):
    return [1.0], [1.0]


@pytest.mark.parametrize(("fn", "message"), [("bad_post_process", r"rewards\[0\] is nan; expected a finite number"),
                                             ("short_post_process", r"raw_rewards has 1 values; expected one per "
                                                                    r"sample given \(2\)")])  # fmt: skip
def test_reward_post_process_output_is_checked(tmp_path, fn, message):
    from sluiceway.infra.errors import UserError

    store = ObjectStore.from_uri(str(tmp_path / "tables"))
    append_trajectories(store, [row(0, 0, 1.0), row(0, 1, 0.0)], app_id="r/0")
    cfg = RunConfig(data={"prompt_data": "env:arithmetic"},
                    rollout={"custom_reward_post_process_path": f"{__name__}.{fn}"})  # fmt: skip
    with pytest.raises(UserError, match=f"--custom-reward-post-process-path {__name__}.{fn}: {message}"):
        run_step_hooks(cfg.rollout, Namespace(), store, "r", 0, {})
    assert all("reward_post_process" not in r["metadata"] for r in read_trajectories(store, "r", 0).to_pylist())


def test_no_hooks_reads_nothing(tmp_path):
    cfg = RunConfig(data={"prompt_data": "env:arithmetic"})
    assert run_step_hooks(cfg.rollout, Namespace(), None, "r", 0, {}) == {}


def test_rollout_time_spans_the_step():
    assert rollout_time([]) == 0.0
    assert rollout_time([row(0, 0, 1.0), row(3, 0, 1.0)]) == 5.0  # first request at -2 s, last row at +3 s
    assert isinstance(NoDataSource(), NoDataSource)


def test_hook_flags_are_fields_not_refused():
    for flag in ("--rollout-sample-filter-path", "--rollout-all-samples-process-path",
                 "--custom-rollout-log-function-path", "--custom-reward-post-process-path"):  # fmt: skip
        assert flag in field_flags() and flag not in SLIME_FLAGS


def test_rollout_filter_keeps_a_generators_reward():
    """A reward the generate set (a fan-out's) stands at rollout-time scoring, as slime's generate_and_rm skips the
    rm for it; only the rows without one are scored."""
    from sluiceway.tasks.filter.filters import scoring_filter
    from sluiceway.tasks.reward.score import RewardSettings

    calls = []

    def scorer(response, label, row):
        calls.append(row["sample_index"])
        return 0.5

    rows = [row(0, 0, 1.0), row(0, 1, None)]
    assert scoring_filter(RewardSettings(scorer), [lambda rows: None])(rows) is None
    assert calls == [1] and [r["reward"] for r in rows] == [1.0, 0.5]


def test_dict_label_kept_as_json_and_given_back_as_dict():
    from sluiceway.storage.datasets import _label
    from sluiceway.tasks.rollout.slime_plugins.generate import slime_label

    text = _label({"ground_truth": {"target": 4}, "style": "rule"}, "prompts.jsonl:1", "reward_model")
    assert slime_label(text) == {"ground_truth": {"target": 4}, "style": "rule"}
    assert slime_label("4") == "4" and slime_label("{not json") == "{not json" and slime_label(None) is None
