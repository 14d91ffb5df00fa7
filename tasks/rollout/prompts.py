"""The rollout stage's input: dataset tables from a file or an environment, rendered and tokenized prompts, and
the sampling settings (training and evaluation) the engines get.

Plain functions of the run config: the RL flow's preflight (flows/runtime.py `prepare`), the eval flow and
the SFT flow's table naming call them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from sluiceway.flows.config import RunConfig
from sluiceway.infra.errors import UserError
from sluiceway.infra.prompt_sources import ENV, OPENENV, VERIFIERS, source_body, source_kind
from sluiceway.models.chat import encode_prompt, render_prompt
from sluiceway.storage.datasets import import_prompts, import_records, load_prompts
from sluiceway.storage.object_store import ObjectStore
from sluiceway.tasks.environments import generate_env, verifiers_env
from sluiceway.tasks.environments.adaptive_source import AdaptivePromptSource
from sluiceway.tasks.environments.openenv_episode import openenv_records
from sluiceway.tasks.environments.openenv_servers import openenv_generate
from sluiceway.tasks.rollout.agent.proxy import AgentGenerate, load_agent_function
from sluiceway.tasks.rollout.agent.verifiers import VerifiersGenerate
from sluiceway.tasks.rollout.rollout import PromptItem, RolloutSettings
from sluiceway.tasks.rollout.slime_plugins.generate import load_generate


def dataset_table_name(prompt_data: str, env_size: int, seed: int, args: dict | None = None) -> str:
    """One table per distinct source: a file's name plus a hash of its bytes, or the environment spec (`args`: a
    verifiers source's data.verifiers_env)."""
    kind = source_kind(prompt_data)
    if kind == ENV:
        return "datasets/" + source_body(prompt_data).replace(":", "-") + f"-n{env_size}-s{seed}"
    if kind == VERIFIERS:  # the taskset's tasks (tasks/environments/verifiers_env.py)
        return verifiers_env.table_name(prompt_data, args, env_size)
    if kind == OPENENV:  # episodes' reset seeds (tasks/environments/openenv_episode.py)
        digest = hashlib.sha256(prompt_data.encode()).hexdigest()[:12]
        return f"datasets/openenv-{digest}-n{env_size}-s{seed}"
    p = Path(prompt_data)
    if not p.is_file():
        raise UserError(f"--prompt-data {prompt_data}: file not found")
    digest = hashlib.sha256(p.read_bytes()).hexdigest()[:12]
    return f"datasets/{p.stem}-{digest}"


def load_dataset(cfg: RunConfig, store: ObjectStore, prompt_data: str, size: int, seed: int) -> list[dict]:
    d = cfg.data
    name = dataset_table_name(prompt_data, size, seed, d.verifiers_env)
    kind = source_kind(prompt_data)
    if kind == VERIFIERS:
        import_records(verifiers_env.records(prompt_data, d.verifiers_env, size), store, name, source=prompt_data,
                       input_key="input", label_key="label", metadata_key="metadata")  # fmt: skip
    elif kind in (ENV, OPENENV):
        records = generate_env(prompt_data, size, seed) if kind == ENV else openenv_records(prompt_data, size, seed)
        import_records(
            records, store, name, source=prompt_data, input_key="input", label_key="label", metadata_key="metadata"
        )
    else:
        import_prompts(
            prompt_data, store, name, input_key=d.input_key, label_key=d.label_key, metadata_key=d.metadata_key
        )
    return load_prompts(store, name)


def adaptive_step_prompts(
    cfg: RunConfig, adaptive: AdaptivePromptSource, store: ObjectStore, tokenizer, step: int, n: int
) -> list[PromptItem]:
    """This step's prompts at the curriculum's levels, stored as a dataset table like any other data."""
    records = adaptive.records_for_step(step, n)
    name = f"datasets/adaptive-{cfg.run_id}"
    import_records(
        records, store, name, source=f"step{step}", input_key="input", label_key="label", metadata_key="metadata"
    )
    # Only this step's rows: the table grows by a batch every step.
    return render_items(cfg, tokenizer, load_prompts(store, name, source=f"step{step}"))


def render_items(cfg: RunConfig, tokenizer, rows: list[dict]) -> list[PromptItem]:
    items = []
    for row in rows:
        prompt = row["messages"] if row.get("messages") else row["prompt"]
        text = render_prompt(tokenizer, prompt, cfg.data.apply_chat_template, cfg.data.system_prompt)
        ids = encode_prompt(tokenizer, text)
        if len(ids) > cfg.rollout.rollout_max_prompt_len:
            raise UserError(
                f"prompt {row['prompt_id']}: {len(ids)} tokens exceeds --rollout-max-prompt-len "
                f"{cfg.rollout.rollout_max_prompt_len}"
            )
        items.append(PromptItem(row["prompt_id"], text, ids, row.get("label"), row.get("metadata") or {}, prompt))
    return items


def stop_token_ids(tokenizer, hf_dir: Path) -> list[int]:
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        eos = GenerationConfig.from_pretrained(hf_dir, local_files_only=True).eos_token_id
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    return sorted(ids)


def build_rollout_settings(cfg: RunConfig, tokenizer, hf_dir: Path, slime_args=None) -> RolloutSettings:
    """`slime_args`: the run's slime `args`, for a generate function in slime's convention."""
    r = cfg.rollout
    return RolloutSettings(
        n_samples=r.n_samples_per_prompt, max_new_tokens=r.rollout_max_response_len,
        temperature=r.rollout_temperature, top_p=r.rollout_top_p, stop_token_ids=stop_token_ids(tokenizer, hf_dir),
        seed=cfg.training.seed, groups_needed=r.rollout_batch_size,
        groups_submitted=r.over_sampling_batch_size or r.rollout_batch_size, max_concurrency=r.rollout_max_concurrency,
        partial_rollout=r.partial_rollout, mask_offpolicy=r.mask_offpolicy_in_partial_rollout,
        custom_generate=load_generate(cfg, hf_dir, slime_args) if r.custom_generate_function_path
        else AgentGenerate(load_agent_function(r.agent_function_path)) if r.agent_function_path
        else openenv_generate(cfg) if source_kind(cfg.data.prompt_data) == OPENENV
        else VerifiersGenerate(cfg.data.prompt_data, cfg.data.verifiers_env, cfg.data.env_size)
        if source_kind(cfg.data.prompt_data) == VERIFIERS
        else None, tokenizer=tokenizer, max_prompt_len=r.rollout_max_prompt_len, timeout_s=r.rollout_timeout_s,
        max_context_len=r.rollout_max_context_len,
    )  # fmt: skip


def eval_rollout_settings(cfg: RunConfig, settings: RolloutSettings) -> RolloutSettings:
    """The rollout's settings with the eval group's sampling overrides (None keeps the rollout's value)."""
    e, s = cfg.eval, settings
    # `is None`, never `or`: temperature 0.0 (greedy) is a setting, not "unset".
    return dataclasses.replace(
        s,
        temperature=s.temperature if e.eval_temperature is None else e.eval_temperature,
        top_p=s.top_p if e.eval_top_p is None else e.eval_top_p,
        max_new_tokens=s.max_new_tokens if e.eval_max_response_len is None else e.eval_max_response_len,
    )


def load_eval_prompts(cfg: RunConfig, store: ObjectStore, tokenizer) -> dict[str, list[PromptItem]]:
    """Evaluation set name -> its first eval_size prompts, rendered like the training prompts."""
    e, out = cfg.eval, {}
    for name, source in cfg.eval_sets:
        # A generated eval set uses another seed than the training set, so it holds other problems.
        rows = load_dataset(cfg, store, source, e.eval_size, cfg.training.seed + 1)[: e.eval_size]
        out[name] = render_items(cfg, tokenizer, rows)
    return out
