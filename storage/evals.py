"""The evals table: one row per evaluation sample, so what a model answered can be read after the fact.

Written by `sluiceway eval` and by a run's periodic evaluation (tasks/evaluate/evaluate.py). Partitioned like
the trajectories table, by ``run_id`` and ``step`` (a run's evaluation: the number of steps trained; `sluiceway
eval`: the weights' version). Each row carries the sampling settings it was drawn with, so greedy and sampled
evaluations of the same weights stay apart.

A write is idempotent per *evaluation*: the same run, step, set, sampling settings, prompts and seeds. A retried
eval adds nothing; an evaluation with other settings at the same step is a new one and is added.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.tables import append_idempotent, conform, read_table, table_exists

EVALS = "evals"
PARTITION_BY = ["run_id", "step"]
SORT_KEYS = [
    ("step", "ascending"), ("eval_set", "ascending"), ("temperature", "ascending"), ("top_p", "ascending"),
    ("max_new_tokens", "ascending"), ("prompt_index", "ascending"), ("sample_index", "ascending"),
]  # fmt: skip
# What makes one evaluation differ from another at the same step, besides its prompts and seeds.
SETTINGS = ("eval_set", "temperature", "top_p", "max_new_tokens")

EVAL_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),  # steps trained (a run), or the weights' version (eval)
        pa.field("eval_set", pa.string(), nullable=False),  # the NAME of --eval-prompt-data
        pa.field("prompt_index", pa.int64(), nullable=False),  # position of the prompt in the set
        pa.field("sample_index", pa.int64(), nullable=False),  # sample of that prompt, from 0
        pa.field("prompt_id", pa.string(), nullable=False),  # dataset row the prompt came from
        pa.field("prompt", pa.string(), nullable=False),  # rendered prompt text (after the chat template)
        pa.field("label", pa.string()),
        pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_text", pa.string(), nullable=False),
        pa.field("reward", pa.float64(), nullable=False),  # a scorer failure is 0, with the reason in details
        pa.field("reward_details", pa.string()),  # JSON from the scorer
        pa.field("finish_reason", pa.string(), nullable=False),  # stop, length, abort
        pa.field("weight_version", pa.int64(), nullable=False),  # weights the engine generated with
        pa.field("temperature", pa.float64(), nullable=False),  # 0: greedy
        pa.field("top_p", pa.float64(), nullable=False),
        pa.field("max_new_tokens", pa.int64(), nullable=False),
        pa.field("sampling_seed", pa.int64(), nullable=False),  # the request's seed (irrelevant when greedy)
        pa.field("latency_s", pa.float64(), nullable=False),  # the generate call's wall time
        pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("metadata", pa.string(), nullable=False),  # JSON object from the dataset row
    ]
)

_ROW_DEFAULTS: dict[str, Any] = {"label": None, "reward_details": None, "metadata": "{}", "latency_s": 0.0}


def append_eval_samples(store: ObjectStore, rows: list[dict[str, Any]]) -> bool:
    """Append one evaluation's samples (one run, step and set); False when that evaluation was written already.

    Row dicts may omit ``label``, ``reward_details``, ``metadata``, ``latency_s`` and ``created_at``;
    ``reward_details`` and ``metadata`` may be dicts (stored as JSON).
    """
    if not rows:
        raise ValueError("append_eval_samples: no rows")
    table = _rows_to_table(rows)
    bad = pc.invert(pc.is_finite(table.column("reward")))  # the column is not nullable: conform checked that
    if pc.any(bad).as_py():
        i = pc.index(bad, True).as_py()
        raise ValueError(
            f"eval sample {i}: reward {table.column('reward')[i].as_py()!r} is not a finite number "
            f"(a failed score is reward 0 with its reason in reward_details)"
        )
    one = {k: set(table.column(k).to_pylist()) for k in ("run_id", "step", *SETTINGS)}
    mixed = [k for k, v in one.items() if len(v) > 1]
    if mixed:
        raise ValueError(f"append_eval_samples: one evaluation per call; rows differ in {mixed}")
    keys = list(zip(*(table.column(k).to_pylist() for k in ("prompt_index", "sample_index")), strict=True))
    if len(set(keys)) != len(keys):
        raise ValueError("append_eval_samples: a (prompt_index, sample_index) appears twice")
    return append_idempotent(store, EVALS, table, app_id=_app_id(table, one), partition_by=PARTITION_BY)


def read_evals(store: ObjectStore, run_id: str, step: int | None = None) -> pa.Table:
    """Evaluation samples of ``run_id`` (one step, or all), sorted by step, set, settings, prompt, sample."""
    if not table_exists(store, EVALS):
        return EVAL_SCHEMA.empty_table()
    filters: list[tuple[str, str, Any]] = [("run_id", "=", run_id)]
    if step is not None:
        filters.append(("step", "=", int(step)))
    table = read_table(store, EVALS, filters=filters)
    return table.select(EVAL_SCHEMA.names).cast(EVAL_SCHEMA).sort_by(SORT_KEYS)


def _app_id(table: pa.Table, one: dict[str, set]) -> str:
    # The prompts and seeds go in as a digest: same settings over other prompts (--eval-size) or another
    # --seed is another evaluation, whose rows must not be taken for a retry of this one.
    ident = sorted(
        zip(
            *(table.column(k).to_pylist() for k in ("prompt_index", "sample_index", "prompt_id", "sampling_seed")),
            strict=True,
        )
    )
    digest = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]
    head = ":".join(str(next(iter(one[k]))) for k in ("run_id", "step", *SETTINGS))
    return f"evals:{head}:{digest}"


def _rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    now = _dt.datetime.now(_dt.UTC)
    full = []
    for i, row in enumerate(rows):
        r = {**_ROW_DEFAULTS, "created_at": now, **row}
        missing = [n for n in EVAL_SCHEMA.names if n not in r]
        if missing:
            raise ValueError(f"eval sample {i}: missing fields {missing}")
        for name in ("reward_details", "metadata"):
            if r[name] is not None and not isinstance(r[name], str):
                r[name] = json.dumps(r[name], sort_keys=True, default=str)
        full.append(r)
    names = set(EVAL_SCHEMA.names)
    unknown = sorted({k for r in full for k in r} - names)
    if unknown:
        raise ValueError(f"eval samples: unknown fields {unknown}")
    table = pa.Table.from_pylist(full)
    return conform(table, EVAL_SCHEMA, what="eval sample")
