"""`sluiceway run` on tiny-llama as a subprocess, with the settings the end-to-end tests share."""

import os
import subprocess
import sys

from paths import DATA

BATCH, N = 4, 4  # prompts per step, samples per prompt
# An untrained tiny model never answers arithmetic right: every group would have zero reward spread and
# GRPO no gradient. The share of vowels in the answer varies from sample to sample.
SCORER = str(DATA / "noise_rewards.py") + ":vowel_share"


def run_cli(run_dir, cache, *extra, env=None):
    env = dict(os.environ, SLUICEWAY_CACHE=str(cache), **(env or {}))
    proc = subprocess.run(cli_args(run_dir, *extra), capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def cli_args(run_dir, *extra) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sluiceway.flows.cli",
        "run",
        "--prompt-data",
        "env:arithmetic",
        "--hf-checkpoint",
        "tiny-llama",
        "--output-dir",
        str(run_dir),
        "--rollout-batch-size",
        str(BATCH),
        "--n-samples-per-prompt",
        str(N),
        "--global-batch-size",
        str(BATCH * N),
        "--micro-batch-size",
        "8",
        "--rollout-max-response-len",
        "8",
        "--rollout-temperature",
        "1.0",
        "--lr",
        "1e-3",
        "--save-interval",
        "1",
        "--env-size",
        "32",
        "--seed",
        "3",
        "--custom-rm-path",
        SCORER,
        *extra,
    ]
