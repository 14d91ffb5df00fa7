"""Charts of a run's metrics (flows/charts.py): the PNG beside the run, in the curves artifact and from `report`."""

from __future__ import annotations

import base64
import io
import json
import math
import re

import numpy as np
import pytest
from PIL import Image

from sluiceway.flows import charts
from sluiceway.flows.artifacts import RunArtifacts, curves_markdown
from sluiceway.flows.cli import main
from sluiceway.flows.config import RunConfig
from sluiceway.flows.report import write_curves
from sluiceway.storage.metrics import append_metrics, metrics_frame
from sluiceway.storage.object_store import ObjectStore


def _log_run(store: ObjectStore, run_id: str, steps: int, start: int = 0, evals: bool = True) -> None:
    """Metrics as the rl flow logs them: train rows by step, eval rows by the number of steps trained."""
    for step in range(start, start + steps):
        append_metrics(
            store,
            run_id,
            step,
            {
                "reward_mean": 0.1 + 0.05 * step,
                "response_len_mean": 20.0 + step,
                "train/kl": 0.001 * step,
                "train/loss": -0.01 * step,
                "train/entropy": 1.0 - 0.02 * step,
                "train/grad_norm": math.nan if step == 1 else 0.5,  # a NaN stays out of the line
                "time/step_s": 2.0,
            },
            tag="train",
        )
        if evals and (step + 1) % 2 == 0:
            m = {"eval/arith/reward_mean": 0.2 * step, "eval/arith/pass@1": 0.1 * step, "eval/arith/prompts": 8.0}
            append_metrics(store, run_id, step + 1, m, tag="eval")


def _decode(png: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(png))
    assert img.format == "PNG"
    img.load()  # decodes every pixel: a truncated or corrupt file raises here
    return img


def _expected_size(n_panels: int) -> tuple[int, int]:
    cols = min(charts.COLS, n_panels)
    rows = math.ceil(n_panels / cols)
    w, h = charts.PANEL_IN[0] * cols, charts.PANEL_IN[1] * rows + 0.3 + 0.2
    return round(w * charts.DPI), round(h * charts.DPI)


def test_chart_of_a_metrics_table_has_one_panel_per_metric_and_eval_set(tmp_path):
    store = ObjectStore.from_uri(str(tmp_path / "tables"))
    _log_run(store, "r", 6)
    frame = metrics_frame(store, "r")
    ps = charts.panels(frame)
    titles = [t for t, _ in ps]
    assert titles == ["reward", "KL", "response length", "loss", "entropy", "grad norm", "eval arith"]
    assert [label for label, _, _ in ps[-1][1]] == ["reward", "pass@1"]
    steps, vals = ps[-1][1][1][1:]
    assert steps == [2, 4, 6] and vals == pytest.approx([0.1, 0.3, 0.5])  # evals by steps trained
    grad_steps = ps[titles.index("grad norm")][1][0][1]
    assert 1 not in grad_steps and len(grad_steps) == 5
    fig = charts.figure(frame, "run r")
    assert sum(ax.get_visible() for ax in fig.axes) == 7
    png = charts.png_bytes(frame, "run r")
    img = _decode(png)
    assert img.size == _expected_size(7)
    assert len(png) < 80_000  # a compact palette PNG: it is embedded in every curves artifact


def test_chart_changes_with_the_data_and_only_with_it(tmp_path):
    store = ObjectStore.from_uri(str(tmp_path / "tables"))
    _log_run(store, "r", 4, evals=False)
    before = charts.png_bytes(metrics_frame(store, "r"), "run r")
    assert charts.png_bytes(metrics_frame(store, "r"), "run r") == before  # nothing time-dependent in the file
    _log_run(store, "r", 1, start=4, evals=False)
    after = charts.png_bytes(metrics_frame(store, "r"), "run r")
    a, b = (np.asarray(_decode(p).convert("RGB"), dtype=np.int16) for p in (before, after))
    assert a.shape == b.shape  # six panels both times
    assert (np.abs(a - b).sum(axis=2) > 0).mean() > 0.005  # the lines moved


def test_nothing_to_plot_gives_no_chart(tmp_path):
    store = ObjectStore.from_uri(str(tmp_path / "tables"))
    append_metrics(store, "r", 0, {"time/step_s": 1.0, "train/loss": math.nan}, tag="train")
    frame = metrics_frame(store, "r")
    assert charts.panels(frame) == [] and charts.png_bytes(frame) is None
    assert "![" not in curves_markdown("r", frame, None)


def test_curves_artifact_embeds_the_png_and_the_run_directory_gets_it(tmp_path, monkeypatch):
    import prefect.artifacts

    from sluiceway.flows import artifacts

    made: dict[str, dict] = {}
    updated: list[tuple[str, str]] = []

    def create(**kw):
        made[kw["key"]] = kw
        return kw["key"] + "-id"

    monkeypatch.setattr(prefect.artifacts, "create_markdown_artifact", create)
    monkeypatch.setattr(prefect.artifacts, "create_table_artifact", create)
    monkeypatch.setattr(artifacts, "_update_artifact", lambda i, data: updated.append((i, data)) or True)
    out = tmp_path / "r"  # the run id is the output directory's name
    cfg = RunConfig.model_validate({"data": {"prompt_data": "env:arithmetic"}, "storage": {"output_dir": str(out)}})
    store = ObjectStore.from_uri(cfg.tables_uri)
    _log_run(store, "r", 3)
    arts = RunArtifacts(cfg, 3)
    arts.step_done(store)  # a step in the run's first minute: nothing drawn yet
    assert made == {} and updated == []
    arts._refreshed -= artifacts.REFRESH_EVERY_S  # a minute later
    arts.step_done(store)  # drawn and created
    md = made["sluiceway-r-curves"]["markdown"]
    found = re.search(r"!\[[^\]]*\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", md)
    assert found, md[:300]
    png = base64.b64decode(found.group(1))
    assert _decode(png).size == _expected_size(7)
    assert (out / charts.CURVES_PNG).read_bytes() == png
    assert "| reward | `" in md  # the sparklines stay, as text
    made.clear()
    arts.step_done(store)  # refreshed a moment ago: skipped
    assert made == {} and updated == []
    _log_run(store, "r", 1, start=3)
    arts.finish(store)  # the end of the run: always, updating the artifacts in place
    assert made == {} and [i for i, _ in updated] == ["sluiceway-r-metrics-id", "sluiceway-r-curves-id"]
    assert [r["step"] for r in json.loads(updated[0][1])][-1] == 4 and "4 training steps" in updated[1][1]
    assert (out / charts.CURVES_PNG).read_bytes() != png


def test_report_writes_the_chart_beside_the_run_or_where_asked(tmp_path, capsys):
    run = tmp_path / "myrun"
    _log_run(ObjectStore.from_uri(str(run / "tables")), "myrun", 3)
    assert write_curves(run) == run / "curves.png"
    _decode((run / "curves.png").read_bytes())
    (run / "curves.png").unlink()
    target = tmp_path / "docs" / "img" / "demo_curves.png"
    assert main(["report", str(run), "--plot", str(target)]) == 0
    captured = capsys.readouterr()
    assert "| step | reward |" in captured.out and "base64" not in captured.out  # the markdown table as before
    assert str(target) in captured.err
    assert _decode(target.read_bytes()).size == _expected_size(7)
    assert not (run / "curves.png").exists()
    assert main(["report", str(run)]) == 0
    assert str(run / "curves.png") in capsys.readouterr().err and (run / "curves.png").exists()


def test_report_plot_to_an_unwritable_place_is_one_line(tmp_path, capsys):
    run = tmp_path / "myrun"
    _log_run(ObjectStore.from_uri(str(run / "tables")), "myrun", 2)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["report", str(run), "--plot", str(blocker / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "cannot write the charts" in err[0]
