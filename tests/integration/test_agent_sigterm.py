"""SIGTERM while a run's agents are mid-session (issue 32).

A real `sluiceway run` on tiny-llama trains an `openai` client agent (written here) for 2 steps of 2 prompts x 2
samples. On the first run the agent makes its chat call, then touches a marker and waits: the sessions are open,
each holding an answered model call and no reward yet. The test sends SIGTERM then, and the run must exit within
30 s with 143, `interrupted` as the last line of stderr and no traceback, and leave no process (every process
carrying the test's tag: engines, router, Prefect's server, the reaper). `sluiceway resume` (the agent no longer
waits) then finishes the run: both steps' rows in the trajectories table, each sample once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_run import cli_args
from process_tags import new_tag, processes_tagged, tagged_env

from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import is_trainable, read_trajectories

STEPS, PROMPTS, SAMPLES = 2, 2, 2
EXIT_WITHIN_S = 30.0
REACH_AGENT_S = 300.0  # from the start to the first session's chat call (the cache is cold, the cores shared)
GONE_WITHIN_S = 10.0  # after the exit: the reaper's SIGTERM, 3 s grace, SIGKILL

AGENT = """
import pathlib, time
import openai

LIVE = pathlib.Path({live!r})  # touched by every session that answered its call and is now waiting
GO = pathlib.Path({go!r})  # present: no waiting (the resume)


def agent(base_url, api_key, prompt):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    text = prompt["prompt"] if isinstance(prompt["prompt"], str) else prompt["prompt"][-1]["content"]
    reply = client.chat.completions.create(model="policy", messages=[{{"role": "user", "content": text}}],
                                           max_tokens=8)
    answer = reply.choices[0].message.content or ""
    deadline = time.monotonic() + 90
    while not GO.exists() and time.monotonic() < deadline:  # mid-session: the call answered, no reward yet
        LIVE.touch()
        time.sleep(0.1)
    # Some spread of rewards within a group (an untrained model never answers right): the share of vowels.
    return sum(c in "aeiou" for c in answer.lower()) / max(len(answer), 1)
"""


def start(args: list[str], cache: Path, tag: str) -> subprocess.Popen:
    env = tagged_env(tag) | {"SLUICEWAY_CACHE": str(cache)}
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_all(proc: subprocess.Popen, tag: str) -> tuple[str, str]:
    proc.kill()
    out, err = proc.communicate()
    for pid in processes_tagged(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return out, err


def py_spy(pid: int) -> str:
    """A dump of every thread of `pid` if py-spy is installed (the report on a hang), else ''."""
    exe = Path(sys.executable).parent / "py-spy"
    if not exe.exists():
        return ""
    try:
        r = subprocess.run([str(exe), "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"py-spy failed: {e}"
    return r.stdout + r.stderr


@pytest.mark.slow  # a cold tiny-llama run, interrupted, then resumed: about 1.5-2 min on 2 shared cores
def test_sigterm_with_agents_mid_session_exits_cleanly_and_resume_finishes(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    live, go = tmp_path / "live", tmp_path / "go"
    agent_file = tmp_path / "sleepy_agent.py"
    agent_file.write_text(AGENT.format(live=str(live), go=str(go)))
    args = cli_args(run_dir, "--num-rollout", str(STEPS), "--agent-function-path", f"{agent_file}:agent",
                    "--rollout-max-response-len", "64", "--rollout-max-prompt-len", "256",
                    "--rollout-batch-size", str(PROMPTS), "--n-samples-per-prompt", str(SAMPLES),
                    "--global-batch-size", str(PROMPTS * SAMPLES), "--micro-batch-size", "4")  # fmt: skip

    tag = new_tag()
    t_start = time.monotonic()
    proc = start(args, cache, tag)
    while not live.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended (exit {proc.returncode}) before any session waited:\n{out}\n{err[-4000:]}")
        if time.monotonic() - t_start > REACH_AGENT_S:
            out, err = kill_all(proc, tag)
            pytest.fail(f"no session reached the agent's wait in {REACH_AGENT_S:.0f}s:\n{err[-4000:]}")
        time.sleep(0.05)
    time.sleep(1.0)  # the step's other sessions open too
    assert proc.poll() is None
    reached = time.monotonic() - t_start
    assert not (run_dir / "checkpoints" / "latest").exists(), "step 0 checkpointed while its agents were waiting"

    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        left = processes_tagged(tag)
        dump = py_spy(proc.pid)
        out, err = kill_all(proc, tag)
        pytest.fail(f"still running {EXIT_WITHIN_S:.0f}s after SIGTERM (tagged processes {left});\n"
                    f"py-spy:\n{dump}\nstderr:\n{err[-4000:]}")  # fmt: skip
    exited = time.monotonic() - sent
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode == 143, f"exit {proc.returncode}:\n{err[-4000:]}"
    assert lines and lines[-1] == "interrupted", f"the last stderr line is not `interrupted`:\n{err[-4000:]}"
    assert "Traceback" not in err and not any(ln.startswith("error") for ln in lines), err[-4000:]
    assert exited < EXIT_WITHIN_S
    while (left := processes_tagged(tag)) and time.monotonic() - sent < exited + GONE_WITHIN_S:
        time.sleep(0.05)
    assert not left, f"processes of the run alive {GONE_WITHIN_S:.0f}s after its exit: {left}"
    gone = time.monotonic() - sent

    # The resume: the agent no longer waits.
    go.touch()
    tag = new_tag()
    resumed_at = time.monotonic()
    proc = start([*args[:3], "resume", str(run_dir)], cache, tag)
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        dump = py_spy(proc.pid)
        out, err = kill_all(proc, tag)
        pytest.fail(f"the resume did not end in 600s;\npy-spy:\n{dump}\nstderr:\n{err[-4000:]}")
    assert proc.returncode == 0, f"resume failed (exit {proc.returncode}):\n{out}\n{err[-4000:]}"
    resumed = time.monotonic() - resumed_at
    table = read_trajectories(ObjectStore.from_uri(str(run_dir / "tables")), run_dir.name)
    rows = table.to_pylist()
    keys = [(r["step"], r["group_id"], r["sample_index"]) for r in rows]
    assert len(keys) == len(set(keys)), f"a sample stored twice: {sorted(keys)}"
    for step in range(STEPS):
        mine = [r for r in rows if r["step"] == step]
        assert len(mine) == PROMPTS * SAMPLES, [(r["step"], r["status"]) for r in rows]
        assert all(is_trainable(r) and r["reward"] is not None for r in mine), [
            (r["status"], r["filter_reason"], r["metadata"]) for r in mine
        ]
    for _ in range(50):
        if not processes_tagged(tag):
            break
        time.sleep(0.1)
    assert not processes_tagged(tag), "the resume left processes"
    print(f"agents waiting at {reached:.1f}s; exit 143 {exited:.2f}s after SIGTERM, no process left at "
          f"{gone:.2f}s; resume {resumed:.1f}s")  # fmt: skip
