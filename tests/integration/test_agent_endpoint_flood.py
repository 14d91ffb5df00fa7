"""Issue 40 points 1 and 8 through a real run: a flood of idle connections to the agent endpoint (from another
process, more than the endpoint's cap) and a 300 MB chunked body, sent mid-rollout by one sample's agent, leave a
run that finishes: every sample trained, the flooding agent's own session included, no traceback, no "Too many
open files". (21,000 idle connections had taken a run to its file-handle limit for good; a chunked 300 MB body
was read whole.) The endpoint's side of it, in detail: tests/unit/rollout/test_agent_endpoint_faults.py."""

import math

import pytest
from cli_run import run_cli

from sluiceway.storage.metrics import read_metrics
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import is_trainable, read_trajectories

pytestmark = pytest.mark.shared_prefect  # its runs use the worker's Prefect server: tests/integration/conftest.py

FLOODER = r"""
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
held = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
print("ready", flush=True)
sys.stdin.read()  # held until the agent closes our stdin
"""

AGENT = r"""
import socket, subprocess, sys, threading
import openai
from sluiceway.tasks.rollout.agent.server import default_max_connections

_first = threading.Lock()
FLOODER = {flooder!r}


def chat(base_url, api_key, prompt):
    with openai.OpenAI(base_url=base_url, api_key=api_key) as client:
        r = client.chat.completions.create(model="policy", max_tokens=8,
                                           messages=[{{"role": "user", "content": prompt["prompt"]}}])
    return len(r.choices[0].message.content or "") % 5 / 4


def chunked_300_mb(base_url, api_key) -> bytes:
    hostport, rest = base_url.split("//")[1].split("/", 1)
    s = socket.create_connection(("127.0.0.1", int(hostport.split(":")[1])))
    s.sendall((f"POST /{{rest}}/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {{api_key}}\r\n"
               "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode())
    piece = b"%x\r\n" % (1 << 20) + b" " * (1 << 20) + b"\r\n"

    def send():
        try:
            for _ in range(300):
                s.sendall(piece)
            s.sendall(b"0\r\n\r\n")
        except OSError:
            pass

    t = threading.Thread(target=send, daemon=True)
    t.start()
    answer = b""
    while True:
        try:
            got = s.recv(1 << 16)
        except OSError:
            break
        if not got:
            break
        answer += got
    t.join()
    s.close()
    return answer


def agent(base_url, api_key, prompt):
    if not _first.acquire(blocking=False):
        return chat(base_url, api_key, prompt)
    port = base_url.split("//")[1].split("/")[0].split(":")[1]
    n = default_max_connections() + 500
    flood = subprocess.Popen([sys.executable, "-c", FLOODER, port, str(n)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert flood.stdout.readline().strip() == "ready", "the flooder did not connect"
        reward = chat(base_url, api_key, prompt)  # through the flood, still held
        answer = chunked_300_mb(base_url, api_key)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
        return reward
    finally:
        flood.stdin.close()
        flood.wait()
"""


def test_a_connection_flood_and_a_300_mb_chunked_body_leave_a_run_that_finishes(tmp_path):
    agent = tmp_path / "flood_agent.py"
    agent.write_text(AGENT.format(flooder=FLOODER))
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, tmp_path / "cache", "--num-rollout", "2", "--agent-function-path", f"{agent}:agent",
                   "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
                   "--micro-batch-size", "4")  # fmt: skip
    store = ObjectStore.from_uri(str(run_dir / "tables"))
    for step in (0, 1):
        rows = read_trajectories(store, "run", step).to_pylist()
        assert len(rows) == 4 and all(is_trainable(r) for r in rows), [(r["status"], r.get("metadata")) for r in rows]
    losses = {r["step"]: r["value"] for r in read_metrics(store, "run").to_pylist() if r["name"] == "train/loss"}
    assert set(losses) == {0, 1} and all(math.isfinite(v) for v in losses.values())
    log = (run_dir / "sluiceway.log").read_text()
    for text in (proc.stdout + proc.stderr, log):
        assert "Traceback" not in text and "Too many open files" not in text, text[-3000:]
    lines = [line for line in log.splitlines() if "agent endpoint" in line]
    assert 1 <= len(lines) <= 2 and all("connections are open" in line for line in lines), lines
