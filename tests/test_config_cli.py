"""Config loading, flag overrides, invariants, and one-line errors from the real `sluiceway` command."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from paths import ROOT
from process_tags import new_tag, processes_tagged, tagged_env

from sluiceway.flows.cli import field_flags, make_parser, resolve_config
from sluiceway.infra.errors import UserError

SLIME_FLAGS = (
    "--prompt-data --input-key --label-key --metadata-key --apply-chat-template --rollout-batch-size "
    "--n-samples-per-prompt --global-batch-size --num-steps-per-rollout --num-rollout --rollout-max-response-len "
    "--rollout-temperature --rollout-top-p --advantage-estimator --use-kl-loss --kl-loss-coef --eps-clip --lr "
    "--hf-checkpoint --rm-type --custom-rm-path --save-interval --eval-interval --seed --output-dir --storage-uri"
).split()


def cfg_from(argv):
    return resolve_config(make_parser().parse_args(argv))


def test_every_slime_flag_exists():
    flags = field_flags()
    assert [f for f in SLIME_FLAGS if f not in flags] == []


def test_yaml_then_flags_override(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text(
        yaml.safe_dump(
            {"data": {"prompt_data": "env:arithmetic"}, "rollout": {"num_rollout": 3}, "training": {"lr": 1e-5}}
        )
    )
    cfg = cfg_from(["run", str(f), "--lr", "2e-6", "--apply-chat-template", "--rollout-temperature", "0.9"])
    assert cfg.rollout.num_rollout == 3
    assert cfg.training.lr == 2e-6
    assert cfg.data.apply_chat_template is True
    assert cfg.rollout.rollout_temperature == 0.9
    assert cfg.run_id == Path(cfg.storage.output_dir).resolve().name


def test_batch_invariant_is_checked():
    with pytest.raises(UserError, match=r"rollout_batch_size x n_samples_per_prompt \(3 x 8 = 24\)"):
        cfg_from(["run", "--prompt-data", "env:arithmetic", "--rollout-batch-size", "3"])


def test_unknown_yaml_key_names_the_field(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("rollout:\n  rollout_batch_sise: 4\n")
    with pytest.raises(UserError, match="rollout.rollout_batch_sise"):
        cfg_from(["run", str(f), "--prompt-data", "env:arithmetic"])


def test_bad_yaml_names_the_line(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("rollout:\n  num_rollout: 3\n bad: [\n")
    with pytest.raises(UserError, match=r"run.yaml:\d+: invalid YAML"):
        cfg_from(["run", str(f)])


def test_wrong_type_names_the_flag():
    with pytest.raises(UserError, match=r"--rollout-temperature"):
        cfg_from(["run", "--prompt-data", "env:arithmetic", "--rollout-temperature", "warm"])


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
    ["missing data file", "malformed JSONL line", "missing label key", "bad flag", "missing eval file"],
)
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
            ["gone.jsonl", "not found"],
        ),
    }[mistake]
    (tmp_path / "bad.jsonl").write_text('{"input": "1+1?", "label": "2"}\n{"input": "2+2?", "label": \n')
    (tmp_path / "nolabel.jsonl").write_text('{"input": "1+1?", "label": "2"}\n{"input": "2+2?", "answer": "4"}\n')
    proc, started, elapsed = sluiceway_watched("run", *argv, *run_args, cwd=tmp_path)
    print(f"{mistake}: reported in {elapsed:.2f} s")  # the target is under 3 s; not asserted
    assert proc.returncode == 2
    assert_one_line_error(proc, *needles)
    assert started == set(), f"processes started before the mistake was reported: {started}"
    assert not (tmp_path / "run" / "logs").exists()  # no engine or router ever wrote a log


def test_configuration_reference_is_current():
    from sluiceway.flows.config_docs import render_markdown

    doc = ROOT / "docs" / "configuration.md"
    assert doc.read_text() == render_markdown(), "regenerate: python -m sluiceway.flows.config_docs"


def test_embedded_engines_share_the_cores():
    import os

    from sluiceway.flows.engines import embedded_engine_threads

    cores = len(os.sched_getaffinity(0))
    base = ["run", "--prompt-data", "env:arithmetic"]
    assert embedded_engine_threads(cfg_from(base)) == cores
    assert embedded_engine_threads(cfg_from([*base, "--rollout-num-engines", "2"])) == max(1, cores // 2)
    assert embedded_engine_threads(cfg_from([*base, "--num-threads", "8", "--rollout-num-engines", "2"])) == 4
    assert embedded_engine_threads(cfg_from([*base, "--engine-num-threads", "3"])) == 3
