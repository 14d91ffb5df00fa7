"""What a run trains on: the prompt source, its fields, the chat template, SFT's samples, adaptive difficulty."""

from __future__ import annotations

import json

from pydantic import Field, field_validator

from sluiceway.flows.config.group import Group
from sluiceway.infra.prompt_sources import ENV, VERIFIERS, source_kind


class DataConfig(Group):
    prompt_data: str | None = Field(
        None,
        description="JSONL or Parquet prompts (slime format), or an environment: env:NAME, verifiers:NAME, "
        "openenv:URL, openenv:MODULE:Class (docs/environments.md).",
    )
    input_key: str = Field("input", description="Field holding the prompt: text or chat messages.")
    label_key: str | None = Field("label", description="Field holding the reference answer.")
    metadata_key: str = Field("metadata", description="Optional field holding per-sample metadata (a dict).")
    response_key: str | None = Field(
        None,
        description="SFT: field holding the response to the prompt under input_key. Unset: input_key holds "
        "whole conversations (lists of messages) whose assistant turns are trained.",
    )
    sft_max_len: int = Field(2048, ge=2, description="SFT: most tokens per sample; longer ones are an error.")
    sft_truncate: bool = Field(False, description="SFT: cut samples longer than sft_max_len instead of stopping.")
    apply_chat_template: bool = Field(False, description="Wrap prompts with the tokenizer's chat template.")
    system_prompt: str | None = Field(None, description="System message prepended when applying the chat template.")
    env_size: int = Field(512, ge=1, description="Number of prompts generated for an 'env:NAME' dataset.")
    adaptive_difficulty: bool = Field(
        False,
        description="With an env: prompt source, generate each step's prompts at levels that rise when "
        "recent accuracy passes difficulty_raise_above and fall below difficulty_lower_below.",
    )
    difficulty_raise_above: float = Field(0.8, gt=0.0, le=1.0, description="Accuracy that raises a level.")
    difficulty_lower_below: float = Field(0.2, ge=0.0, lt=1.0, description="Accuracy that lowers a level.")
    difficulty_window: int = Field(64, ge=1, description="Recent samples per environment that accuracy covers.")
    difficulty_min_samples: int = Field(32, ge=1, description="Samples at a level before it may change.")
    openenv_action_parser: str | None = Field(
        None,
        description="With an openenv: prompt source, 'module:fn' or 'file.py:fn' turning the model's text into an "
        "action (a dict of its fields; None ends the episode); unset: the action is offered as a tool.",
        json_schema_extra={"source_option": True},
    )
    openenv_observation_text: str | None = Field(
        None,
        description="With an openenv: prompt source, 'module:fn' turning an observation's fields (a dict) into the "
        "text the model reads; unset: its one text field, or its fields as JSON.",
        json_schema_extra={"source_option": True},
    )
    openenv_max_turns: int = Field(
        16,
        ge=1,
        description="With an openenv: prompt source, most model turns an episode.",
        json_schema_extra={"source_option": True},
    )
    openenv_turn_tokens: int | None = Field(
        None,
        ge=1,
        description="With an openenv: prompt source, most tokens a model turn (max_tokens); unset: what "
        "is left of rollout_max_response_len.",
        json_schema_extra={"source_option": True},
    )
    openenv_timeout_s: float = Field(
        60.0,
        gt=0,
        description="With an openenv: prompt source, seconds an environment's answer may take before its sample fails.",
        json_schema_extra={"source_option": True},
    )
    verifiers_env: dict = Field(
        default_factory=dict,
        description="With a verifiers:NAME prompt source, verifiers' own [env] block as a mapping (a JSON object on "
        "the command line): the taskset's arguments under 'taskset', the agent's harness under 'agent.harness', "
        "'timeout', ...; taskset.id is NAME, agents run on the local subprocess runtime unless another local one "
        "is named.",
        json_schema_extra={"source_option": True},
    )

    @field_validator("verifiers_env", mode="before")
    @classmethod
    def _verifiers_env_json(cls, v):
        if isinstance(v, str):  # the flag's value
            try:
                return json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"verifiers_env: not a JSON object: {e}") from None
        return v

    def check(self, context: dict) -> None:
        if self.verifiers_env and source_kind(self.prompt_data) != VERIFIERS:
            raise ValueError("verifiers_env is set but prompt_data is not a verifiers:NAME source")
        if self.adaptive_difficulty and source_kind(self.prompt_data) != ENV:
            raise ValueError("adaptive_difficulty needs an environment as prompt_data (env:NAME or env:mix(...))")
