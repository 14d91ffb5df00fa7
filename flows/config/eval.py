"""Evaluation: the named evaluation sets, how often, and how they are sampled."""

from __future__ import annotations

from pydantic import Field

from sluiceway.flows.config.group import Group


class EvalConfig(Group):
    eval_interval: int | None = Field(None, ge=1, description="Evaluate every N rollout steps.")
    eval_prompt_data: list[str] | None = Field(
        None,
        description="Evaluation sets as NAME SOURCE pairs (repeatable: --eval-prompt-data gsm data/gsm.jsonl "
        "arith env:arithmetic:3); a lone SOURCE is named 'eval'. SOURCE is a prompt file or env:NAME.",
    )
    n_samples_per_eval_prompt: int = Field(
        1, ge=1, description="Samples per evaluation prompt; pass@k is reported for k = 1, 2, 4, ... up to it."
    )
    eval_size: int = Field(32, ge=1, description="Prompts evaluated (taken from the head of the eval data).")
    eval_temperature: float | None = Field(
        None, ge=0.0, description="Sampling temperature of evaluation; 0 is greedy (default: rollout_temperature)."
    )
    eval_top_p: float | None = Field(
        None, gt=0.0, le=1.0, description="Nucleus sampling threshold of evaluation (default: rollout_top_p)."
    )
    eval_max_response_len: int | None = Field(
        None, ge=1, description="Maximum new tokens per evaluation response (default: rollout_max_response_len)."
    )

    def check(self, context: dict) -> None:
        ev = self.eval_prompt_data or []
        if len(ev) > 1 and len(ev) % 2:
            raise ValueError("eval_prompt_data takes NAME SOURCE pairs (or one SOURCE)")
        if len(ev) > 1 and len({n for n, _ in self.sets}) != len(self.sets):
            raise ValueError("eval_prompt_data: each evaluation set needs its own NAME")
        if self.eval_interval and not self.eval_prompt_data:
            raise ValueError("eval_interval is set but eval_prompt_data is not (--eval-prompt-data FILE or env:NAME)")

    @property
    def sets(self) -> list[tuple[str, str]]:
        """(name, source) pairs of eval_prompt_data."""
        items = self.eval_prompt_data or []
        if len(items) == 1:
            return [("eval", items[0])]
        return list(zip(items[0::2], items[1::2]))
