"""The run's identity (flows/resume.py): its record in the run directory and beside its tables (issue 30).

A run directory written `runs/a` and `$PWD/runs/a` is one run; another config on a run's tables is refused
whichever directory it comes from (local tables and a real SeaweedFS, the `store` fixture), naming the fields;
the same config from a new directory continues the run; `resume` finds the run where its record is.
"""

import pytest

from sluiceway.flows.config import build_config
from sluiceway.flows.resume import load_run_record, save_run_record
from sluiceway.infra.errors import UserError


def config(output_dir, **training):
    overrides = {("storage", "output_dir"): str(output_dir), ("logging", "run_id"): "shared"}
    overrides |= {("training", k): v for k, v in training.items()}
    return build_config({}, overrides | {("data", "prompt_data"): "env:arithmetic"})


def test_a_relative_and_an_absolute_output_dir_are_one_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_run_record(config(tmp_path / "runs" / "a", seed=1), "run")
    save_run_record(config("runs/a", seed=1), "run")  # was "holds another run (storage.output_dir differ)"
    with pytest.raises(UserError, match=r"holds another run \(training.seed differ\)"):
        save_run_record(config("runs/a", seed=2), "run")


def test_another_config_on_a_runs_tables_is_refused_from_any_directory(tmp_path, store):
    save_run_record(config(tmp_path / "a", seed=1), "run", store)
    with pytest.raises(UserError, match=r"run 'shared' in .*holds another run \(training.seed differ\)"):
        save_run_record(config(tmp_path / "b", seed=2), "run", store)
    assert not (tmp_path / "b" / "sluiceway-run.yaml").exists()  # refused before anything was written
    # The same run continued from a new directory (another machine resuming from the store): allowed.
    save_run_record(config(tmp_path / "c", seed=1), "run", store)


def test_resume_finds_the_run_where_its_record_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_run_record(config("runs/a", seed=1), "run")
    (tmp_path / "runs" / "a").rename(tmp_path / "moved")
    monkeypatch.chdir("/")
    command, cfg = load_run_record(str(tmp_path / "moved"))
    assert command == "run" and cfg.storage.output_dir == str((tmp_path / "moved").resolve())
