"""Issue 30: 3 of 13 runs of an OpenAI Agents SDK agent hung for good at start-up. The agent endpoint's uvicorn
ran logging.config.dictConfig, which shuts the process's handlers down under logging's lock while Prefect's API
log handler, flushing, waits on threads that wait for the same lock. The endpoint now leaves logging alone; here
it starts and stops 50 times inside a real Prefect flow that logs to the API meanwhile, agents written with the
`openai` client and the OpenAI Agents SDK in turn (tests/data/agent_proxy_restarts.py)."""

import os
import subprocess
import sys

from paths import DATA

ROUNDS = 50


def test_agent_endpoint_starts_and_stops_inside_a_flow_without_hanging(tmp_path):
    env = dict(os.environ, SLUICEWAY_CACHE=str(tmp_path / "cache"))
    try:
        proc = subprocess.run([sys.executable, str(DATA / "agent_proxy_restarts.py"), str(tmp_path / "run"),
                               str(ROUNDS)], capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"hung: {(e.stdout or b'')[-2000:]!r} {(e.stderr or b'')[-2000:]!r}") from None
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"done {ROUNDS}" in proc.stdout, proc.stdout[-3000:]
