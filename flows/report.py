"""`sluiceway report OUTPUT_DIR`: a run's per-step metrics as a markdown table, read from its metrics table,
and its charts as `OUTPUT_DIR/curves.png` (or `--plot PATH`)."""

from __future__ import annotations

import math
from pathlib import Path

from sluiceway.flows.report_evals import eval_samples_section
from sluiceway.infra.errors import UserError
from sluiceway.storage.metrics import metrics_frame
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.tables import table_exists

COLUMNS = [
    ("reward_mean", "reward"), ("response_len_mean", "length"), ("zero_std_group_frac", "zero-std groups"),
    ("train/loss", "loss"), ("train/grad_norm", "grad norm"), ("train/entropy", "entropy"),
    ("train/logprob_mismatch", "train-infer dlogp"), ("time/step_s", "step s"),
]  # fmt: skip
BARS = " ▁▂▃▄▅▆▇█"


def sparkline(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return "".join(BARS[1 + round((v - lo) / (hi - lo) * 7)] if hi > lo else BARS[4] for v in values)


def load_metrics(run_dir: str | Path, run_id: str | None = None, storage_uri: str | None = None):
    """(store, run id, wide metrics frame) of the run in `run_dir`; a UserError when it has no metrics."""
    run_dir = Path(run_dir)
    store = ObjectStore.from_uri(storage_uri or str(run_dir / "tables"))
    if not table_exists(store, "metrics"):
        raise UserError(f"{run_dir}: no metrics table (is this a run's --output-dir?)")
    run_id = run_id or run_dir.resolve().name
    frame = metrics_frame(store, run_id)
    if frame.empty:
        raise UserError(f"{run_dir}: no metrics for run '{run_id}'")
    return store, run_id, frame


def write_curves(
    run_dir: str | Path, run_id: str | None = None, storage_uri: str | None = None, path: str | Path | None = None
) -> Path | None:
    """Draw the run's charts (flows/charts.py) to `path`, default `run_dir/curves.png`; None if nothing to plot."""
    from sluiceway.flows import charts

    _, run_id, frame = load_metrics(run_dir, run_id, storage_uri)
    png = charts.png_bytes(frame, f"run {run_id}")
    if png is None:
        return None
    target = Path(path) if path is not None else Path(run_dir) / charts.CURVES_PNG
    try:
        return charts.write_png(png, target)
    except OSError as e:
        raise UserError(f"{target}: cannot write the charts ({e.strerror or e}); pick another --plot PATH") from None


def render(run_dir: str | Path, run_id: str | None = None, storage_uri: str | None = None) -> str:
    store, run_id, frame = load_metrics(run_dir, run_id, storage_uri)
    lines = [f"Run `{run_id}`: {len(frame)} steps.", ""]
    train = frame[frame["reward_mean"].notna()] if "reward_mean" in frame else frame.iloc[0:0]
    if len(train):
        lines += [f"Batch reward per step: `{sparkline(list(train['reward_mean']))}`", ""]
    cols = [(c, name) for c, name in COLUMNS if c in frame]
    evals = sorted(c for c in frame if c.startswith("eval/") and not c.endswith("/prompts"))
    lines.append("| step | " + " | ".join(name for _, name in cols + [(e, e) for e in evals]) + " |")
    lines.append("| ---: |" + " ---: |" * (len(cols) + len(evals)))
    for step, row in frame.iterrows():
        cells = ["" if math.isnan(row[c]) else f"{row[c]:.3f}" for c, _ in cols + [(e, e) for e in evals]]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Training rows are indexed by the step they trained; eval rows by the number of steps trained.")
    lines += eval_samples_section(store, run_id)
    return "\n".join(lines) + "\n"
