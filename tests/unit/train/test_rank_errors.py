"""Issue 51 point 3: a failing trainer group names the first failing rank's own error, not torchrun's summary.

Each rank records its first failure (tasks/train/worker.py `record_failure`); the driver reads them all
(tasks/train/remote.py `first_rank_error`). The torchrun group itself: tests/integration/test_trainer_group.py.
"""

import json

from sluiceway.tasks.train.remote import first_rank_error
from sluiceway.tasks.train.worker import record_failure


def fail(rank: int, message: str, monkeypatch, where) -> None:
    monkeypatch.setenv("SLUICEWAY_TRAINER_ERROR_DIR", str(where))
    try:
        raise OSError(message)
    except OSError as exc:
        record_failure(rank, exc)


def test_the_first_failure_is_named_with_the_others_counted(tmp_path, monkeypatch):
    assert first_rank_error(tmp_path) == ""
    fail(1, "no such model: /x/no-such-model\nsecond line", monkeypatch, tmp_path)
    fail(0, "gloo: connection closed by peer", monkeypatch, tmp_path)
    assert first_rank_error(tmp_path) == "rank 1: OSError: no such model: /x/no-such-model (rank 0 failed too)"
    record = json.loads((tmp_path / "rank1.error").read_text())
    assert "Traceback" in record["traceback"] and "second line" in record["traceback"]


def test_a_rank_keeps_its_first_failure(tmp_path, monkeypatch):
    fail(2, "the cause", monkeypatch, tmp_path)
    fail(2, "what followed", monkeypatch, tmp_path)
    assert first_rank_error(tmp_path) == "rank 2: OSError: the cause"


def test_damaged_records_are_skipped(tmp_path, monkeypatch):
    (tmp_path / "rank0.error").write_text("{not json")
    (tmp_path / "rank3.error").write_text(json.dumps([1, 2]))
    assert first_rank_error(tmp_path) == ""
    fail(1, "real", monkeypatch, tmp_path)
    assert first_rank_error(tmp_path) == "rank 1: OSError: real"


def test_no_directory_no_record(tmp_path, monkeypatch):
    monkeypatch.delenv("SLUICEWAY_TRAINER_ERROR_DIR", raising=False)
    record_failure(0, RuntimeError("x"))  # nowhere to write: nothing happens, nothing raises
    assert first_rank_error(tmp_path / "absent") == ""
