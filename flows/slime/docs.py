"""docs/slime.md, rendered from the flag table (python -m sluiceway.flows.slime.docs > docs/slime.md; a test keeps
it current), and the table's rows for docs/configuration.md's last section."""

from __future__ import annotations

import textwrap

from sluiceway.flows.slime.flag_table import SLIME_FLAGS
from sluiceway.flows.slime.translate import SLIME_DEFAULTS
from sluiceway.flows.slime.treatments import ARCHITECTURE, IMPLEMENTED, MAPPED, NOT_APPLICABLE, REFUSED, SLIME_COMMIT


def _rows(kind: str) -> list[str]:
    rows = []
    for flag, spec in sorted(SLIME_FLAGS.items()):
        if spec.kind == kind:
            note = spec.note.replace("|", "\\|")
            rows.append(f"| `{flag}` | {note} |")
    return rows


def render_table() -> list[str]:
    """The flags of this module as one markdown table (docs/configuration.md's last section)."""
    lines = ["| flag | treatment | meaning here |", "| --- | --- | --- |"]
    for kind in (IMPLEMENTED, MAPPED, NOT_APPLICABLE, ARCHITECTURE, REFUSED):
        for row in _rows(kind):
            flag, note = row[2:].split(" | ", 1)
            lines.append(f"| {flag} | {kind} | {note}")
    return lines


_PLUGINS_0 = (
    "Which convention a function speaks is told from its signature (a generate's parameter names: `args, "
    "sample` or `ctx, prompt`; the others' number of positional arguments, and where both counts bind, as in "
    "`def score(response, label, sample=None)`, their names: slime's first is `args`, ours `response`, "
    "`responses` or `rows`, or a second `label`). One the signature cannot tell (`*args`, other names) stops "
    "the run before anything starts with one line naming the function and both signatures; "
    "`--plugin-convention slime|sluiceway` then decides."
)

_PLUGINS_1 = (
    "A slime generate gets a `Sample` built as slime's dataset builds it (`prompt` the rendered text with "
    "`--apply-chat-template`, else the dataset's prompt; `label`, `metadata`, `index`, `group_index`, "
    "status PENDING) and `GenerateState(args).sampling_params` with the run's per-sample seed as "
    "`sampling_seed`; `evaluation` only when it has that parameter; `sample.generate_function_path` is "
    "honoured. It posts to the run's router (`args.sglang_router_ip/port`). The returned Sample is the "
    "trajectory row: prompt `tokens[:-response_length]`, the response the rest, its `loss_mask` and "
    "`rollout_log_probs`, status as the finish reason (completed stop, truncated length, aborted abort, "
    "anything else a failure), weight versions as integers, a reward it set stored; a dict reward is "
    "stored whole (`reward_details.slime_reward`) and `--reward-key` picks the trained number; "
    "`remove_sample` zeroes the row's loss mask; `teacher_log_probs` fill the row's teacher log-probs; "
    "every other field and any attribute the plugin set is in the row's `metadata` under `slime_sample`, "
    "and the reward function and the filter get that same Sample back. Lengths that disagree make that "
    "sample a failed row with the reason (`metadata.failure_reason`), not a crash. A list of Samples (one "
    "prompt fanned out, slime's multi_agent) is every one trained: the first is the planned sample's row, the "
    "others more rows of the same group (sample_index from `--n-samples-per-prompt` on, `metadata.fanout_of` "
    "naming the planned sample); more than one must share a `rollout_id`, as slime asserts. Samples it left "
    "without a reward go to a slime `--custom-rm-path` as one list (slime's `batched_async_rm`), else to the "
    "reward stage per row; advantages are normalised per group (the prompt's rows; slime normalises the whole "
    "batch at once when its sample count is not batch x n), and the trainer takes every row of the step. "
    "`--rm-type` names only slime's rm_hub has (`boxed_*`, `remote_rm`, "
    "`random`) are graded by it."
)

_PLUGINS_2 = (
    "`args` is an argparse.Namespace with slime's name for every flag (the config fields, and slime's "
    "other flags at their mapped value or slime's default), plus what plugins read: "
    "`sglang_router_ip`/`sglang_router_port`, `hf_checkpoint` (the model's local directory), "
    "`rollout_max_context_len` (a config field: prompts must be shorter; the engines are sized to hold "
    "it), `rollout_num_engines`, `sglang_server_concurrency`, `rollout_seed`, `rollout_top_k` -1 and the "
    "stop settings at slime's defaults. `--custom-config-path FILE.yaml` sets each top-level key on it, "
    "as slime does. The `slime` modules plugins import are provided when no real slime is installed: "
    "`slime.utils.types` (`Sample`, `Status`), `slime.utils.http_utils` (`post`, `init_http_client`), "
    "`slime.utils.misc` (`load_function`, `SingletonMeta`), `slime.utils.processing_utils` "
    "(`load_tokenizer`), `slime.rollout.sglang_rollout` (`GenerateState`, `generate`, `generate_and_rm`), "
    "`slime.rollout.rm_hub` (`async_rm`, `batched_async_rm`, the rule-based types math, deepscaler, f1, dapo, "
    "remote_rm and random; `rm_hub.math_dapo_utils`, DAPO's grader as slime's retool example imports it, which "
    "gave slime's own grades on 630,000 generated strings) and `slime.rollout.filter_hub` "
    "(`DynamicFilterOutput`, `check_reward_nonzero_std`). slime's top-p replay is not: a slime generate "
    "needs `--rollout-top-p 1`. slime's other hooks (the refused table: "
    "buffer filters, data sources, eval log functions, the trainer-side losses and hooks) are one line "
    "each, before any engine starts."
)

_PLUGINS_3 = (
    "Three per-step hooks run in slime's convention only, after the filter stage, on the step's rows as the "
    "Samples the generate made (tasks/rollout/slime_plugins/hooks.py), in slime's order, once per step (a "
    "resumed step does not call them again). `--rollout-sample-filter-path` gets `(args, data)`, `data` the "
    "step's trained groups as `list[list[Sample]]`; a Sample it marks `remove_sample` is stored with the flag "
    "(`metadata.slime_sample.remove_sample`, its former mask beside it) and a zero loss mask: out of the loss, "
    "its reward still in its group's advantages, as in slime. `--rollout-all-samples-process-path` gets "
    "`(args, all_samples, data_source)`: every finished group, the filtered-out ones too; `data_source` is an "
    "object whose `get_samples`/`add_samples` (and calling it) raise a NotImplementedError saying why: "
    "prompts come from `--prompt-data` in sluiceway's order and there is no buffer to return samples to. "
    "`--custom-rollout-log-function-path` gets `(rollout_id, args, samples, rollout_extra_metrics, "
    "rollout_time)`: the step, the trained Samples flattened, the filter stage's metrics, the seconds from "
    "the step's first request to its last stored row; its return value (in slime: skip the default "
    "logging) is ignored: the metrics table and the run's loggers are always written. These three and the "
    "reward post-process below are fields not listed by `run --help`; `run --help-slime` lists them."
)

_PLUGINS_4 = (
    "`--custom-reward-post-process-path` gets `(args, samples)`, the step's trained Samples (after the three "
    "hooks above, the removed ones included, as slime passes them) and returns `(raw_rewards, rewards)`, one "
    "finite number each per sample (anything else is one line naming the hook). As in slime, `rewards` take the "
    "place of the advantage estimator's group baselines: they are the advantages with grpo, gspo and the "
    "other group estimators, whitened over the batch's tokens with reinforce_plus_plus_baseline, and the "
    "sequence reward the per-token estimators (ppo, reinforce_plus_plus) start from. Both are stored in each "
    "row's `metadata.reward_post_process` (`raw`, `reward`); the `reward` column keeps the reward stage's score."
)


_PLUGINS_5 = (
    "A slime generate function runs in a worker process of its own (tasks/rollout/slime_plugins/worker.py; "
    "--no-plugin-process keeps it in the run's process, for a debugger): one that calls `os._exit`, is killed or "
    "blocks the worker's event loop (a third of --rollout-timeout-s without a beat, 5 minutes at most) ends "
    "that worker, and each call it held runs again alone in a worker of its own, so only the sample that ends "
    "that one too is stored failed, with the reason; one that never returns is cut at --rollout-timeout-s. "
    "slime's plugins share one `args`: attributes the run set go with each call and attributes the function "
    "assigns come back onto the run's args, where the reward and filter hooks read them (a value changed in "
    "place, `args.seen.append(x)`, does not cross). The reward, filter and log hooks run in the run's process."
)

_OUTSIDE = (
    "slime's own example plugins, unchanged: `python examples/run_slime_plugins.py /path/to/slime` runs "
    "examples/retool (generate_with_retool.generate and .reward_func, its tool sandbox, rm_hub.math_dapo_utils), "
    "examples/multi_agent (generate_with_multi_agents: five solver Samples per prompt, rm type deepscaler) and "
    "examples/search-r1 (generate_with_search.generate and .reward_func against a local retrieval server, a "
    "dict label) through `sluiceway run` with their own flags, two steps each on SmolLM2-135M-Instruct. At slime "
    "624b824a all three run to the end. What the script sets that slime's launch scripts do not: small data in "
    "the examples' formats, small lengths, and `--rollout-max-context-len` (retool's prompt template alone is "
    "539 tokens, more than tiny-llama's 512 positions; sluiceway's embedded engines are sized by "
    "prompt + response unless that flag says more, and the run's log says so when a slime generate is used). "
    "It checks the interface, not learning: the 135M model solved nothing and never searched, so every group's "
    "rewards were equal."
)


def render_markdown() -> str:
    """docs/slime.md."""
    lines = [
        "# slime compatibility",
        "",
        "Generated from `flows/slime/` by `python -m sluiceway.flows.slime.docs`; do not edit by hand.",
        "",
        "A slime launch script's flags run through `sluiceway run` as they are, or the script itself:",
        "",
        "    sluiceway run --from-slime-script scripts/run-qwen3-4B.sh [--flag value ...]",
        "",
        "reads its `*_ARGS=( ... )` arrays, the model files it `source`s and its `python3 train.py ...` line",
        "(flows/slime/script.py: simple assignments, `${VAR:-default}`, `$((...))`, `$(seq ...)` and the",
        "environment; a value computed by other shell code is one error line naming the file and line), prints",
        "how each flag is treated, then runs. Flags after the script override it.",
        "`examples/run_slime_example_cpu.py` runs slime's fully-async example this way on the CPU with tiny-llama.",
        "",
        "`sluiceway run --help-slime` lists the flags of the tables below and how each is treated; `sluiceway run",
        "--help` lists only sluiceway's own flags (the config fields) and ends with a line pointing here. `run`,",
        "`sft`, `replay`, `eval`, `config` and `plan` all accept these flags.",
        "",
        f"Checked against THUDM/slime `{SLIME_COMMIT[:12]}`: every flag of `scripts/run-qwen3-4B.sh`,",
        "`run-glm4-9B.sh`, `run-qwen3-30B-A3B.sh`, `examples/fully_async/run-qwen2.5-0.5B-fully_async.sh`,",
        "`examples/search-r1/run_qwen2.5_3B.sh`, `examples/delta_weight_sync/run-glm4.7-30B-A3B-delta.sh` and the",
        "model files they source is accepted (tests/unit/config/test_slime_flags.py; the flag lists are in",
        "tests/data/slime_flags/). Across all 44 launch scripts of slime's `scripts/` and `examples/` at that",
        "commit every flag has a treatment in the tables below; 43 of them are read as they are (the geo3k VLM",
        "example computes `MODEL_NAME_LOWER` with shell code: give it in the environment). A few flags of the",
        "rest change results in ways not implemented here and are refused (last table).",
        "",
        "## Flags that are sluiceway fields",
        "",
        "Every config field is a flag of the same name (docs/configuration.md), which is slime's name where slime",
        "has the setting: `--rollout-batch-size`, `--n-samples-per-prompt`, `--global-batch-size`, `--lr`,",
        "`--eps-clip-high`, `--kl-loss-type`, `--tensor-model-parallel-size`, `--recompute-*`, `--eval-*`, ... These",
        "mean what they mean in slime. `--sglang-X V` flags are passed to SGLang engines as `--X V`",
        "(`--rollout-engine sglang`); with the embedded engine they are listed once in the log as not applicable.",
        "`--rm-type deepscaler` grades the answer after `</think>` as slime's rm_hub does.",
        "",
        "A slime command line on one machine without `--ray-address` (it has flags of the tables below):",
        "`--rollout-num-gpus` is not applicable (the engines are embedded here), `--actor-num-nodes N",
        "--actor-num-gpus-per-node G` is N x G trainer processes here, pipeline and context parallel GPUs become",
        "the same data-parallel size without them (`--pipeline-model-parallel-size` > 1 runs at 1: the same",
        "computation), and `--use-kl-loss --kl-loss-coef 0` leaves the zero-weight KL term out (slime logs its",
        "value; the loss is the same). Each of these is one line in the run's log.",
        "",
        "slime's defaults: a slime command line (one with a flag of the tables below, as slime's scripts all have)",
        "that leaves one of these out gets slime's (or Megatron's) value instead of sluiceway's, and the run logs",
        "which: "
        + ", ".join(f"`--{k.split('.', 1)[1].replace('_', '-')} {v}`" for k, v in SLIME_DEFAULTS.items())
        + " (slime's loss is the mean of per-sample token means unless `--calculate-per-token-loss`). Two of",
        "slime's defaults are not honoured, and the run's log says so when a command line relies on them: prompts",
        "in file order without `--rollout-shuffle` (sluiceway shuffles each epoch), and Megatron's dropout 0.1",
        "without `--attention-dropout 0.0 --hidden-dropout 0.0` (sluiceway trains without dropout).",
        "",
        "## slime's plugins",
        "",
        "The Python a slime project writes runs as it is (tasks/rollout/slime_plugins/). These hooks take slime's",
        "function, named by slime's dotted `module.function` (resolved as slime's `load_function` does, with the",
        "current directory and, under `--from-slime-script`, the script's own directory importable, as slime's",
        "scripts set PYTHONPATH) or by sluiceway's `module:function` / `file.py:function`:",
        "",
        "| hook | slime's function, called as slime calls it | sluiceway's function |",
        "| --- | --- | --- |",
        "| `--custom-generate-function-path` | `async generate(args, sample, sampling_params[, evaluation])` "
        "-> `Sample` or `list[Sample]` "
        "| `async generate(ctx, prompt, params)` (tasks/rollout/multiturn.py) |",
        "| `--custom-rm-path` | `async rm(args, sample)`; with `--group-rm` `rm(args, samples)` "
        "| `fn(response, label, sample)`; with `--group-rm` `fn(responses, labels, samples)` |",
        "| `--dynamic-sampling-filter-path` | `fn(args, group)` -> bool or `DynamicFilterOutput(keep, reason)` "
        "| `fn(rows)` -> keep or a reason |",
        "| `--rollout-sample-filter-path` | `fn(args, data)`, marks `sample.remove_sample` | - |",
        "| `--rollout-all-samples-process-path` | `fn(args, all_samples, data_source)` | - |",
        "| `--custom-rollout-log-function-path` | "
        "`fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time)` | - |",
        "| `--custom-reward-post-process-path` | `fn(args, samples)` -> `(raw_rewards, rewards)` | - |",
        "",
        *textwrap.wrap(break_on_hyphens=False, text=_PLUGINS_0, width=110),
        "",
        *textwrap.wrap(break_on_hyphens=False, text=_PLUGINS_1, width=110),
        "",
        *textwrap.wrap(break_on_hyphens=False, text=_PLUGINS_2, width=110),
        "",
        *textwrap.wrap(break_on_hyphens=False, text=_PLUGINS_3, width=110),
        "",
        *textwrap.wrap(break_on_hyphens=False, text=_PLUGINS_4, width=110),
        "",
        *textwrap.wrap(break_on_hyphens=False, text=_PLUGINS_5, width=110),
        "",
        *textwrap.wrap(break_on_hyphens=False, text=_OUTSIDE, width=110),
        "",
        "## Implemented",
        "",
        "slime's meaning holds here; a value sluiceway does not implement is one error line.",
        "",
        "| flag | meaning here |",
        "| --- | --- |",
        *_rows(IMPLEMENTED),
        "",
        "## Mapped onto sluiceway fields",
        "",
        "| flag | becomes |",
        "| --- | --- |",
        *_rows(MAPPED),
        "",
        "`--load`/`--save`/`--ref-load`: slime's checkpoint directories. `--save DIR` is the run directory, where",
        "sluiceway's checkpoints go; `--load` naming the same directory (slime's usual `--load X --save X`) is",
        "accepted, and a run in it is continued with `sluiceway resume DIR`; a `--load` elsewhere that holds",
        "anything (a Megatron torch_dist checkpoint) is refused with one line: convert it to HF and pass",
        "`--hf-checkpoint`. `--ref-load` is the torch_dist conversion of the HF checkpoint in slime's scripts:",
        "the reference model here is `--hf-checkpoint` itself (logged once).",
        "",
        "## Not applicable on this device",
        "",
        "GPU kernels, collectives, memory layouts and placement: accepted, no effect on results here, listed",
        "once in the run's log (`slime flags not applicable on this device ...`).",
        "",
        "| flag | what it does in slime |",
        "| --- | --- |",
        *_rows(NOT_APPLICABLE),
        "",
        "## Model architecture",
        "",
        "The model is built from `--hf-checkpoint`'s config.json. These flags (slime's `scripts/models/*.sh`)",
        "are checked against it before anything starts: agreeing flags are accepted (listed once in the log), a",
        "contradiction is one error line naming both values, e.g.",
        "`error: --hidden-size 4096 contradicts --hf-checkpoint DIR: its config.json has hidden_size 2560`.",
        "",
        "| flag | config.json |",
        "| --- | --- |",
        *_rows(ARCHITECTURE),
        "",
        "## Refused",
        "",
        "Settings that change results and are not implemented here: one error line, never ignored. None of the",
        "six scripts above uses one; across the rest of slime's `scripts/` and `examples/` these appear:",
        "",
        "| flag | why |",
        "| --- | --- |",
        *_rows(REFUSED),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_markdown(), end="")
