"""Generation: batch sizes, sampling, the schedule (sync or async), filters, and the engines that serve it."""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from sluiceway.flows.config.group import Group
from sluiceway.infra.plugins import check_function


class RolloutConfig(Group):
    mode: Literal["sync", "one-step-off", "fully-async"] = Field(
        "sync",
        description="sync: generate, then train, each step. one-step-off: generate step k+1 while training step "
        "k (every sample one weight version behind). fully-async: keep generating up to max_staleness steps "
        "ahead (default 2) while the trainer consumes steps, pushing new weights to the engines as they come.",
    )
    rollout_batch_size: int = Field(8, ge=1, description="Prompts per rollout step.")
    n_samples_per_prompt: int = Field(8, ge=1, description="Samples per prompt (the GRPO group size).")
    num_rollout: int = Field(10, ge=1, description="Number of rollout steps in the run.")
    rollout_max_response_len: int = Field(32, ge=1, description="Maximum new tokens per response.")
    rollout_max_prompt_len: int = Field(256, ge=1, description="Prompts longer than this (in tokens) are an error.")
    rollout_temperature: float = Field(0.7, gt=0.0, description="Sampling temperature.")
    rollout_top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold.")
    rollout_max_concurrency: int = Field(64, ge=1, description="Generate requests in flight at once, over all engines.")
    rollout_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="A custom generate function's seconds for one sample. One that takes longer (a slime "
        "plugin, an agent, an environment's episode), raises or returns what no row can hold fails that sample "
        "alone, with the reason in its row.",
    )
    over_sampling_batch_size: int | None = Field(
        None,
        ge=1,
        description="Groups submitted per step (>= rollout_batch_size); the rest are aborted once "
        "rollout_batch_size groups have finished. Default: rollout_batch_size.",
    )
    partial_rollout: bool = Field(
        False, description="Continue aborted groups in the next step from their partial tokens (APRIL)."
    )
    mask_offpolicy_in_partial_rollout: bool = Field(
        False, description="Leave the tokens a partial rollout got from older weights out of the loss."
    )
    custom_generate_function_path: str | None = Field(
        None,
        description="'module:fn' or 'file.py:fn': an async function driving multi-turn generation "
        "(see tasks/rollout/multiturn.py).",
    )
    plugin_convention: Literal["auto", "slime", "sluiceway"] = Field(
        "auto",
        description="Functions' convention: slime's or sluiceway's. auto: told from each function's "
        "signature (--custom-generate-function-path, --custom-rm-path, --dynamic-sampling-filter-path: slime's "
        "(args, sample, ...) or sluiceway's, docs/slime.md); one the signature cannot tell (*args, unfamiliar names) "
        "is an error asking for this setting.",
    )
    plugin_process: bool = Field(
        True,
        description="A slime generate function in a process of its own. One that exits or blocks its event loop "
        "then costs its sample, not the run (tasks/rollout/slime_plugins/worker.py); --no-plugin-process runs it "
        "in the run's process (a debugger's breakpoints; no isolation).",
    )
    rollout_max_context_len: int | None = Field(
        None,
        ge=2,
        description="slime's context cap: prompt and response together. Custom generate functions in slime's style "
        "read it (args.rollout_max_context_len) to cap each turn; prompts must be shorter "
        "(rollout_max_prompt_len <= this - 1), and the embedded engines are sized to hold it.",
    )
    custom_config_path: str | None = Field(
        None,
        description="slime's: a YAML whose keys become attributes of slime-style functions' `args`. Set or "
        "overridden, values as YAML gives them, as slime does.",
    )
    # slime's per-step rollout hooks (tasks/rollout/slime_plugins/hooks.py), in slime's convention only. Listed by
    # `run --help-slime` and docs/slime.md rather than `run --help` (json_schema_extra slime_hook).
    rollout_sample_filter_path: str | None = Field(
        None,
        description="slime's fn(args, data): data the step's trained groups as Samples; a Sample it marks "
        "remove_sample is stored with the flag and a zero loss mask.",
        json_schema_extra={"slime_hook": True},
    )
    rollout_all_samples_process_path: str | None = Field(
        None,
        description="slime's fn(args, all_samples, data_source): every finished group of the step, filtered ones "
        "too; data_source's get_samples/add_samples raise (not supported here).",
        json_schema_extra={"slime_hook": True},
    )
    custom_rollout_log_function_path: str | None = Field(
        None,
        description="slime's fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time), once per step; "
        "its return value is ignored: the metrics table is always written.",
        json_schema_extra={"slime_hook": True},
    )
    custom_reward_post_process_path: str | None = Field(
        None,
        description="slime's fn(args, samples) -> (raw_rewards, rewards), samples the step's trained Samples: "
        "`rewards` replace the advantage estimator's group baselines (docs/slime.md).",
        json_schema_extra={"slime_hook": True},
    )
    agent_function_path: str | None = Field(
        None,
        description="'module:fn' or 'file.py:fn': your agent, fn(base_url, api_key, prompt) (sync or async), run "
        "once per sample against the run's OpenAI-compatible, token-recording endpoint instead of the default "
        "generate; it returns a reward or None (see docs/agents.md). Imported when the config is read.",
    )

    @field_validator("agent_function_path")
    @classmethod
    def _load_agent_function(cls, path: str | None) -> str | None:
        """An agent that does not import is one line when the config is read, not a failure mid-rollout."""
        if path is not None:
            check_function(path, "--agent-function-path", ("base_url", "api_key", "prompt"))
        return path

    dynamic_sampling_filter_path: str | None = Field(
        None,
        description="Drop groups at rollout time and over-sample until enough pass: 'zero_std' (DAPO), "
        "'truncated', or 'module:fn' returning keep (True) or a drop reason.",
    )
    max_staleness: int | None = Field(
        None, ge=0, description="Drop groups with tokens from weights more than N versions behind the trainer."
    )
    filter_truncated: bool = Field(False, description="Drop groups with a response that hit the length limit.")
    filter_overlong_len: int | None = Field(
        None, ge=1, description="Drop groups with a response longer than this many tokens."
    )
    rollout_engine: Literal["embedded", "sglang"] = Field(
        "embedded", description="What serves generation: sluiceway's embedded CPU engine, or SGLang servers (GPU)."
    )
    rollout_num_gpus_per_engine: int = Field(1, ge=1, description="SGLang: GPUs (tensor parallel size) per engine.")
    rollout_num_gpus: int | None = Field(
        None,
        ge=1,
        description="SGLang on a Ray cluster (--ray-address): GPUs for the engines in all, placed as "
        "rollout_num_gpus / rollout_num_gpus_per_engine engine actors (default: rollout_num_engines engines).",
    )
    sglang_server_args: list[str] | None = Field(
        None, description="Extra SGLang server flags; on the command line write --sglang-X VALUE for --X VALUE."
    )
    rollout_num_engines: int = Field(1, ge=0, description="Embedded engines to start behind the router.")
    rollout_external_engine_addrs: list[str] | None = Field(
        None, description="URLs of engines someone else runs (SGLang servers or `sluiceway engine`) to attach."
    )
    engine_max_running_requests: int = Field(64, ge=1, description="Sequences each embedded engine decodes at once.")
    engine_num_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads of each embedded engine. Default: the CPU's cores (resources.num_threads if "
        "set) shared out evenly over rollout_num_engines, at least 1 each. Several engines of few threads overlap "
        "each other's single-threaded work (SmolLM2, 32 requests on 2 cores: two 1-thread engines 1.9 s, one "
        "2-thread engine 3.6 s in bf16; fp32 3.0 vs 3.7 s), but each holds its own weights and reloads them.",
    )
    rollout_pools: list[str] | None = Field(
        None,
        description="Remote pools that take groups beside the run's own engines: NAME=ROUTER_URL for a fixed pool, "
        "or `auto` for every pool registered beside the run's weight store. A fixed pool is e.g. "
        "east=http://10.0.0.5:30000; `auto` takes pools that join and leave during the run (a registry URI, "
        "s3://bucket/prefix or a path, reads another store's registry). Their agents pull each weight version "
        "from the weight store and report there what they serve (needs update_weight_mode delta); a pool gets "
        "groups only while its version is fresh enough "
        "for the step (docs/weight_sync.md). A fixed pool takes up to rollout_max_concurrency requests, a "
        "registered one its own capacity.",
    )

    def check(self, context: dict) -> None:
        if self.over_sampling_batch_size is not None and self.over_sampling_batch_size < self.rollout_batch_size:
            raise ValueError(
                f"over_sampling_batch_size ({self.over_sampling_batch_size}) must be >= rollout_batch_size"
                f" ({self.rollout_batch_size})"
            )
        if self.partial_rollout and self.custom_generate_function_path:
            raise ValueError("partial_rollout cannot continue custom (multi-turn) generations: use one or the other")
        if self.agent_function_path and self.custom_generate_function_path:
            raise ValueError("agent_function_path and custom_generate_function_path both replace the generate")
        if self.partial_rollout and self.agent_function_path:
            raise ValueError("partial_rollout cannot continue agent sessions: use one or the other")
        context = self.rollout_max_context_len
        if context is not None and self.rollout_max_prompt_len > context - 1:
            raise ValueError(f"rollout_max_prompt_len ({self.rollout_max_prompt_len}) must be <= "
                             f"rollout_max_context_len - 1 ({context - 1}), as in slime")  # fmt: skip
        self.remote_pools  # noqa: B018 - parses and checks each NAME=URL, auto or registry URI
        if self.rollout_num_gpus is not None and self.rollout_num_gpus % self.rollout_num_gpus_per_engine:
            raise ValueError(f"rollout_num_gpus ({self.rollout_num_gpus}) must be a multiple of "
                             f"rollout_num_gpus_per_engine ({self.rollout_num_gpus_per_engine})")  # fmt: skip

    @property
    def remote_pools(self) -> list[tuple[str, str]]:
        """rollout_pools as (name, router URL) pairs."""
        out: list[tuple[str, str]] = []
        for spec in self.rollout_pools or []:
            name, sep, url = spec.partition("=")
            if not sep and _is_registry(spec):
                continue
            if not sep:
                raise ValueError(f"rollout_pools: {spec!r} is not NAME=http://HOST:PORT, auto, or a pool registry "
                                 "(the weight store URI pools register in: s3://bucket/prefix or a path)")  # fmt: skip
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or not re.match(r"https?://[^/\s]+", url) or _no_url(url):
                raise ValueError(f"rollout_pools: {spec!r} is not NAME=http://HOST:PORT")
            if name == "local" or name in dict(out):
                raise ValueError(f"rollout_pools: pool name {name!r} is taken (each pool needs its own; 'local' "
                                 "is the run's own engines)")  # fmt: skip
            out.append((name, url.rstrip("/")))
        return out

    @property
    def steps_ahead(self) -> int:
        """How many steps generation may run ahead of training: 0 (sync), 1 (one-step-off), or max_staleness
        (fully-async; 2 when unset). The staleness filter reads max_staleness itself: unset, it drops nothing."""
        if self.mode == "fully-async":
            return 2 if self.max_staleness is None else self.max_staleness
        return {"sync": 0, "one-step-off": 1}[self.mode]

    @property
    def pool_registries(self) -> list[str]:
        """rollout_pools' registries: `auto` (the run's weight store) or weight store URIs, as written."""
        return [spec for spec in self.rollout_pools or [] if "=" not in spec and _is_registry(spec)]


def _no_url(url: str) -> bool:
    """Whether ``url`` does not parse with a host and a port httpx can reach ('http://[::1' passed the pattern and
    failed at the first request; storage/weights/pool_registry.py url_problem checks registered pools' the same)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0-65535
    except ValueError:
        return True
    return not parts.hostname or any(c.isspace() or not c.isprintable() for c in url)


def _is_registry(spec: str) -> bool:
    """`auto`, or a weight store URI: s3://, file:// or a path (an http:// URL is a pool, not a registry)."""
    return spec == "auto" or (not spec.startswith(("http://", "https://")) and ("://" in spec or "/" in spec))
