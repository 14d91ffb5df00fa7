"""How a sample is scored: a built-in scorer, your function, or a remote reward model; length shaping."""

from __future__ import annotations

from pydantic import Field

from sluiceway.flows.config.group import Group


class RewardConfig(Group):
    rm_type: str = Field(
        "math",
        description="Built-in scorer: math, exact, regex, f1, choice, format, math+format, code (sandboxed "
        "execution against the label's tests), env (the verifier of the environment that made the prompt), remote.",
    )
    rm_url: str | None = Field(None, description="--rm-type remote: the reward-model server's URL.")
    rm_api_key_env: str | None = Field(
        None, description="--rm-type remote: name of the environment variable holding its API key (never logged)."
    )
    custom_rm_path: str | None = Field(
        None, description="'module.path:function' or 'file.py:function' scoring one sample (overrides rm_type)."
    )
    group_rm: bool = Field(
        False, description="custom_rm_path scores a whole group at once: fn(responses, labels, samples) -> rewards."
    )
    reward_key: str | None = Field(
        None, description="When a scorer returns a dict of values, the key that is the reward (the rest is kept)."
    )
    reward_timeout_s: float = Field(30.0, gt=0, description="A sample whose scorer takes longer gets reward 0.")
    length_penalty_budget: int | None = Field(
        None,
        ge=0,
        description="Length shaping: the reward is scaled down linearly for responses longer than "
        "this many tokens, reaching 0 at budget + length_penalty_window.",
    )
    length_penalty_window: int = Field(256, ge=1, description="Tokens over the budget at which the reward is 0.")

    def check(self, context: dict) -> None:
        if self.rm_type == "remote" and not self.rm_url:
            raise ValueError("rm_type remote needs rm_url (--rm-url http://host:port/score)")
