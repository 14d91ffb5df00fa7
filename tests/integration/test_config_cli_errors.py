"""One-line errors from the real `sluiceway` command, reported before anything starts."""

import os
import subprocess
import sys
import time

import pytest
from process_tags import new_tag, processes_tagged, tagged_env


def sluiceway(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "sluiceway.flows.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def assert_one_line_error(proc, *needles):
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err


@pytest.fixture
def run_args(tmp_path):
    return [
        "--output-dir",
        str(tmp_path / "run"),
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--global-batch-size",
        "4",
        "--micro-batch-size",
        "4",
        "--num-rollout",
        "1",
    ]


def test_cli_violated_invariant(tmp_path, run_args):
    proc = sluiceway("run", "--prompt-data", "env:arithmetic", *run_args, "--global-batch-size", "8", cwd=tmp_path)
    assert_one_line_error(proc, "global_batch_size")


def test_first_use_mistake_is_one_line(tmp_path):
    """Issue 29: with an empty cache and HOME, the first command builds tiny-llama to read its config.json; the
    build prints nothing (no transformers progress bar), so a mistake it finds is still exactly one line."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("SLUICEWAY_CACHE", "XDG_CACHE_HOME", "MPLCONFIGDIR")}
    proc = subprocess.run(
        [sys.executable, "-m", "sluiceway.flows.cli", "run", "--hf-checkpoint", "tiny-llama", "--prompt-data",
         "env:arithmetic", "--rollout-max-response-len", "100000000"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env | {"HOME": str(home)},
    )  # fmt: skip
    assert proc.returncode == 2
    assert_one_line_error(proc, "--rollout-max-response-len 100000000", "max_position_embeddings")
    assert proc.stdout == ""
    assert any((home / ".cache" / "sluiceway" / "models").glob("tiny-llama-*"))  # it was a first use
    # the same mistake on the now warm cache: the same one line
    warm = subprocess.run(proc.args, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=env | {"HOME": str(home)})  # fmt: skip
    assert warm.returncode == 2 and warm.stderr == proc.stderr


def test_cli_unknown_flag(tmp_path):
    assert_one_line_error(sluiceway("run", "--rollout-batch-sise", "4", cwd=tmp_path), "--rollout-batch-sise")


def sluiceway_watched(*args, cwd) -> tuple[subprocess.CompletedProcess, set[int], float]:
    """Run the CLI under a fresh tag; also return the pids of any process it started (seen by polling /proc
    for the tag while it ran) and its wall time."""
    tag = new_tag()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluiceway.flows.cli", *args],
        cwd=cwd, env=tagged_env(tag), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    started: set[int] = set()
    while proc.poll() is None:
        started |= set(processes_tagged(tag)) - {proc.pid}
        time.sleep(0.01)
    out, err = proc.communicate(timeout=300)
    elapsed = time.perf_counter() - t0
    started |= set(processes_tagged(tag)) - {proc.pid}  # anything still alive after it exited
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), started, elapsed


@pytest.mark.parametrize(
    "mistake",
    [
        "missing data file", "malformed JSONL line", "missing label key", "bad flag", "missing eval file",
        "directory as data file", "reward file with a syntax error", "output dir is a file", "output dir under /proc",
        "response longer than the model", "eval response longer than the model", "KV cache beyond memory",
        "wrong-typed YAML value under a flag", "list for a number in YAML", "unknown YAML group",
    ],
)  # fmt: skip
def test_cli_mistakes_are_reported_before_anything_starts(tmp_path, run_args, mistake):
    """Each mistake: exit 2, one line naming the file/line/flag, and no engine, router or Prefect server was
    ever started for it (no process carrying the run's tag but the command itself)."""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"input": "1+1?", "label": "2"}\n{"input": "2+2?", "label": "4"}\n')
    argv, needles = {
        "missing data file": (["--prompt-data", "nope.jsonl"], ["nope.jsonl", "not found"]),
        "malformed JSONL line": (["--prompt-data", "bad.jsonl"], ["bad.jsonl:2", "malformed JSON"]),
        "missing label key": (["--prompt-data", "nolabel.jsonl"], ["nolabel.jsonl:2", "label"]),
        "bad flag": (["--prompt-data", str(data), "--rollout-batch-sise", "4"], ["--rollout-batch-sise"]),
        "missing eval file": (
            ["--prompt-data", str(data), "--eval-interval", "1", "--eval-prompt-data", "gone.jsonl"],
            ["--eval-prompt-data gone.jsonl", "not found"],
        ),
        "directory as data file": (["--prompt-data", "adir.jsonl"], ["--prompt-data adir.jsonl", "a directory"]),
        "reward file with a syntax error": (
            ["--prompt-data", str(data), "--custom-rm-path", "broken_rm.py:score"],
            ["--custom-rm-path", "broken_rm.py line 2"],
        ),
        "output dir is a file": (
            ["--prompt-data", str(data), "--output-dir", "afile"], ["--output-dir afile", "not a directory"],
        ),
        "output dir under /proc": (
            ["--prompt-data", str(data), "--output-dir", "/proc/sluiceway-run"], ["--output-dir /proc/sluiceway-run"],
        ),
        # tiny-llama has 512 positions; the embedded engine once tried to allocate a 1.6 TB KV cache for this.
        "response longer than the model": (
            ["--prompt-data", str(data), "--rollout-max-response-len", "100000000"],
            ["--rollout-max-response-len 100000000", "512 positions of tiny-llama"],
        ),
        "eval response longer than the model": (
            ["--prompt-data", str(data), "--eval-interval", "1", "--eval-prompt-data", str(data),
             "--eval-max-response-len", "300"],
            ["--eval-max-response-len 300", "556 tokens", "512 positions"],
        ),
        "KV cache beyond memory": (
            ["--prompt-data", str(data), "--engine-max-running-requests", "1000000000"],
            ["--engine-max-running-requests 1000000000", "KV caches", "GiB of memory"],
        ),
        # The flag's valid value does not hide the file's wrong one (the file is read again without the flag).
        "wrong-typed YAML value under a flag": (
            ["typed.yaml", "--prompt-data", str(data)],
            ["typed.yaml: rollout.rollout_batch_size (--rollout-batch-size)", "valid integer"],
        ),
        "list for a number in YAML": (
            ["listed.yaml", "--prompt-data", str(data)], ["listed.yaml: training.micro_batch_size", "got list"],
        ),
        "unknown YAML group": (["grouped.yaml", "--prompt-data", str(data)], ["grouped.yaml: trainig: unknown key"]),
    }[mistake]
    (tmp_path / "adir.jsonl").mkdir()
    (tmp_path / "broken_rm.py").write_text("def score(sample):\n    return (1 +\n")
    (tmp_path / "afile").write_text("not a directory")
    (tmp_path / "bad.jsonl").write_text('{"input": "1+1?", "label": "2"}\n{"input": "2+2?", "label": \n')
    (tmp_path / "typed.yaml").write_text("rollout:\n  rollout_batch_size: abc\n")
    (tmp_path / "listed.yaml").write_text("training:\n  micro_batch_size: [4]\n")
    (tmp_path / "grouped.yaml").write_text("trainig:\n  lr: 1.0e-5\n")
    (tmp_path / "nolabel.jsonl").write_text('{"input": "1+1?", "label": "2"}\n{"input": "2+2?", "answer": "4"}\n')
    if "--output-dir" in argv:  # the mistake's own, not the fixture's
        run_args = run_args[2:]
    proc, started, elapsed = sluiceway_watched("run", *argv, *run_args, cwd=tmp_path)
    print(f"{mistake}: reported in {elapsed:.2f} s")  # the target is under 3 s; not asserted
    assert proc.returncode == 2
    assert_one_line_error(proc, *needles)
    assert started == set(), f"processes started before the mistake was reported: {started}"
    assert not (tmp_path / "run" / "logs").exists()  # no engine or router ever wrote a log
    assert not (tmp_path / "afile" / "logs").exists() and (tmp_path / "afile").is_file()
