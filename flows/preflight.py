"""Mistakes in the files a config names, and layouts that cannot fit in memory, found before any engine,
router or Prefect server starts.

A run starts its engines and Prefect's server early so they load while the flow's imports run (flows/run.py);
a missing or malformed data file found after that costs the user 25-50 s and leaves processes to stop. The
checks here read only what the config names (prompt and eval files, environment specs, a model directory,
plugin files) and import no torch, so a mistake is one line within about a second of the command.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from sluiceway.flows.config import RunConfig
from sluiceway.infra.errors import UserError
from sluiceway.infra.prompt_sources import ENV, EPISODES, OPENENV, VERIFIERS, source_kind

if TYPE_CHECKING:
    from sluiceway.tasks.train.memory_model import ModelShape
    from sluiceway.tasks.train.memory_plan import MemoryPlan


def check_data_source(
    source: str, input_key: str, label_key: str | None, metadata_key: str, flag: str = "--prompt-data",
    verifiers_args: dict | None = None,
) -> None:  # fmt: skip
    """A prompt file (every line parsed and its keys checked), an `env:` spec, a `verifiers:` source (its
    environment built, `verifiers_args` its data.verifiers_env) or an `openenv:` source; errors name
    `flag`."""
    kind = source_kind(source)
    if kind == ENV:
        from sluiceway.tasks.environments import parse_spec

        parse_spec(source)
        return
    if kind == VERIFIERS:  # imports verifiers and the taskset, builds the environment (a few seconds)
        if flag != "--prompt-data":
            raise UserError(f"{flag} {source}: a verifiers environment is a training source only (--prompt-data)")
        from sluiceway.tasks.environments.verifiers_env import load_env

        load_env(source, verifiers_args)
        return
    if kind == OPENENV:  # the server answers, or the class imports where openenv is (a few seconds)
        if flag != "--prompt-data":
            raise UserError(f"{flag} {source}: an OpenEnv environment is a training source only (--prompt-data)")
        from sluiceway.tasks.environments.openenv_servers import check_openenv_source

        check_openenv_source(source)
        return
    from sluiceway.storage.datasets import check_prompt_file

    try:
        check_prompt_file(source, input_key, label_key, metadata_key)
    except UserError as e:
        raise UserError(f"{flag} {e}") from None


def check_output_dir(path: str) -> None:
    """--output-dir must be a directory this process can create and write (checked before logging opens it)."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise UserError(f"--output-dir {path}: exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".sluiceway-write-check-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise UserError(f"--output-dir {path}: cannot create or write it ({e.strerror or e})") from None


def check_model(name_or_dir: str, weights_root_ok: bool = False) -> None:
    """A path-like --hf-checkpoint must be a model directory (zoo names are resolved, and built, later);
    `weights_root_ok`: a run's weights directory, whose newest version is the model (`sluiceway eval`)."""
    p = Path(name_or_dir).expanduser()
    if not (p.exists() or os.sep in name_or_dir or name_or_dir.startswith((".", "~"))):
        return  # a zoo name, or a mistake the zoo names in its own error
    if not p.is_dir():
        raise UserError(f"--hf-checkpoint {name_or_dir}: no such model directory")
    if not (p / "config.json").is_file() and not weights_root_ok:
        raise UserError(f"--hf-checkpoint {name_or_dir}: not a model directory (no config.json)")


def check_plugin_file(path: str | None, flag: str) -> None:
    """'file.py:fn' must name an existing file ('module:fn' is imported later, where it is used)."""
    if not path or ":" not in path:
        return  # unset, or a built-in name (e.g. --dynamic-sampling-filter-path zero_std)
    file, _, fn = path.rpartition(":")
    if not file or not fn:
        raise UserError(f"{flag} {path}: expected 'file.py:function' or 'module:function'")
    if file.endswith(".py"):
        source = Path(file).expanduser()
        if not source.is_file():
            raise UserError(f"{flag} {path}: {file} not found")
        try:  # compiled, not run: a syntax error is the user's, and is one line here rather than at import
            compile(source.read_bytes(), str(source), "exec")
        except SyntaxError as e:
            raise UserError(f"{flag} {path}: {file} line {e.lineno}: {e.msg}") from None
        except (OSError, ValueError) as e:
            raise UserError(f"{flag} {path}: cannot read {file} ({e})") from None


def check_conventions(cfg: RunConfig) -> None:
    """Each custom function imports and its calling convention, slime's or sluiceway's, is told (by its signature
    or --plugin-convention): a function that cannot be told is one line here, before any engine starts, rather than
    a call with the wrong arguments mid-rollout (tasks/rollout/slime_plugins/convention.py). Imports the functions'
    modules, so only when there are some."""
    r, rw = cfg.rollout, cfg.reward
    hooks = [(r.custom_generate_function_path, "--custom-generate-function-path", "generate"),
             (rw.custom_rm_path, "--custom-rm-path", "group_rm" if rw.group_rm else "rm")]  # fmt: skip
    if r.dynamic_sampling_filter_path not in (None, "zero_std", "truncated"):
        hooks.append((r.dynamic_sampling_filter_path, "--dynamic-sampling-filter-path", "filter"))
    hooks = [h for h in hooks if h[0]]
    from sluiceway.tasks.rollout.slime_plugins.hooks import HOOKS as STEP_HOOKS

    step_hooks = {k: getattr(r, k) for k in STEP_HOOKS if getattr(r, k, None)}
    if not hooks and not step_hooks:
        return
    from sluiceway.tasks.rollout.slime_plugins.convention import SLIME, convention_of, load_plugin

    for field, path in step_hooks.items():  # slime's convention only: importing them is the check
        load_plugin(path, STEP_HOOKS[field])

    for path, flag, hook in hooks:
        convention = convention_of(load_plugin(path, flag), hook, r.plugin_convention, path)
        if hook == "generate" and convention == SLIME and r.rollout_max_context_len is None:
            # SGLang holds the model's whole context; an embedded engine's KV cache is allocated for this many.
            logging.getLogger("sluiceway").info(
                f"{flag} {path}: a slime generate builds its own prompts; the embedded engines hold "
                f"{engine_max_total_len(cfg)} tokens a sequence (--rollout-max-prompt-len + "
                "--rollout-max-response-len): set --rollout-max-context-len, slime's context cap, for more"
            )
        if hook == "generate" and convention == SLIME and r.rollout_top_p != 1.0:
            raise UserError(f"{flag} {path}: slime's GenerateState asks for top-p replay with --rollout-top-p "
                            f"{r.rollout_top_p}, which the engines here do not return; "
                            "use --rollout-top-p 1")  # fmt: skip


def engine_max_total_len(cfg: RunConfig) -> int:
    """Tokens per sequence the engines are sized for (each embedded engine's KV cache holds this many per
    request): the longest prompt plus the longest response, of training or of evaluation."""
    r = cfg.rollout
    total = r.rollout_max_prompt_len + max(r.rollout_max_response_len, cfg.eval.eval_max_response_len or 0)
    return max(total, r.rollout_max_context_len or 0)  # slime-style plugins may fill the whole context


def model_config(name_or_dir: str) -> dict | None:
    """The HF config.json of --hf-checkpoint (a zoo name is resolved, and built once, as the run would a moment
    later); None where there is none to read: the loader reports that itself."""
    p = Path(name_or_dir).expanduser()
    if not (p.exists() or os.sep in name_or_dir or name_or_dir.startswith((".", "~"))):
        from sluiceway.models.zoo import resolve_checkpoint  # imports torch: after every cheaper check

        try:
            p = resolve_checkpoint(name_or_dir)
        except UserError as e:  # not a zoo name: said here, before Prefect's server starts
            raise UserError(f"--hf-checkpoint {e}") from None
    # A run's weights root (`sluiceway eval`): every version has the architecture of the first.
    found = [p / "config.json"] if (p / "config.json").is_file() else sorted(p.glob("*/config.json"))[:1]
    try:
        config = json.loads(found[0].read_text()) if found else None
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def check_lengths(cfg: RunConfig, hf: dict) -> None:
    """Prompt plus response lengths must fit the model's positions (`hf`: its config.json), and the embedded
    engines' KV caches (sized by them, allocated whole when an engine starts) this machine's memory: else an
    engine fails after everything started, or tries to allocate terabytes."""
    model = cfg.training.hf_checkpoint
    r, ev = cfg.rollout, cfg.eval.eval_max_response_len
    total, limit = engine_max_total_len(cfg), hf.get("max_position_embeddings")
    if isinstance(limit, int) and total > limit:
        if r.rollout_max_prompt_len >= limit:
            flag, value = "--rollout-max-prompt-len", r.rollout_max_prompt_len
        elif ev is not None and ev > r.rollout_max_response_len:
            flag, value = "--eval-max-response-len", ev
        else:
            flag, value = "--rollout-max-response-len", r.rollout_max_response_len
        raise UserError(
            f"{flag} {value}: prompt ({r.rollout_max_prompt_len}) + response ({total - r.rollout_max_prompt_len})"
            f" = {total} tokens, more than the {limit} positions of {model} (max_position_embeddings)"
        )
    if r.rollout_engine != "embedded" or not r.rollout_num_engines:
        return
    try:  # the engine's KV cache: keys and values, per layer, request slot, KV head, position and head dim
        heads = hf["num_attention_heads"]
        per_token = 2 * hf["num_hidden_layers"] * hf.get("num_key_value_heads", heads)
        per_token *= hf.get("head_dim") or hf["hidden_size"] // heads
    except (KeyError, TypeError, ZeroDivisionError):
        return
    width = 4 if cfg.training.precision == "fp32" else 2  # auto may pick fp32 later: this is the least it takes
    need = per_token * width * total * r.engine_max_running_requests * r.rollout_num_engines
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > memory:
        raise UserError(
            f"--engine-max-running-requests {r.engine_max_running_requests} x {total} tokens"
            f" x {r.rollout_num_engines} engine(s): the embedded engines' KV caches for {model} would take"
            f" {need / 2**30:.1f} GiB, more than this machine's {memory / 2**30:.1f} GiB of memory"
        )


def preflight(cfg: RunConfig, command: str) -> None:
    """Raise a UserError for the first mistake in what `cfg` names; `command` is run, sft, replay or eval."""
    d = cfg.data
    check_output_dir(cfg.storage.output_dir)
    if command == "sft" and d.prompt_data:
        check_data_source(d.prompt_data, d.input_key, d.response_key, d.metadata_key)
    elif command == "run" and d.prompt_data:
        check_data_source(d.prompt_data, d.input_key, d.label_key, d.metadata_key, verifiers_args=d.verifiers_env)
    if command in ("run", "eval"):
        for _, source in cfg.eval_sets:
            check_data_source(source, d.input_key, d.label_key, d.metadata_key, flag="--eval-prompt-data")
    check_model(cfg.training.hf_checkpoint, weights_root_ok=command == "eval")
    check_plugin_file(cfg.reward.custom_rm_path, "--custom-rm-path")
    check_plugin_file(cfg.rollout.custom_generate_function_path, "--custom-generate-function-path")
    check_plugin_file(cfg.rollout.dynamic_sampling_filter_path, "--dynamic-sampling-filter-path")
    check_plugin_file(d.openenv_action_parser, "--openenv-action-parser")
    check_plugin_file(d.openenv_observation_text, "--openenv-observation-text")
    kind = source_kind(d.prompt_data)
    if kind in EPISODES and (cfg.rollout.agent_function_path or cfg.rollout.custom_generate_function_path):
        raise UserError(f"--prompt-data {d.prompt_data} plays the environment's episodes itself: it cannot be combined"
                        " with --agent-function-path or --custom-generate-function-path")  # fmt: skip
    if kind in EPISODES and cfg.eval_sets:
        what = {VERIFIERS: "verifiers", OPENENV: "OpenEnv"}[kind]
        raise UserError(f"--prompt-data {d.prompt_data}: evaluation sets are not played as {what} episodes yet: "
                        "unset --eval-prompt-data")  # fmt: skip
    check_conventions(cfg)
    hf = model_config(cfg.training.hf_checkpoint)  # last: a zoo name imports torch
    if hf is not None and command in ("run", "eval"):  # the commands that start engines
        check_lengths(cfg, hf)
    if command in ("run", "replay"):  # before the memory plan, which reads the teacher's config.json too
        check_teacher(cfg, hf)
    if hf is not None:
        check_memory(cfg, hf, command)


def check_teacher(cfg: RunConfig, student: dict | None) -> None:
    """On-policy distillation's opd_teacher_load: a model directory (or zoo name) whose vocabulary is the student's
    (the teacher scores the student's token ids), checked from the config.json files before anything starts."""
    opd = cfg.algorithm.opd
    if opd is None or opd.teacher_load is None:
        return
    try:
        check_model(opd.teacher_load)
        teacher = model_config(opd.teacher_load)
    except UserError as e:
        raise UserError(str(e).replace("--hf-checkpoint", "--opd-teacher-load", 1)) from None
    if teacher is None or student is None:
        return
    tv, sv = teacher.get("vocab_size"), student.get("vocab_size")
    if tv != sv:
        raise UserError(
            f"--opd-teacher-load {opd.teacher_load}: a vocabulary of {tv} tokens, the student's"
            f" ({cfg.training.hf_checkpoint}) has {sv}: the teacher must share the student's tokenizer"
        )


def check_memory(cfg: RunConfig, hf: dict, command: str) -> None:
    """The memory plan (tasks/train/memory_plan.py) of the trainer ranks and embedded engines must fit the memory
    there is: a layout that cannot is one line with the numbers. A config.json the plan cannot read is left to the
    loader."""
    from sluiceway.tasks.train.memory_model import ModelShape

    try:
        ModelShape.from_hf(hf, cfg.training.hf_checkpoint).check_tp(cfg.resources.tensor_model_parallel_size)
    except UserError:
        return
    check_fits(cfg, hf, command)


# ---------------------------------------------------------------------------------------------------------------------
# The memory plan of a config (tasks/train/memory_plan.py), from the config.json files it names
# ---------------------------------------------------------------------------------------------------------------------


def read_hf_config(source: str) -> tuple[dict, str]:
    """(config.json as a dict, where it came from) for a path to a .json file, a model directory (or a run's
    weights root), or a zoo name (built once, as a run would)."""
    p = Path(source).expanduser()
    if p.is_file():
        try:
            hf = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{source}: cannot read it as a config.json ({e})") from None
        if not isinstance(hf, dict):
            raise UserError(f"{source}: expected a JSON object")
        return hf, str(p)
    check_model(source, weights_root_ok=True)
    hf = model_config(source)
    if hf is None:
        raise UserError(f"--hf-checkpoint {source}: no readable config.json")
    return hf, source


def opd_teacher_shape(cfg: RunConfig) -> ModelShape | None:
    """The teacher of --use-opd --opd-type megatron, from its config.json (None: no teacher in the trainer)."""
    from sluiceway.tasks.train.memory_model import ModelShape

    opd = cfg.algorithm.opd
    if opd is None or opd.engine or not opd.teacher_load:
        return None
    try:
        hf, _ = read_hf_config(opd.teacher_load)
    except UserError as e:
        raise UserError(str(e).replace("--hf-checkpoint", "--opd-teacher-load", 1)) from None
    return ModelShape.from_hf(hf, f"--opd-teacher-load {opd.teacher_load}")


def plan_for_config(
    cfg: RunConfig,
    command: str = "run",
    hf: dict | None = None,
    available_gib: float | None = None,
    bf16: bool | None = None,
) -> MemoryPlan:
    """The plan of the run `cfg` describes; `available_gib` replaces the memory found here (the GPU's with
    --device cuda, else the machine's)."""
    from sluiceway.tasks.train import memory_plan as mp
    from sluiceway.tasks.train.memory_model import Layout

    source = cfg.training.hf_checkpoint
    name = source
    if hf is None:
        hf, name = read_hf_config(source)
    teacher = opd_teacher_shape(cfg) if command in ("run", "replay") else None
    lay = Layout.from_config(cfg, command, bf16, teacher, engine_max_total_len(cfg))
    cpu, gpu, label = mp.machine_memory(), None, ""
    if lay.device == "cuda":
        gpu, label = mp.gpu_memory()
        label = label or "the GPU"
    if available_gib is not None:
        if lay.device == "cuda":
            gpu, label = int(available_gib * mp.GIB), "--available-gib"
        else:
            cpu = int(available_gib * mp.GIB)
    return mp.plan(hf, lay, name, cpu, gpu, label)


def check_fits(cfg: RunConfig, hf: dict, command: str) -> None:
    """Refuse (UserError, one line) a layout that cannot fit. `precision auto` is checked at whichever of bf16
    and fp32 takes less, since the choice is made later."""
    if cfg.training.precision == "auto":
        plans = [plan_for_config(cfg, command, hf, bf16=b) for b in (True, False)]
    else:
        plans = [plan_for_config(cfg, command, hf)]
    if any(p.fits for p in plans):
        return
    best = min(plans, key=lambda p: max((need - (avail or need)) for _, need, avail, _ in p.verdicts()))
    raise UserError(best.summary())


def print_plan(cfg: RunConfig, available_gib: float | None = None) -> int:
    """`sluiceway plan`: print the plan of the run `cfg` describes; 0 if it fits, 1 if not."""
    t = cfg.training
    bf16, note = None, ""
    if t.precision == "auto":
        if cfg.resources.device == "cuda":  # planned for the GPU the layout names, not for this machine
            bf16, note = True, "auto: planned as bf16 (what a GPU with native bf16 computes in)"
        else:
            from sluiceway.models.precision import choose

            choice = choose("auto", "cpu")
            bf16, note = choice.bf16, choice.reason
    command = "sft" if cfg.algorithm.loss_type == "sft_loss" else "run"
    p = plan_for_config(cfg, command, available_gib=available_gib, bf16=bf16)
    if note:
        print(f"precision: {'bf16' if bf16 else 'fp32'} ({note})")
    print(p.render(), end="")
    return 0 if p.fits else 1
