"""Issue 40 item 7: a separate-process harness cannot read another session's key.

Before: with the documented harness (`subprocess.run(..., env=agent_env(base_url, api_key))`) one harness read
three other live sessions' keys from /proc/PID/environ, set two of their rewards to 123 (trained) and aborted the
third. Here four sessions share one endpoint; three victims' harnesses make a model call and wait, and the fourth
harness does what that one did. Started by `run_harness` it finds no key but its own and every victim's row is
its own; started as before (`isolate=False`, the control) the same thief finds the keys and the rewards move.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
from agent_helpers import ScriptedEngine, agent_module, run_agent_async

from sluiceway.tasks.rollout.agent.harness import (
    HarnessIsolationError,
    harness_command,
    isolation_available,
    run_harness,
)
from sluiceway.tasks.rollout.agent.server import AgentProxy

pytestmark = pytest.mark.skipif(not isolation_available()[0], reason=f"no namespaces: {isolation_available()[1]}")

VICTIMS = 3

VICTIM_HARNESS = """
import os, pathlib, sys, time, httpx
flags = pathlib.Path(sys.argv[1])
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
r = httpx.post(base + "/chat/completions", headers={"Authorization": f"Bearer {key}"},
               json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]})
r.raise_for_status()
(flags / f"ready-{sys.argv[2]}").touch()
deadline = time.time() + 60
while not (flags / "thief-done").exists() and time.time() < deadline:
    time.sleep(0.05)
"""

THIEF_HARNESS = """
import json, os, pathlib, sys, time, httpx
flags = pathlib.Path(sys.argv[1])
deadline = time.time() + 60
while len(list(flags.glob("ready-*"))) < int(sys.argv[2]) and time.time() < deadline:
    time.sleep(0.05)
mine = os.environ["OPENAI_API_KEY"]
root = os.environ["OPENAI_BASE_URL"].split("/sessions/")[0]
httpx.post(os.environ["OPENAI_BASE_URL"] + "/chat/completions", headers={"Authorization": f"Bearer {mine}"},
           json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]}).raise_for_status()
found, answers, pids = {}, [], []
for entry in pathlib.Path("/proc").iterdir():
    if not entry.name.isdigit():
        continue
    pids.append(int(entry.name))
    try:
        env = dict(kv.split("=", 1) for kv in (entry / "environ").read_bytes().decode().split("\\0") if "=" in kv)
    except OSError:
        continue
    # Only this endpoint's sessions: other processes of the machine (other tests) may hold keys of their own.
    if env.get("OPENAI_API_KEY") not in (None, mine) and env.get("OPENAI_BASE_URL", "").startswith(root):
        found[env["OPENAI_API_KEY"]] = env["OPENAI_BASE_URL"]
for n, (key, base) in enumerate(found.items()):
    session = base.removesuffix("/v1")
    if n < 2:
        r = httpx.post(session + "/reward", json={"reward": 123}, headers={"Authorization": f"Bearer {key}"})
    else:
        r = httpx.post(session + "/abort", json={"reason": "x"}, headers={"Authorization": f"Bearer {key}"})
    answers.append(r.status_code)
(flags / "thief.json").write_text(json.dumps({"found": len(found), "answers": answers, "pids": pids}))
(flags / "thief-done").touch()
"""

AGENTS = """
import sys
from sluiceway.tasks.rollout.agent.harness import run_harness
ISOLATE = {isolate}

def victim(base_url, api_key, prompt):
    name = prompt["prompt_id"].replace("/", "-")
    proc = run_harness([sys.executable, {victim!r}, {flags!r}, name], base_url, api_key, timeout=120,
                       isolate=ISOLATE)
    assert proc.returncode == 0, proc.stderr
    return 0.5

def thief(base_url, api_key, prompt):
    proc = run_harness([sys.executable, {thief!r}, {flags!r}, "{victims}"], base_url, api_key, timeout=120,
                       isolate=ISOLATE)
    assert proc.returncode == 0, proc.stderr
    return 1.0
"""


@pytest.mark.parametrize("isolate", [True, False], ids=["run_harness", "plain-subprocess-control"])
def test_a_harness_reads_no_other_sessions_key(tiny, tmp_path, isolate):
    _, tok = tiny
    flags = tmp_path / "flags"
    flags.mkdir()
    (tmp_path / "victim_harness.py").write_text(VICTIM_HARNESS)
    (tmp_path / "thief_harness.py").write_text(THIEF_HARNESS)
    body = AGENTS.format(isolate=isolate, victim=str(tmp_path / "victim_harness.py"), flags=str(flags),
                         thief=str(tmp_path / "thief_harness.py"), victims=VICTIMS)  # fmt: skip
    victim = agent_module(tmp_path, body, "harness_agents").replace(":agent", ":victim")
    thief = victim.replace(":victim", ":thief")
    engines = [ScriptedEngine(tok, [f"answer {i}"]) for i in range(VICTIMS + 1)]
    endpoint = AgentProxy()  # one endpoint, as a run's samples share one

    async def all_sessions():
        victims = [run_agent_async(tok, victim, engines[i], rid=f"run/0/{i}/0", endpoint=endpoint)
                   for i in range(VICTIMS)]  # fmt: skip
        return await asyncio.gather(*victims, run_agent_async(tok, thief, engines[-1], rid="run/0/9/0",
                                                               endpoint=endpoint))  # fmt: skip

    try:
        *rows, thief_row = asyncio.run(all_sessions())
    finally:
        endpoint.stop()
    seen = json.loads((flags / "thief.json").read_text())
    if isolate:
        assert seen["found"] == 0 and seen["answers"] == []
        assert len(seen["pids"]) <= 3  # its /proc: the init, itself (and a child it may have): no one else's
        assert [(r.reward, r.abort_reason) for r in rows] == [(0.5, None)] * VICTIMS
    else:  # the reproduction: the same thief, started as before, reaches the other sessions
        assert seen["found"] == VICTIMS and seen["answers"] == [200] * VICTIMS
        assert sorted(str(r.reward) for r in rows if r.reward == 123) == ["123.0", "123.0"]
        assert sum(r.abort_reason is not None for r in rows) == 1
    assert thief_row.reward == 1.0 and thief_row.abort_reason is None


def test_the_harness_gets_its_session_and_none_of_the_runs_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3-secret")
    monkeypatch.setenv("OPENAI_ORG_ID", "kept")
    show = "import os, sys; print(sorted(k for k in os.environ if 'SECRET' in k)); print(os.environ['OPENAI_API_KEY'])"
    proc = run_harness([sys.executable, "-c", show], "http://127.0.0.1:9/sessions/s/v1", "sk-session")
    assert proc.returncode == 0 and proc.stdout.splitlines() == ["[]", "sk-session"], proc.stderr


def test_a_harness_ends_with_its_namespace(tmp_path):
    """Past the timeout the whole namespace is killed: a child the harness left in the background goes too; an
    exit status, a signal and a command that does not exist are reported as subprocess reports them."""
    marker = tmp_path / "still-running"
    script = f"import subprocess, time; subprocess.Popen(['sh', '-c', 'sleep 3; touch {marker}']); time.sleep(30)"
    with pytest.raises(subprocess.TimeoutExpired):
        run_harness([sys.executable, "-c", script], "u", "k", timeout=1)
    assert run_harness(["sh", "-c", "exit 3"], "u", "k").returncode == 3
    assert run_harness(["sh", "-c", "kill -TERM $$"], "u", "k").returncode == 128 + 15
    missing = run_harness(["no-such-harness"], "u", "k")
    assert missing.returncode == 127 and "cannot run no-such-harness" in missing.stderr
    time.sleep(3.5)
    assert not marker.exists()


def test_no_isolation_is_one_clear_error(monkeypatch):
    import sluiceway.tasks.rollout.agent.harness as harness

    monkeypatch.setattr(harness, "isolation_available", lambda: (False, "user namespaces are disabled"))
    with pytest.raises(HarnessIsolationError, match=r"user namespaces are disabled.*isolate=False"):
        harness_command(["true"])
