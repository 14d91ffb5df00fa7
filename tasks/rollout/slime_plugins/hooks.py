"""slime's per-step rollout hooks, run by the filter stage (flows/rl.py) once the step's groups are scored and
filtered, on the step's rows as slime Samples (`sample_of_row`, the Sample the generate produced):

- `--rollout-sample-filter-path`: `fn(args, data)`, `data` the step's trained groups (`list[list[Sample]]`, by
  group index, as slime's generate_rollout_async passes them); its return value is ignored. A Sample whose
  `remove_sample` it set is stored with the flag (metadata.slime_sample.remove_sample, the mask it had in
  .loss_mask) and a zero loss mask: kept out of the loss, its reward still in its group's advantages (slime: it
  "doesn't affect advantage normalization").
- `--rollout-all-samples-process-path`: `fn(args, all_samples, data_source)`, `all_samples` every finished
  group of the step, the filtered-out ones too; `data_source` is `NoDataSource`: sluiceway's prompts and buffer
  are its own, so `get_samples`/`add_samples` raise an error saying so.
- `--custom-rollout-log-function-path`: `fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time)`,
  `samples` the trained Samples flattened, `rollout_extra_metrics` the filter stage's metrics (slime's are its
  dynamic filter's drop counts), `rollout_time` the seconds from the step's first request to its last stored
  row. Its return value decides in slime whether the default logging is skipped; here the metrics table is
  always written, so it is ignored.

Order as slime's: the sample filter, then the all-samples process (which sees the filter's marks), then the log
function. Each runs once per step: the filter stage is in the step's ledger, so a resumed step does not call them
again.
"""

from __future__ import annotations

import inspect
import json
import math
from argparse import Namespace

import pyarrow as pa

from sluiceway.infra.errors import UserError
from sluiceway.storage.trajectories import is_finished, read_trajectories, update_samples
from sluiceway.tasks.rollout.slime_plugins.convention import load_plugin
from sluiceway.tasks.rollout.slime_plugins.reward import sample_of_row

HOOKS = {
    "rollout_sample_filter_path": "--rollout-sample-filter-path",
    "rollout_all_samples_process_path": "--rollout-all-samples-process-path",
    "custom_rollout_log_function_path": "--custom-rollout-log-function-path",
    "custom_reward_post_process_path": "--custom-reward-post-process-path",
}


class NoDataSource:
    """What `--rollout-all-samples-process-path` gets as slime's data source: sluiceway's prompts come from
    --prompt-data in step order and its buffer is the trajectories table, so neither can be read or fed here."""

    def get_samples(self, num_samples: int):
        raise NotImplementedError(
            "data_source.get_samples: not supported in sluiceway: prompts come from --prompt-data in "
            "sluiceway's own order (--rollout-all-samples-process-path gets no data source to draw from)"
        )

    def add_samples(self, samples):
        raise NotImplementedError(
            "data_source.add_samples: not supported in sluiceway: there is no buffer to return samples to "
            "(aborted groups continue with --partial-rollout; everything else is in the trajectories table)"
        )

    def __call__(self, num_samples: int):  # slime passes data_source.get_samples itself
        return self.get_samples(num_samples)


def configured(rollout_cfg) -> dict[str, str]:
    """The hooks this run sets: config field -> path."""
    return {k: getattr(rollout_cfg, k) for k in HOOKS if getattr(rollout_cfg, k, None)}


def _run(out):
    if inspect.isawaitable(out):
        import asyncio

        return asyncio.run(out)
    return out


def rollout_time(rows: list[dict]) -> float:
    """Seconds from the step's first request (a row's created_at less its generation time) to its last row."""
    if not rows:
        return 0.0
    ends = [r["created_at"].timestamp() for r in rows]
    starts = [e - (r.get("gen_time_s") or 0.0) for e, r in zip(ends, rows)]
    return max(ends) - min(starts)


def run_step_hooks(rollout_cfg, args: Namespace, store, run_id: str, step: int, metrics: dict) -> dict:
    """Call the run's slime rollout hooks on the step's rows (the module's docstring); returns what the filter
    stage records: how many samples the sample filter removed."""
    hooks = configured(rollout_cfg)
    if not hooks:
        return {}
    rows = [r for r in read_trajectories(store, run_id, step).to_pylist() if is_finished(r)]
    by_group: dict[int, list[dict]] = {}
    for r in sorted(rows, key=lambda r: (r["group_id"], r["sample_index"])):
        by_group.setdefault(r["group_id"], []).append(r)
    groups = {g: [sample_of_row(r) for r in members] for g, members in by_group.items()}
    kept = [g for g, members in by_group.items() if members[0]["filter_reason"] is None]
    data = [groups[g] for g in kept]
    out: dict[str, float] = {}
    if "rollout_sample_filter_path" in hooks:
        before = {id(s): s.remove_sample for group in data for s in group}
        fn = load_plugin(hooks["rollout_sample_filter_path"], HOOKS["rollout_sample_filter_path"])
        _run(fn(args, data))
        marked = [(r, s) for g in kept for r, s in zip(by_group[g], groups[g]) if s.remove_sample and not before[id(s)]]
        _store_removed(store, run_id, step, marked)
        out["rollout/sample_filter/removed"] = float(len(marked))
    if "rollout_all_samples_process_path" in hooks:
        path = hooks["rollout_all_samples_process_path"]
        fn = load_plugin(path, HOOKS["rollout_all_samples_process_path"])
        _run(fn(args, [groups[g] for g in by_group], NoDataSource()))
    if "custom_rollout_log_function_path" in hooks:
        fn = load_plugin(hooks["custom_rollout_log_function_path"], HOOKS["custom_rollout_log_function_path"])
        samples = [s for group in data for s in group]
        _run(fn(step, args, samples, dict(metrics), rollout_time(rows)))  # its bool: see the module's docstring
    if "custom_reward_post_process_path" in hooks:
        path = hooks["custom_reward_post_process_path"]
        fn = load_plugin(path, HOOKS["custom_reward_post_process_path"])
        trained = [(r, s) for g in kept for r, s in zip(by_group[g], groups[g])]
        raw, processed = post_processed(_run(fn(args, [s for _, s in trained])), len(trained), path)
        _store_post_processed(store, run_id, step, [r for r, _ in trained], raw, processed)
        if processed:
            out["rollout/reward_post_process/mean"] = sum(processed) / len(processed)
    return out


def post_processed(out, n: int, path: str) -> tuple[list[float], list[float]]:
    """The hook's `(raw_rewards, rewards)`, each n finite numbers; anything else is one line naming the hook."""
    where = f"--custom-reward-post-process-path {path}"
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise UserError(f"{where}: returned {type(out).__name__}; expected (raw_rewards, rewards), two lists")
    lists = []
    for name, values in zip(("raw_rewards", "rewards"), out):
        values = values.tolist() if hasattr(values, "tolist") else values
        if not isinstance(values, list | tuple) or len(values) != n:
            got = len(values) if isinstance(values, list | tuple) else type(values).__name__
            raise UserError(f"{where}: {name} has {got} values; expected one per sample given ({n})")
        bad = next((i for i, v in enumerate(values) if not _finite_number(v)), None)
        if bad is not None:
            raise UserError(f"{where}: {name}[{bad}] is {values[bad]!r}; expected a finite number")
        lists.append([float(v) for v in values])
    return lists[0], lists[1]


def _finite_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _store_removed(store, run_id: str, step: int, marked: list[tuple[dict, object]]) -> None:
    """The rows the sample filter marked: remove_sample in their metadata's slime_sample, the loss mask they had
    kept beside it, a zero loss mask."""
    if not marked:
        return
    masks, metas = [], []
    for r, _ in marked:
        meta = json.loads(r.get("metadata") or "{}")
        record = meta.setdefault("slime_sample", {})
        record["remove_sample"] = True
        record.setdefault("loss_mask", list(r["loss_mask"]))
        masks.append([0] * len(r["loss_mask"]))
        metas.append(json.dumps(meta, default=str))
        r["metadata"], r["loss_mask"] = metas[-1], masks[-1]  # what a later hook of this step stores on top
    columns = {"loss_mask": pa.array(masks, pa.list_(pa.int8())), "metadata": pa.array(metas, pa.string())}
    keys = [(r["group_id"], r["sample_index"]) for r, _ in marked]
    update_samples(store, run_id, step, keys, columns, "rollout_sample_filter")


def _store_post_processed(store, run_id: str, step: int, rows: list[dict], raw: list[float], processed: list[float]):
    """Each trained row's metadata.reward_post_process: {"raw": ..., "reward": ...}; the trainer takes "reward"
    (tasks/train/batch.py `post_processed_rewards`). The reward column keeps the reward stage's value."""
    if not rows:
        return
    metas = []
    for r, a, b in zip(rows, raw, processed):
        meta = json.loads(r.get("metadata") or "{}")
        meta["reward_post_process"] = {"raw": a, "reward": b}
        metas.append(json.dumps(meta, default=str))
    keys = [(r["group_id"], r["sample_index"]) for r in rows]
    update_samples(store, run_id, step, keys, {"metadata": pa.array(metas, pa.string())}, "reward_post_process")
