"""The reward stage's settings from the run config: which scorer, its deadline, group scoring, shaping."""

from __future__ import annotations

from sluiceway.flows.config import RunConfig
from sluiceway.infra.errors import UserError
from sluiceway.infra.proc import register_secret_env
from sluiceway.tasks.reward.score import RewardSettings
from sluiceway.tasks.reward.scorer_registry import get_scorer, remote_group_scorer


def build_reward_settings(cfg: RunConfig) -> RewardSettings:
    rw = cfg.reward
    if rw.group_rm and not rw.custom_rm_path:
        raise UserError("--group-rm needs --custom-rm-path (a function scoring a whole group)")
    if rw.rm_type == "remote" and not rw.custom_rm_path:
        if rw.rm_api_key_env:
            register_secret_env(rw.rm_api_key_env)  # never passed on to a child process
        scorer, group_rm = remote_group_scorer(rw.rm_url, rw.rm_api_key_env, rw.reward_timeout_s), True
    else:
        scorer, group_rm = get_scorer(rw.rm_type, rw.custom_rm_path), rw.group_rm
    # The remote model retries within its own deadline; the stage's limit covers a whole group's batch.
    timeout = rw.reward_timeout_s * 4 if rw.rm_type == "remote" else rw.reward_timeout_s
    return RewardSettings(scorer, timeout, group_rm, rw.reward_key, rw.length_penalty_budget, rw.length_penalty_window)
