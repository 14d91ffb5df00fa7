"""A fault's output on a full disk (issue 30 item 9): exit 1, not CPython's 120; the traceback whole where there is
room (the run's log, else a file in the temporary directory), never cut; Prefect's warnings in the log only."""

from __future__ import annotations

import errno
import logging
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from sluiceway.flows import run as flows_run
from sluiceway.flows.faults import explain
from sluiceway.flows.run import _NoPrefectFailures, record_failure

FULL = Path("/dev/full")  # every write: ENOSPC
needs_dev_full = pytest.mark.skipif(not FULL.exists(), reason="needs /dev/full (Linux)")


@needs_dev_full
def test_teardown_writes_on_a_full_disk_do_not_change_the_exit_code(tmp_path):
    """quiet_teardown sent sys.stderr to a buffered file on the run's (full) disk: flushing it at exit failed and
    CPython exited 120 instead of 1."""
    (tmp_path / "sluiceway.log").symlink_to(FULL)
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from sluiceway.flows.run import quiet_teardown
        print("error: disk full ...", file=sys.stderr)
        print("a line on stdout, unflushed")
        quiet_teardown(Path({str(tmp_path)!r}))
        print("the teardown says something", file=sys.stderr)
        sys.stdout.write("and more")
        sys.exit(1)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert out.stderr == "error: disk full ...\n" and out.stdout == "a line on stdout, unflushed\nand more"


def _failure() -> BaseException:
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("the stage failed") from e
    except RuntimeError as e:
        return e


@pytest.fixture
def run_log(tmp_path, monkeypatch):
    """The root logger with a run log handler on tmp_path/run/sluiceway.log (as configure_logging makes it); the
    temporary directory under tmp_path."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    root = logging.getLogger()
    made = []

    def make(target: Path | None = None) -> Path:
        path = run_dir / "sluiceway.log"
        if target is not None:
            path.symlink_to(target)
        handler = logging.FileHandler(path)
        handler.run_log = path
        root.addHandler(handler)
        made.append(handler)
        return path

    yield make
    for h in made:
        root.removeHandler(h)
        try:
            h.close()
        except OSError:
            pass


def _whole(text: str) -> bool:
    lines = text.rstrip("\n").splitlines()
    return "Traceback (most recent call last)" in text and lines[-1] == "RuntimeError: the stage failed"


def test_the_traceback_goes_to_the_run_log(run_log):
    path = run_log()
    assert record_failure("disk full at X", _failure()) == path
    assert _whole(path.read_text()) and "the command failed: disk full at X" in path.read_text()


@needs_dev_full
def test_on_a_full_disk_the_traceback_goes_to_the_temporary_directory(run_log, tmp_path):
    run_log(FULL)
    where = record_failure("disk full at X", _failure())
    assert where is not None and where.parent == tmp_path / "tmp" and where.name.startswith("sluiceway-run-")
    assert _whole(where.read_text())


@needs_dev_full
def test_with_no_room_anywhere_the_traceback_is_dropped(run_log, tmp_path, monkeypatch):
    run_log(FULL)
    monkeypatch.setattr(flows_run, "_append_whole", lambda path, text: False)
    assert record_failure("disk full at X", _failure()) is None
    assert list((tmp_path / "tmp").iterdir()) == []  # no empty file left behind


def test_a_traceback_that_does_not_fit_is_not_cut(tmp_path):
    """The disk fills in the middle of the traceback (RLIMIT_FSIZE stands in for it): the log is left as it
    was, and the traceback goes whole to the temporary directory."""
    code = textwrap.dedent(f"""
        import logging, resource, signal, tempfile
        from pathlib import Path
        from sluiceway.flows.run import record_failure
        tempfile.tempdir = {str(tmp_path)!r}
        log = Path({str(tmp_path / "run" / "sluiceway.log")!r})
        log.parent.mkdir()
        log.write_text("x" * 10000 + "\\n")
        handler = logging.FileHandler(log)
        handler.run_log = log
        logging.getLogger().addHandler(handler)
        def deep(n):
            if n == 0:
                raise RuntimeError("the stage failed")
            deep(n - 1)
        try:
            deep(40)
        except RuntimeError as e:
            exc = e
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (10100, 10100))  # 100 bytes more
        print(record_failure("a fault", exc))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    where = Path(out.stdout.strip())
    assert where.parent == tmp_path and 100 < where.stat().st_size < 10100
    assert (tmp_path / "run" / "sluiceway.log").read_text() == "x" * 10000 + "\n"  # as it was, not cut
    text = where.read_text()
    assert "Traceback (most recent call last)" in text and text.rstrip().endswith("RuntimeError: the stage failed")


def _record(name: str, level: int, module: str = "x") -> logging.LogRecord:
    record = logging.LogRecord(name, level, f"/somewhere/{module}.py", 1, "message", (), None)
    return record


@pytest.mark.parametrize(
    "name,level,module,shown",
    [
        ("prefect.results", logging.WARNING, "results", False),  # 'Failed to write result' on a full disk
        ("prefect.flow_runs", logging.ERROR, "flow_engine", False),
        ("prefect.client", logging.INFO, "x", True),
        ("sluiceway", logging.WARNING, "artifacts", False),  # 'could not write the curves artifact'
        ("sluiceway", logging.ERROR, "artifacts", True),
        ("sluiceway", logging.WARNING, "rl", True),
        ("sluiceway.storage", logging.WARNING, "artifacts", True),
    ],
)
def test_the_terminal_filter(name, level, module, shown):
    assert _NoPrefectFailures().filter(_record(name, level, module)) is shown


def test_a_full_disk_in_a_copy_names_the_target():
    err = OSError(errno.ENOSPC, "No space left on device", "/cache/tokenizer.json", None, "/run/weights/tok.json")
    out = explain(err, Path("/run"))
    assert out.exit_code == 1 and out.message.startswith("disk full at /run/weights/tok.json ("), out.message
