"""`sluiceway report`: a run's metrics as markdown, and one-line errors for a wrong directory."""

import pytest

from sluiceway.flows.report import render, sparkline
from sluiceway.infra.errors import UserError
from sluiceway.storage.metrics import append_metrics
from sluiceway.storage.object_store import ObjectStore


def test_report_renders_steps_and_evals(tmp_path):
    run = tmp_path / "myrun"
    store = ObjectStore.from_uri(str(run / "tables"))
    for step, reward in enumerate([0.2, 0.5, 0.8]):
        append_metrics(store, "myrun", step, {"reward_mean": reward, "train/loss": 0.1 * step}, tag="train")
    append_metrics(store, "myrun", 3, {"eval/arith/pass@1": 0.9, "eval/arith/prompts": 32.0}, tag="eval")
    text = render(run)
    assert "Run `myrun`: 4 steps." in text and "`▁▄█`" in text
    assert "| step | reward | loss | eval/arith/pass@1 |" in text
    assert "| 1 | 0.500 | 0.100 |  |" in text and "| 3 |  |  | 0.900 |" in text


def test_report_on_a_directory_without_a_run(tmp_path):
    with pytest.raises(UserError, match="no metrics table"):
        render(tmp_path)


def test_sparkline_is_flat_for_constant_values():
    assert sparkline([1.0, 1.0]) == "▄▄" and sparkline([0.0, 1.0]) == "▁█"
