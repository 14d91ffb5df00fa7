"""Prefect artifacts of a run, shown on its flow-run page and (by key) on the UI's Artifacts page.

- ``<key>-progress``: steps done out of the run's total, updated after each rollout and each step;
- ``<key>-metrics``: the per-step metrics table (train and eval rows, read back from the metrics table);
- ``<key>-curves``: reward, KL, response length and loss as sparklines with first/last/min/max;
- ``<key>-storage``: where the run's tables, checkpoints and TensorBoard files live.

``<key>`` is ``sluiceway-<run id>`` in the characters Prefect allows. Nothing here holds credentials: S3
credentials come from the environment and never enter the config; URLs are shown without user info.
Artifacts are a report: a failure to write one is logged and never fails the run.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from sluiceway.flows.config import RunConfig
from sluiceway.flows.report import BARS, COLUMNS

log = logging.getLogger("sluiceway")

CURVES = [
    ("reward_mean", "reward"), ("train/kl", "KL"), ("response_len_mean", "response length"),
    ("train/loss", "loss"), ("train/entropy", "entropy"), ("train/grad_norm", "grad norm"),
]  # fmt: skip
TABLE_EXTRA = [("train/kl", "kl"), ("weight_version", "weight version")]


def artifact_key(run_id: str) -> str:
    """Prefect keys allow lowercase letters, digits and dashes only."""
    return "sluiceway-" + (re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-") or "run")


def strip_userinfo(uri: str) -> str:
    """A URL without any user:password@ part (local paths come back unchanged)."""
    parts = urlsplit(uri)
    if parts.scheme and parts.netloc and "@" in parts.netloc:
        return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
    return uri


def _sparkline(values: list[float]) -> str:
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    return "".join(
        " " if not math.isfinite(v) else BARS[1 + round((v - lo) / (hi - lo) * 7)] if hi > lo else BARS[4]
        for v in values
    )


def _num(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return round(f, 4) if math.isfinite(f) else None


def metrics_rows(frame) -> list[dict]:
    """The per-step table: one row per step with the report's columns, KL, weight version and eval scores."""
    cols = [(c, name) for c, name in COLUMNS + TABLE_EXTRA if c in frame]
    evals = sorted(c for c in frame if c.startswith("eval/") and not c.endswith("/prompts"))
    rows = []
    for step, row in frame.iterrows():
        r: dict = {"step": int(step)}
        r.update({name: _num(row[c]) for c, name in cols})
        r.update({c: _num(row[c]) for c in evals})
        rows.append(r)
    return rows


def curves_markdown(run_id: str, frame) -> str:
    train = frame[frame["reward_mean"].notna()] if "reward_mean" in frame else frame.iloc[0:0]
    lines = [f"### Run `{run_id}`: {len(train)} training steps", ""]
    if not len(train):
        return "\n".join(lines + ["No training steps yet."]) + "\n"
    lines += ["| metric | curve | first | last | min | max |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    series = [(name, [float(v) for v in train[col]]) for col, name in CURVES if col in train]
    evals = sorted(c for c in frame if c.startswith("eval/") and c.endswith("/pass@1"))
    series += [(col, [float(v) for v in frame[col].dropna()]) for col in evals]
    for name, vals in series:
        fin = [v for v in vals if math.isfinite(v)]
        if fin:
            lines.append(
                f"| {name} | `{_sparkline(vals)}` | {vals[0]:.4g} | {vals[-1]:.4g} | {min(fin):.4g} | {max(fin):.4g} |"
            )
    lines += ["", "Curves run over training steps (evaluations over the evaluations done); one bar per step."]
    return "\n".join(lines) + "\n"


def storage_markdown(cfg: RunConfig) -> str:
    from sluiceway.flows.logging_backends import tensorboard_dir

    run_dir = Path(cfg.storage.output_dir).resolve()
    tables = strip_userinfo(cfg.tables_uri)
    lines = [
        f"### Where run `{cfg.run_id}` lives",
        "",
        "| what | where |",
        "| --- | --- |",
        f"| trajectories (Delta) | `{tables.rstrip('/')}/trajectories` |",
        f"| metrics (Delta) | `{tables.rstrip('/')}/metrics` |",
        f"| run directory | `{run_dir}` |",
        f"| checkpoint | `{run_dir / 'checkpoints' / 'latest.pt'}` |",
        f"| TensorBoard | `{tensorboard_dir(cfg)}` |",
    ]
    if cfg.storage.s3_endpoint_url:
        lines.append(f"| S3 endpoint | `{strip_userinfo(cfg.storage.s3_endpoint_url)}` |")
    lines += [
        "",
        "Read them with polars: "
        f"`pl.read_delta('{tables.rstrip('/')}/trajectories').filter(pl.col('run_id') == '{cfg.run_id}')`.",
    ]
    if tables.startswith("s3://"):
        lines.append("S3 credentials come from the `AWS_*` environment variables; they are not stored here.")
    return "\n".join(lines) + "\n"


class RunArtifacts:
    """Create and update a run's artifacts from inside its flow; every call is best-effort."""

    def __init__(self, cfg: RunConfig, total_steps: int):
        self.cfg = cfg
        self.key = artifact_key(cfg.run_id)
        self.total = max(total_steps, 1)
        self._progress_id = None

    def _try(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 -- a report must never fail a training run
            log.warning("could not write the %s artifact: %s", what, e)
            return None

    def start(self, done_steps: int) -> None:
        from prefect.artifacts import create_markdown_artifact, create_progress_artifact

        self._progress_id = self._try(
            "progress",
            create_progress_artifact,
            progress=self._pct(done_steps),
            key=f"{self.key}-progress",
            description=f"Steps of run {self.cfg.run_id} done, out of {self.total}.",
        )
        self._try(
            "storage",
            create_markdown_artifact,
            markdown=storage_markdown(self.cfg),
            key=f"{self.key}-storage",
            description=f"Where the tables of run {self.cfg.run_id} live.",
        )

    def _pct(self, done: float) -> float:
        return round(min(max(done / self.total, 0.0), 1.0) * 100.0, 2)

    def progress(self, done_steps: float) -> None:
        """`done_steps` may be fractional: a step whose rollout is done counts as half."""
        if self._progress_id is None:
            return
        from prefect.artifacts import update_progress_artifact

        self._try("progress", update_progress_artifact, self._progress_id, self._pct(done_steps))

    def finish(self, store) -> None:
        """The metrics table and the curves, read back from the metrics table (resumed steps included)."""
        from prefect.artifacts import create_markdown_artifact, create_table_artifact

        from sluiceway.storage.metrics import metrics_frame

        frame = self._try("metrics", metrics_frame, store, self.cfg.run_id)
        if frame is None or frame.empty:
            return
        self._try(
            "metrics",
            create_table_artifact,
            table=metrics_rows(frame),
            key=f"{self.key}-metrics",
            description=f"Per-step metrics of run {self.cfg.run_id} (train rows by step, eval rows by steps trained).",
        )
        self._try(
            "curves",
            create_markdown_artifact,
            markdown=curves_markdown(self.cfg.run_id, frame),
            key=f"{self.key}-curves",
            description=f"Reward, KL and length curves of run {self.cfg.run_id}.",
        )
