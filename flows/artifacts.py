"""Prefect artifacts of a run, shown on its flow-run page and (by key) on the UI's Artifacts page.

- ``<key>-progress``: steps done out of the run's total, updated after each rollout and each step;
- ``<key>-metrics``: the per-step metrics table (train and eval rows, read back from the metrics table);
- ``<key>-curves``: the run's charts (reward, KL, response length, loss, entropy, grad norm, evals) as a PNG
  embedded in the markdown (a ``data:image/png;base64`` URI, which both Prefect UIs render), and the same
  curves as sparklines with first/last/min/max; the PNG is also written to ``OUTPUT_DIR/curves.png``;
- ``<key>-storage``: where the run's tables, checkpoints and TensorBoard files live.

``<key>`` is ``sluiceway-<run id>`` in the characters Prefect allows. Nothing here holds credentials: S3
credentials come from the environment and never enter the config; URLs are shown without user info.
Artifacts are a report: a failure to write one is logged and never fails the run. The metrics table and the
curves are drawn after the first step that ends ``REFRESH_EVERY_S`` seconds into the run, then after a step at
most every ``REFRESH_EVERY_S`` seconds, and always at the end of the run: reading the metrics table and drawing
the charts cost about half a second of CPU each time, and a chart of one step shows nothing a run shorter than a
minute would not show at its end (the progress artifact moves after every step).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from sluiceway.flows.charts import CURVES_PNG
from sluiceway.flows.config import RunConfig
from sluiceway.flows.report import BARS, COLUMNS

log = logging.getLogger("sluiceway")

CURVES = [
    ("reward_mean", "reward"), ("train/kl", "KL"), ("response_len_mean", "response length"),
    ("train/loss", "loss"), ("train/entropy", "entropy"), ("train/grad_norm", "grad norm"),
]  # fmt: skip
TABLE_EXTRA = [("train/kl", "kl"), ("weight_version", "weight version")]
REFRESH_EVERY_S = 60.0


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


def curves_markdown(run_id: str, frame, png: bytes | None = None) -> str:
    """Sparklines of the curves, under the charts when `png` (from :func:`charts.png_bytes`) is given."""
    train = frame[frame["reward_mean"].notna()] if "reward_mean" in frame else frame.iloc[0:0]
    lines = [f"### Run `{run_id}`: {len(train)} training steps", ""]
    if png:
        from sluiceway.flows.charts import data_uri

        lines += [f"![curves of run {run_id}]({data_uri(png)})", ""]
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
        f"| charts (PNG) | `{run_dir / CURVES_PNG}` |",
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
        self._metrics_id = None
        self._curves_id = None
        self._refreshed = time.monotonic()  # of the last refresh of the metrics and curves (none yet: the start)

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

    def step_done(self, store) -> None:
        """After a step: refresh the metrics table and the curves unless they (or the run) started recently."""
        if time.monotonic() - self._refreshed >= REFRESH_EVERY_S:
            self.finish(store)

    def finish(self, store) -> None:
        """The metrics table and the curves, read back from the metrics table (resumed steps included).

        The first call creates the two artifacts; later calls update them in place (as the progress artifact
        is), so the flow run shows one of each however often they were refreshed.
        """
        from prefect.artifacts import create_markdown_artifact, create_table_artifact

        from sluiceway.flows import charts
        from sluiceway.storage.metrics import metrics_frame

        self._refreshed = time.monotonic()
        frame = self._try("metrics", metrics_frame, store, self.cfg.run_id)
        if frame is None or frame.empty:
            return
        png = self._try("curves", charts.png_bytes, frame, f"run {self.cfg.run_id}")
        if png:
            self._try("curves", charts.write_png, png, Path(self.cfg.storage.output_dir) / CURVES_PNG)
        rows = metrics_rows(frame)
        desc = f"Per-step metrics of run {self.cfg.run_id} (train rows by step, eval rows by steps trained)."
        if self._metrics_id is None or not self._try("metrics", _update_artifact, self._metrics_id, json.dumps(rows)):
            self._metrics_id = self._try(
                "metrics",
                create_table_artifact,
                table=rows,
                key=f"{self.key}-metrics",
                description=desc,
            )
        md = curves_markdown(self.cfg.run_id, frame, png)
        if self._curves_id is None or not self._try("curves", _update_artifact, self._curves_id, md):
            self._curves_id = self._try(
                "curves",
                create_markdown_artifact,
                markdown=md,
                key=f"{self.key}-curves",
                description=f"Charts and curves of run {self.cfg.run_id}: reward, KL, length, loss, evaluations.",
            )


def _update_artifact(artifact_id, data: str) -> bool:
    """Replace an artifact's data (a table artifact's data is its rows as JSON, a markdown one's the text)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactUpdate

    get_client(sync_client=True).update_artifact(artifact_id=artifact_id, artifact=ArtifactUpdate(data=data))
    return True
