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


def _cut(path, before: str) -> None:
    text = path.read_text()
    path.write_text(text[: text.index(before)])


def test_a_record_cut_short_is_named_damaged_and_resume_starts_nothing(tmp_path, monkeypatch):
    """Issue 40: a record cut before `training.lr` resumed a new run from step 0 in ./runs/default with defaults for
    the lost fields. Cut anywhere, edited, emptied or binary, it is now one line naming the file as damaged."""
    monkeypatch.chdir(tmp_path)
    path = save_run_record(config(tmp_path / "a", seed=1), "run")
    text = path.read_bytes()
    assert path.read_text().rstrip().splitlines()[-1].startswith("digest: sha256:")  # written last
    for damage in (lambda: _cut(path, "  lr:"), lambda: path.write_text(path.read_text()[:-20]),
                   lambda: path.write_text(""), lambda: path.write_bytes(b"\x00\xff\x13garbage"),
                   lambda: path.write_text(path.read_text().replace("seed: 1", "seed: 2"))):  # fmt: skip
        path.write_bytes(text)
        damage()
        with pytest.raises(UserError, match=rf"resume: {path} is damaged \(.*\); nothing was started") as e:
            load_run_record(str(tmp_path / "a"))
        assert "\n" not in str(e.value)
        with pytest.raises(UserError, match=r"its run record .* is damaged \("):  # and a new run is not mixed in
            save_run_record(config(tmp_path / "a", seed=1), "run")
    path.write_bytes(text)
    command, cfg = load_run_record(str(tmp_path / "a"))  # whole again: resumed as it was
    assert command == "run" and cfg.training.seed == 1


def test_a_record_may_be_moved_or_extended_by_hand(tmp_path):
    """Where the run is and how many steps it has are not what it is: a record whose output_dir or num_rollout was
    edited (a copy elsewhere, a run extended) is still whole."""
    import yaml

    path = save_run_record(config(tmp_path / "a", seed=1), "run")
    data = yaml.safe_load(path.read_text())
    data["config"]["rollout"]["num_rollout"] += 5
    data["config"]["storage"]["output_dir"] = "/elsewhere"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    command, cfg = load_run_record(str(tmp_path / "a"))
    assert cfg.rollout.num_rollout == data["config"]["rollout"]["num_rollout"]
    assert cfg.storage.output_dir == str((tmp_path / "a").resolve())


def test_a_record_from_before_digests_is_taken_when_whole(tmp_path):
    import yaml

    path = save_run_record(config(tmp_path / "a", seed=1), "run")
    data = yaml.safe_load(path.read_text())
    del data["digest"]
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert load_run_record(str(tmp_path / "a"))[1].training.seed == 1
    del data["config"]["logging"]["run_id"]  # cut inside its last part
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(UserError, match=r"is damaged \(cut short: no logging.run_id\)"):
        load_run_record(str(tmp_path / "a"))


def test_a_damaged_record_beside_the_tables_is_named(tmp_path, store):
    save_run_record(config(tmp_path / "a", seed=1), "run", store)
    fs = store.filesystem()
    where = store.join("_runs", "shared.yaml").removeprefix("s3://")
    with store.redacting():
        fs.pipe_file(where, b"command: run\nconfig:\n  resources: {}\n")
    with pytest.raises(UserError, match=r"run 'shared' in .*: its run record .*shared.yaml is damaged \(cut short"):
        save_run_record(config(tmp_path / "b", seed=1), "run", store)
