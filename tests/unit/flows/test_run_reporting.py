"""Per-run reporting besides the metrics table: TensorBoard event files, wandb (lazily) and Prefect artifacts."""

from __future__ import annotations

import math
import sys
import types

import pandas as pd
import pytest

from sluiceway.flows.artifacts import (
    RunArtifacts,
    artifact_key,
    curves_markdown,
    metrics_rows,
    storage_markdown,
    strip_userinfo,
)
from sluiceway.flows.config import RunConfig
from sluiceway.flows.logging_backends import MetricLoggers, read_scalars, tensorboard_dir
from sluiceway.infra.errors import UserError


def _cfg(tmp_path, **logging) -> RunConfig:
    storage = {"output_dir": str(tmp_path / "run")}
    return RunConfig.model_validate({"data": {"prompt_data": "env:arithmetic"}, "storage": storage, "logging": logging})


def test_tensorboard_event_files_hold_the_scalars(tmp_path):
    cfg = _cfg(tmp_path)
    loggers = MetricLoggers.open(cfg)
    loggers.log(0, {"reward_mean": 0.25, "train/loss": float("nan"), "train/kl": 0.5})
    loggers.log(1, {"reward_mean": 0.75, "train/loss": -0.1, "train/kl": 0.25})
    loggers.close()
    assert tensorboard_dir(cfg) == tmp_path / "run" / "tensorboard"
    scalars = read_scalars(tmp_path / "run" / "tensorboard")
    assert scalars["reward_mean"] == [(0, 0.25), (1, 0.75)]
    assert [s for s, _ in scalars["train/loss"]] == [1]  # a NaN is not plotted
    assert scalars["train/kl"] == [(0, 0.5), (1, 0.25)]


def test_wandb_is_used_only_when_asked_and_gets_no_key(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, metrics, step):
            calls.append(("log", step, dict(metrics)))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_API_KEY", "key-from-env-only")
    loggers = MetricLoggers.open(_cfg(tmp_path))
    assert len(loggers.backends) == 1 and not calls  # not asked: wandb untouched
    loggers.close()

    cfg = _cfg(tmp_path, use_wandb=True, wandb_project="proj", wandb_group="g", wandb_mode="offline")
    loggers = MetricLoggers.open(cfg)
    loggers.log(3, {"reward_mean": 0.5, "x": float("inf")})
    loggers.close()
    init = calls[0][1]
    assert (init["project"], init["group"], init["mode"], init["name"]) == ("proj", "g", "offline", "run")
    assert "key-from-env-only" not in repr(init)
    assert calls[1:] == [("log", 3, {"reward_mean": 0.5}), ("finish",)]


def test_wandb_asked_but_missing_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(UserError, match="--use-wandb: the wandb package is not installed"):
        MetricLoggers.open(_cfg(tmp_path, use_wandb=True))


def test_artifact_keys_and_storage_hold_no_credentials(tmp_path):
    assert artifact_key("My Run_1.v2") == "sluiceway-my-run-1-v2"
    assert strip_userinfo("http://user:pw@s3.local:9000/x") == "http://s3.local:9000/x"
    assert strip_userinfo("/data/tables") == "/data/tables"
    cfg = RunConfig.model_validate(
        {
            "data": {"prompt_data": "env:arithmetic"},
            "storage": {"storage_uri": "s3://bucket/runs", "s3_endpoint_url": "http://ak:sk@127.0.0.1:8333",
                        "output_dir": str(tmp_path / "r")},
        }
    )  # fmt: skip
    md = storage_markdown(cfg)
    assert "s3://bucket/runs/trajectories" in md and "http://127.0.0.1:8333" in md
    assert "ak:sk" not in md and "sk@" not in md


def test_metrics_table_and_curves_from_the_metrics_frame():
    frame = pd.DataFrame(
        {
            "reward_mean": [0.1, 0.5, math.nan],
            "response_len_mean": [4.0, 5.0, math.nan],
            "train/kl": [0.0, 0.02, math.nan],
            "train/loss": [math.nan, -0.1, math.nan],
            "eval/arith/pass@1": [0.25, math.nan, 0.5],
        },
        index=pd.Index([0, 1, 2], name="step"),
    )
    rows = metrics_rows(frame)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["reward"] == 0.1 and rows[0]["loss"] is None and rows[2]["eval/arith/pass@1"] == 0.5
    md = curves_markdown("r", frame)
    assert "2 training steps" in md
    assert "| reward | `▁█` | 0.1 | 0.5 | 0.1 | 0.5 |" in md
    assert "| KL |" in md and "| response length |" in md and "| eval/arith/pass@1 |" in md


def test_artifacts_never_fail_a_run(tmp_path, caplog):
    arts = RunArtifacts(_cfg(tmp_path), 2)
    arts.progress(1)  # no progress artifact yet: nothing to update
    arts.finish(store=None)  # the metrics cannot be read: a warning, not an exception
    assert "could not write the metrics artifact" in caplog.text
