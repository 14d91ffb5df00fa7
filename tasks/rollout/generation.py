"""What one generation returns, whoever made it: the shape `Rollout` turns into a trajectory row.

Three classes are one: an engine's answer (`GenerateResult`, tasks/rollout/client.py), a multi-turn buffer
(`TokenBuffer`, tasks/rollout/multiturn.py; an agent session's result is one too) and a sample the rollout never
sent (`_Aborted`, tasks/rollout/rollout.py). The optional attributes are None where a class has nothing to say;
`GenerationDefaults` gives them that value.
"""

from __future__ import annotations

from typing import Protocol


class Generation(Protocol):
    """One sample's new tokens and what the row needs to know about them."""

    token_ids: list[int]  # the response tokens this generation added
    logprobs: list[float]  # one per token, or empty
    finish_reason: str  # "stop" | "length" | "abort" (anything else: the sample failed)
    latency_s: float

    @property
    def weight_version(self) -> int:
        """The version that made the last token."""
        ...

    # Optional (None or empty: the row's default in brackets).
    @property
    def loss_mask(self) -> list[int] | None:
        """Per token, 1 trained on, 0 an environment token [every token trained on]."""
        ...

    @property
    def weight_versions(self) -> list[int] | None:
        """Every version the tokens came from [`weight_version`, when there are tokens]."""
        ...

    @property
    def prompt_ids(self) -> list[int] | None:
        """The prompt the tokens follow [the planned prompt's tokens]."""
        ...

    @property
    def prompt_text(self) -> str | None:
        """The rendered prompt [the planned prompt's text]."""
        ...

    @property
    def reward(self) -> float | None:
        """A reward the generator already knows (an agent's) [scored by the reward stage]."""
        ...

    @property
    def abort_reason(self) -> str | None:
        """Why the sample was cut short, kept in the row's metadata [none]."""
        ...

    @property
    def reward_details(self) -> dict | None:
        """What the row's reward_details hold beside a `reward` the generator set [{"source": "agent"}]."""
        ...

    @property
    def row_metadata(self) -> dict | None:
        """More of the row's metadata, merged over the prompt's (a slime Sample's fields) [none]."""
        ...

    @property
    def teacher_logprobs(self) -> list[float] | None:
        """A teacher's log-prob per response token, if the generator has them [left to distillation's stage]."""
        ...

    @property
    def siblings(self) -> list[Generation] | None:
        """More samples this one fanned out into, each another row of the group (a slime generate function's
        returned list; `Rollout.group` numbers them after the planned samples) [none]."""
        ...


class GenerationDefaults:
    """The optional `Generation` attributes as None, for a class that brings none or only some of them."""

    loss_mask: list[int] | None = None
    weight_versions: list[int] | None = None
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None
    reward: float | None = None
    abort_reason: str | None = None
    reward_details: dict | None = None
    row_metadata: dict | None = None
    teacher_logprobs: list[float] | None = None
    siblings: list | None = None
