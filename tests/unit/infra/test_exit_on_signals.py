"""infra/proc.py `exit_on_signals`: the first SIGINT or SIGTERM ends the process in order, wherever its main thread
is (an import, a C call, Prefect's own SIGTERM handler), stopping every process it started; a few seconds each."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from process_tags import processes_tagged

# A stand-in for the `sluiceway` command: handlers first, then children (one in its own session that ignores
# SIGTERM, with a child of its own; one in the process group), then the main thread goes where WHERE says.
SCRIPT = """
import os, signal, subprocess, sys, time
from sluiceway.infra.proc import exit_on_signals, hold_if_stopping, note_run_log
exit_on_signals(["run"])
note_run_log(sys.argv[2])
stubborn = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \\
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)"
subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
where = sys.argv[1]
sys.path.insert(0, sys.argv[3])
print("ready", flush=True)
code = 0
try:  # as flows/cli/main.py `entry`
    if where == "import":
        import slow_module  # sleeps in its body: a signal arrives mid-import
    elif where == "c-call":
        r, w = os.pipe()
        os.read(r, 1)  # blocks in C
    elif where == "prefect-sigterm":  # Prefect's flow engine swaps SIGTERM's handler for one that raises
        class TerminationSignal(Exception):
            pass
        def raising(signum, frame):
            raise TerminationSignal(signum)
        signal.signal(signal.SIGTERM, raising)
        try:
            time.sleep(300)
        except TerminationSignal:
            hold_if_stopping()  # as flows/cli/main.py `main` before it prints a failure
            print("error: the flow failed", file=sys.stderr, flush=True)  # the failure path: must not show
            code = 1
    elif where == "sleep":
        time.sleep(300)
finally:
    hold_if_stopping()
print("the main thread went on", file=sys.stderr, flush=True)
sys.exit(code)
"""


def _start(tmp_path: Path, where: str, tag: str) -> subprocess.Popen:
    (tmp_path / "slow_module.py").write_text("import time\ntime.sleep(300)\n")
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, SLUICEWAY_TEST_TAG=tag)
    proc = subprocess.Popen([sys.executable, str(script), where, str(tmp_path / "run.log"), str(tmp_path)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline() == "ready\n"
    deadline = time.monotonic() + 30
    while len(processes_tagged(tag)) < 4:  # the script, its two children, the stubborn one's child
        assert time.monotonic() < deadline, processes_tagged(tag)
        time.sleep(0.05)
    time.sleep(0.3)  # into the import or the call
    return proc


@pytest.mark.parametrize(
    "where,sig",
    [
        ("import", signal.SIGINT),
        ("c-call", signal.SIGTERM),
        ("prefect-sigterm", signal.SIGTERM),
        ("sleep", signal.SIGINT),
    ],
)
def test_the_first_signal_ends_the_process_and_its_children(tmp_path, where, sig):
    tag = uuid.uuid4().hex
    proc = _start(tmp_path, where, tag)
    sent = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 128 + sig, err
    assert err.splitlines() == ["interrupted"], err  # no KeyboardInterrupt, no traceback, nothing after it
    while processes_tagged(tag) and time.monotonic() - sent < 10:
        time.sleep(0.05)
    assert not processes_tagged(tag)  # the stubborn one was SIGKILLed, its child with it
    assert time.monotonic() - sent < 10
    log = (tmp_path / "run.log").read_text()
    name = signal.Signals(sig).name
    assert f"interrupted by {name}: exit {128 + sig}; process " in log and "stops the run's processes" in log


def test_commands_other_than_a_run_keep_keyboard_interrupt():
    code = ("import signal; from sluiceway.infra.proc import exit_on_signals; exit_on_signals(['server']); "
            "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler; "
            "assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_forked_child_is_not_the_run(tmp_path):
    """multiprocessing's fork: the child gets Python's defaults back, and its SIGTERM does not end the parent."""
    code = """
import os, signal, sys, time
from sluiceway.infra.proc import exit_on_signals
exit_on_signals(["run"])
pid = os.fork()
if pid == 0:
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    time.sleep(60)
    os._exit(0)
time.sleep(0.5)
os.kill(pid, signal.SIGTERM)
_, status = os.waitpid(pid, 0)
assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
time.sleep(0.5)
print("parent alive")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout == "parent alive\n", out.stderr


END = """
import atexit, sys, time
from sluiceway.infra.proc import exit_on_signals, set_exit_code
exit_on_signals(["run"])
atexit.register(lambda: time.sleep(float(sys.argv[1])))  # runs before exit_on_signals' own: Prefect's server stop
print("done: the run's output", flush=sys.argv[2] == "flush")
sys.stdout.write("buffered, unflushed")
set_exit_code(3)
sys.exit(3)
"""


def test_a_signal_during_the_exit_of_a_finished_run_is_still_interrupted():
    """The handlers stay until the process ends: before, the interpreter's teardown reset them and a SIGTERM in
    its last moments killed the process (exit -15)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", END, "2", "flush"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "done: the run's output\n"
    time.sleep(0.5)  # in the atexit callbacks
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 143 and err == "interrupted\n", (proc.returncode, err)


def test_the_command_exits_with_its_code_even_where_stdout_cannot_be_flushed():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered, as by default
    proc = subprocess.Popen(
        [sys.executable, "-c", END, "0", "no"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    proc.stdout.close()  # the reader is gone: flushing stdout at exit fails (EPIPE), as on a full disk (ENOSPC)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err  # 120 is CPython's code for a failed flush at exit
