"""The reward stage's settings from the run config: which scorer, its deadline, group scoring, shaping."""

from __future__ import annotations

from sluiceway.flows.config import RunConfig
from sluiceway.infra.errors import UserError
from sluiceway.infra.proc import register_secret_env
from sluiceway.tasks.reward.score import RewardSettings
from sluiceway.tasks.reward.scorer_registry import get_scorer, remote_group_scorer


def build_reward_settings(cfg: RunConfig, slime_args=None) -> RewardSettings:
    """`slime_args`: the run's slime `args` for a scorer in slime's convention (a new one when none is given)."""
    rw = cfg.reward
    if rw.group_rm and not rw.custom_rm_path:
        raise UserError("--group-rm needs --custom-rm-path (a function scoring a whole group)")
    if rw.rm_type == "remote" and not rw.custom_rm_path:
        if rw.rm_api_key_env:
            register_secret_env(rw.rm_api_key_env)  # never passed on to a child process
        scorer, group_rm = remote_group_scorer(rw.rm_url, rw.rm_api_key_env, rw.reward_timeout_s), True
    else:
        scorer, group_rm = slime_reward(cfg, slime_args) or get_scorer(rw.rm_type, rw.custom_rm_path), rw.group_rm
    # The remote model retries within its own deadline; the stage's limit covers a whole group's batch.
    timeout = rw.reward_timeout_s * 4 if rw.rm_type == "remote" else rw.reward_timeout_s
    return RewardSettings(scorer, timeout, group_rm, rw.reward_key, rw.length_penalty_budget, rw.length_penalty_window)


def slime_reward(cfg: RunConfig, args=None):
    """A scorer in slime's convention, or None: --custom-rm-path speaking slime's (args, sample) / (args, samples),
    or an --rm-type only slime's rm_hub knows (boxed_*, remote_rm, random) (tasks/rollout/slime_plugins/reward.py)."""
    from sluiceway.tasks.reward.scorer_registry import RM_TYPES
    from sluiceway.tasks.rollout.slime_plugins import reward as slime

    rw = cfg.reward
    if rw.custom_rm_path:
        from sluiceway.tasks.rollout.slime_plugins.convention import GROUP_RM, RM, SLIME, convention_of, load_plugin

        fn = load_plugin(rw.custom_rm_path, "--custom-rm-path")
        hook = GROUP_RM if rw.group_rm else RM
        if convention_of(fn, hook, cfg.rollout.plugin_convention, rw.custom_rm_path) != SLIME:
            return None
        return slime.slime_scorer(fn, args or _args(cfg), rw.group_rm)
    if rw.rm_type in RM_TYPES or not is_rm_hub_type(rw.rm_type):
        return None
    return slime.rm_hub_scorer(args or _args(cfg))


def is_rm_hub_type(rm_type: str) -> bool:
    """A name slime's rm_hub dispatches that sluiceway's registry lacks."""
    name = rm_type.removeprefix("boxed_")
    return rm_type.startswith("boxed_") and name in ("math", "deepscaler", "f1") or name in ("remote_rm", "random")


def _args(cfg: RunConfig):
    from sluiceway.models.zoo import resolve_checkpoint
    from sluiceway.tasks.rollout.slime_plugins.args import slime_args

    return slime_args(cfg, resolve_checkpoint(cfg.training.hf_checkpoint))
