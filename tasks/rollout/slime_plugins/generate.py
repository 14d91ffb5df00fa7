"""A generate function written for slime, run as sluiceway's custom generate (tasks/rollout/multiturn.py).

Per sample: a slime `Sample` is built from the `PromptItem` as slime's dataset and rollout give it (prompt: the
rendered text with --apply-chat-template, else the dataset's prompt; label, metadata, status PENDING, no tokens),
the sampling params are `GenerateState(args).sampling_params` (a copy, as slime's generate_and_rm_group makes) with
sluiceway's per-sample seed as `sampling_seed` (the engine takes it: the run stays reproducible), and
`await fn(args, sample, sampling_params)` runs (`evaluation=False` only when the function has that parameter),
or the function `sample.generate_function_path` names, as slime's generate_and_rm does. The plugin posts to the run's
router itself (`args.sglang_router_ip/port`, set from the pool the group runs on).

The Sample it returns becomes the row (`SampleGeneration`): the prompt is `tokens[:-response_length]`, the response
the last `response_length` tokens (slime's trainer contract), with its loss mask and rollout log-probs; the status
is the finish reason; a reward the plugin set is stored (a dict whole, `--reward-key` picking the trained number).
Everything else of the Sample lands in the row's metadata under "slime_sample" (`sample_record`), so the reward
stage rebuilds the same Sample (tasks/rollout/slime_plugins/reward.py) and a query finds a plugin's attributes.
A Sample whose lengths disagree is that sample's failure with the reason (stored, masked out), not a crash.

A returned list of Samples (slime's fan-out, examples/multi_agent: one prompt made into several samples, every one
trained) becomes several rows of the group (`fan_out`): the first Sample is the planned sample's row, the others
ride along as its `siblings`, which `Rollout.group` (tasks/rollout/rollout.py) stores as extra rows of the same
group with sample_index n_samples_per_prompt, n+1, ... (in the order the planned samples and their lists come).
So a group holds n or more rows: the trainer trains every trainable row (its optimizer steps take a variable
number of rows), advantages are normalised per group (group_id: the prompt, as slime's per-prompt
normalisation; slime itself normalises the whole batch as one row when the count is not batch x n), a resume
counts stored groups by group_id. As slime asserts (rollout_data_utils.validate_rollout_id_annotated), a list of
more than one Sample must share one non-None `rollout_id`. Rewards as slime's generate_and_rm gives them: a
Sample the plugin left without a reward is scored by the reward stage per row, except that a slime-convention
--custom-rm-path is called once with the list of those Samples (slime's batched_async_rm), here, right after the
generate; with --group-rm the group's rm gets every row of the group (the lists flattened, in sample order).
Every row of a fan-out has metadata "fanout_of" (the planned sample index it came from).
"""

from __future__ import annotations

import inspect
import json
import math
import time
from argparse import Namespace
from dataclasses import dataclass, field
from typing import Any

from sluiceway.infra.errors import UserError
from sluiceway.tasks.rollout.generation import GenerationDefaults
from sluiceway.tasks.rollout.slime_plugins import provide_slime_names
from sluiceway.tasks.rollout.slime_plugins.args import router_of, set_router
from sluiceway.tasks.rollout.slime_plugins.worker import SlimeCalls, crossable, plugin_worker, status_value

FINISH = {"completed": "stop", "truncated": "length", "aborted": "abort"}
# Sample fields the row's own columns hold: not repeated in its metadata
_IN_COLUMNS = ("tokens", "loss_mask", "rollout_log_probs", "teacher_log_probs", "metadata")


@dataclass
class SampleGeneration(GenerationDefaults):
    """A slime Sample as sluiceway's `Generation` (tasks/rollout/generation.py)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "stop"
    latency_s: float = 0.0
    loss_mask: list[int] | None = None
    weight_versions: list[int] | None = None
    prompt_ids: list[int] | None = None
    reward: float | None = None
    reward_details: dict | None = None
    row_metadata: dict | None = None
    teacher_logprobs: list[float] | None = None
    prompt_text: str | None = None
    siblings: list[SampleGeneration] | None = None  # the other Samples of a fan-out: more rows of the group

    @property
    def weight_version(self) -> int:
        return self.weight_versions[-1] if self.weight_versions else 0


def sample_record(sample) -> dict:
    """The Sample's fields and a plugin's extra attributes, JSON-able, less what the row's columns hold."""
    record = {k: v for k, v in vars(sample).items() if k not in _IN_COLUMNS}
    record["status"] = status_value(sample.status)
    for name in ("spec_info", "prefix_cache_info"):
        value = record.get(name)
        if hasattr(value, "to_dict"):
            record[name] = value.to_dict()
    return record


def reward_of(reward: Any, args: Namespace) -> tuple[float, dict]:
    """(trained number, reward_details) of a slime reward: a dict is stored whole and `args.reward_key` picks the
    number (slime's Sample.get_reward_value); a missing key raises ValueError naming it."""
    if isinstance(reward, dict):
        key = getattr(args, "reward_key", None)
        if not key:
            raise ValueError(f"the reward is a dict ({sorted(reward)}) and --reward-key is not set")
        if key not in reward:
            raise ValueError(f"the reward has no key {key!r} (--reward-key; keys: {sorted(reward)})")
        return float(reward[key]), {"source": "slime", "slime_reward": reward}
    return float(reward), {"source": "slime"}


def _versions(values) -> list[int]:
    out = []
    for v in values or []:
        try:
            out.append(int(v))
        except (TypeError, ValueError):
            continue
    return out


def generation_of_sample(sample, args: Namespace, latency_s: float = 0.0) -> SampleGeneration:
    """The row a Sample becomes; a Sample whose parts disagree becomes a failed row saying why."""
    tokens = [int(t) for t in (sample.tokens or [])]
    n = sample.response_length
    record = sample_record(sample)
    meta = dict(sample.metadata) if isinstance(sample.metadata, dict) else {}
    problem = None
    if not isinstance(n, int) or not 0 <= n <= len(tokens):
        problem, n = f"response_length {n!r} with {len(tokens)} tokens", 0
    mask = [1] * n if sample.loss_mask is None else list(sample.loss_mask)
    logprobs = [] if sample.rollout_log_probs is None else [float(x) for x in sample.rollout_log_probs]
    if problem is None and len(mask) != n:
        problem = f"loss_mask has {len(mask)} entries for response_length {n}"
    if problem is None and sample.rollout_log_probs is not None and len(logprobs) != n:
        problem = f"rollout_log_probs has {len(logprobs)} entries for response_length {n}"
    status = status_value(sample.status)
    finish = FINISH.get(status)
    if problem is None and finish is None:
        problem = f"the generate function left status {status!r}"
    if problem is None and any(not math.isfinite(x) for x in logprobs):
        problem = "rollout_log_probs has a non-finite value"
    teacher = sample.teacher_log_probs
    if teacher is not None and len(teacher) != n:
        record["teacher_log_probs"], teacher = list(teacher), None  # kept, but not as the row's column
    if sample.remove_sample:  # slime trains such a sample with a zero loss mask (its rollout.py)
        record["loss_mask"], mask = mask, [0] * n
    out = SampleGeneration(
        token_ids=tokens[len(tokens) - n :],
        prompt_ids=tokens[: len(tokens) - n],
        logprobs=logprobs,
        loss_mask=mask,
        finish_reason=finish or "failed",
        latency_s=latency_s,
        weight_versions=_versions(sample.weight_versions),
        teacher_logprobs=[float(x) for x in teacher] if teacher is not None else None,
        row_metadata={**meta, "slime_sample": record},
        prompt_text=sample.prompt if isinstance(sample.prompt, str) else None,  # what the prompt tokens say
    )
    if problem is not None:
        out.finish_reason, out.loss_mask, out.logprobs = "failed", [0] * n, []
        out.row_metadata["failure_reason"] = problem
        return out
    if sample.reward is not None:
        try:
            out.reward, out.reward_details = reward_of(sample.reward, args)
        except (TypeError, ValueError) as e:
            out.reward, out.reward_details = 0.0, {"reward_status": "error", "message": str(e), "source": "slime"}
    return out


def slime_label(label):
    """A label as slime's dataset holds it: a JSON object (slime's search-r1 `reward_model`, stored as its JSON text,
    storage/datasets.py) as the dict, anything else as stored."""
    if isinstance(label, str) and label.startswith("{"):
        try:
            value = json.loads(label)
        except ValueError:
            return label
        return value if isinstance(value, dict) else label
    return label


def prompt_sample(prompt, ctx, args: Namespace, apply_chat_template: bool):
    """A fresh slime Sample for one of the group's samples, as slime's dataset and rollout make it."""
    provide_slime_names()
    from slime.utils.types import Sample

    step, group_id, i = _rid_parts(ctx.rid)
    groups = getattr(args, "over_sampling_batch_size", None) or args.rollout_batch_size
    group_index = step * groups + group_id  # slime's indices count on over the run
    text = prompt.text if apply_chat_template or prompt.source is None else prompt.source
    metadata = dict(prompt.metadata) if isinstance(prompt.metadata, dict) else {}
    return Sample(group_index=group_index, index=group_index * args.n_samples_per_prompt + i, prompt=text,
                  label=slime_label(prompt.label), metadata=metadata, session_id=ctx.routing_key)  # fmt: skip


def _rid_parts(rid: str) -> tuple[int, int, int]:
    """(step, group_id, sample index) of a request id `run/step/group/sample` (tasks/rollout/rollout.py)."""
    try:
        step, group, i = (int(x) for x in rid.rsplit("/", 3)[-3:])
    except ValueError:
        return 0, 0, 0
    return step, group, i


class SlimeGenerate:
    """sluiceway's custom generate around slime's `fn(args, sample, sampling_params[, evaluation])`.

    With a `worker` (tasks/rollout/slime_plugins/worker.py, what the run uses) the function runs in a process of
    its own; without one (the unit tests) here, on the run's loop."""

    def __init__(self, fn, name: str, args: Namespace, apply_chat_template: bool, worker=None):
        self.args, self.apply_chat_template = args, apply_chat_template
        self.calls = SlimeCalls(fn, name)
        self.name = name
        self.worker = worker
        self._sent: dict[str, Any] = dict(vars(args))  # the args attributes as the worker last got them

    def _args_for(self, ctx) -> Namespace:
        """The run's args pointed at the pool this group runs on (a copy for a remote pool's router)."""
        url = getattr(ctx.client, "router_url", None)
        if url is None:
            return self.args
        if router_of(self.args) is None:
            set_router(self.args, url)
        if router_of(self.args) == url.rstrip("/"):
            return self.args
        other = Namespace(**vars(self.args))
        set_router(other, url)
        return other

    async def __call__(self, ctx, prompt, params: dict) -> SampleGeneration:
        provide_slime_names()
        from slime.rollout.sglang_rollout import GenerateState
        from slime.utils.types import Sample

        args = self._args_for(ctx)  # slime's http client is set up where the function runs (SlimeCalls)
        state = GenerateState(args)
        sampling_params = state.sampling_params.copy()
        if params.get("sampling_seed") is not None:
            sampling_params["sampling_seed"] = params["sampling_seed"]
        sample = prompt_sample(prompt, ctx, args, self.apply_chat_template)
        t0 = time.perf_counter()
        if self.worker is None:
            out = await self.calls.generate(args, sample, sampling_params)
        else:
            out = await self._in_worker(args, sample, sampling_params)
        latency = time.perf_counter() - t0
        if isinstance(out, list):
            return fan_out([generation_of_sample(s, args, latency) for s in out], _rid_parts(ctx.rid)[2])
        if not isinstance(out, Sample):  # what crossed from the worker is checked there too
            raise UserError(f"{self.name} returned {type(out).__name__}, not a slime Sample")
        return generation_of_sample(out, args, latency)

    async def _in_worker(self, args: Namespace, sample, sampling_params: dict):
        """The call in the plugin's process: the run's args attributes changed since the worker last saw them go
        with it, and the attributes the plugin set come back onto the run's args (slime's plugins share one
        `args`: tasks/rollout/slime_plugins/args.py). A remote pool's copy goes whole, and its changes stay in it."""
        own = args is self.args
        if own:
            now = vars(args)
            changes = {k: v for k, v in now.items() if k not in self._sent or self._sent[k] is not v}
            self._sent.update(changes)
            changes = crossable(changes)
        else:
            changes = crossable(vars(args))
        out, back = await self.worker.call((changes, own, sample, sampling_params))
        if own:
            for k, v in back.items():
                setattr(self.args, k, v)
            self._sent.update(back)
        return out

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def fan_out(generations: list[SampleGeneration], planned: int) -> SampleGeneration:
    """The first generation, carrying the others as `siblings`; each row marked with the planned sample it came
    from (metadata "fanout_of")."""
    for g in generations:
        g.row_metadata = {**(g.row_metadata or {}), "fanout_of": planned}
    first = generations[0]
    first.siblings = generations[1:]
    return first


def load_generate(cfg, hf_dir, args=None):
    """What --custom-generate-function-path runs: sluiceway's function as it is, or slime's behind `SlimeGenerate`
    with the run's slime `args` (a new one when none is given)."""
    from sluiceway.tasks.rollout.slime_plugins.args import slime_args
    from sluiceway.tasks.rollout.slime_plugins.convention import GENERATE, SLIME, convention_of, load_plugin

    r = cfg.rollout
    path, flag = r.custom_generate_function_path, "--custom-generate-function-path"
    fn = load_plugin(path, flag)
    if not inspect.iscoroutinefunction(fn):
        raise UserError(f"{flag} {path}: '{getattr(fn, '__name__', fn)}' must be an async function")
    if convention_of(fn, GENERATE, r.plugin_convention, path) != SLIME:
        return fn
    args = args or slime_args(cfg, hf_dir)
    worker = plugin_worker(path, args, r.rollout_timeout_s) if r.plugin_process else None
    return SlimeGenerate(fn, path, args, cfg.data.apply_chat_template, worker)
