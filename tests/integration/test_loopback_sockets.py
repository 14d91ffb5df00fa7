"""The trainers' process groups listen on loopback only (issue 20: c10d TCPStores listened on every interface,
unauthenticated, and gloo on the address the hostname resolves to).

Most machines' hostnames resolve to a LAN address; where the kernel allows, the children run in a user+UTS
namespace whose hostname is this machine's LAN address, so gloo would pick it unless told otherwise.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_tags import listening_sockets, process_tree

from sluiceway.models.zoo import resolve_checkpoint

LOOPBACK = ("127.0.0.1", "0000:0000:0000:0000:0000:0000:0000:0001")
TESTS = str(Path(__file__).resolve().parents[1])

# A world of one, as the in-process trainer starts it; then it waits to be looked at.
ONE = """
import sys
from sluiceway.models.megatron_gpt import init_parallel_state
init_parallel_state(backend="gloo")
print("ready", flush=True)
sys.stdin.read()
"""

# The torchrun group (agent and 2 ranks, gloo, tensor parallel 2) trains a step, then waits to be looked at.
GROUP = """
import json, sys
sys.path.insert(0, sys.argv[1])
from trainer_group_helpers import batch, trainer_kwargs
from sluiceway.models.zoo import load_tokenizer
from sluiceway.tasks.train.remote import RemoteTrainer
path, work = sys.argv[2:4]
tok = load_tokenizer(path)
group = RemoteTrainer(trainer_kwargs(path, tok, tp=2), nproc=2, work_dir=work)
loss = group.train_rollout(batch(tok), step=0)["loss"]
print(json.dumps({"loss": loss, "world_size": group.world_size}), flush=True)
sys.stdin.read()
group.close()
sys.exit(group.proc.returncode)
"""


def _lan_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("203.0.113.1", 9))  # sends nothing: the kernel only picks the source address
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if ip.startswith("127.") else ip


def _with_lan_hostname(cmd: list[str]) -> list[str]:
    ip = _lan_address()
    if ip is None or not shutil.which("unshare"):
        return cmd
    if subprocess.run(["unshare", "-r", "-u", "true"], capture_output=True).returncode != 0:
        return cmd  # no user namespaces here: the stores are still checked
    return ["unshare", "-r", "-u", "sh", "-c", f'hostname {ip} && exec "$@"', "sh", *cmd]


def _start(code: str, *args: str) -> subprocess.Popen:
    cmd = _with_lan_hostname([sys.executable, "-c", code, *args])
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _sockets_of_tree(pid: int) -> dict[int, list[tuple[str, int]]]:
    return {p: s for p in process_tree(pid) if (s := listening_sockets(p))}


def test_process_group_of_one_listens_on_loopback_only():
    child = _start(ONE)
    try:
        assert child.stdout.readline().strip() == "ready"
        sockets = _sockets_of_tree(child.pid)
        assert sockets, "the process group should listen somewhere (its store)"
        assert all(ip in LOOPBACK for found in sockets.values() for ip, _ in found), sockets
    finally:
        child.stdin.close()
        child.wait(timeout=30)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_trainer_group_listens_on_loopback_only(tmp_path):
    """Driver, torchrun agent and ranks, sampled after a training step (gloo's connections are all made)."""
    path = resolve_checkpoint("tiny-llama", cache_dir=tmp_path / "cache")
    child = _start(GROUP, TESTS, str(path), str(tmp_path / "group"))
    try:
        line = child.stdout.readline()
        assert line, f"the group did not train; see {tmp_path / 'group' / 'trainer.log'}"
        result = json.loads(line)
        assert result["world_size"] == 2 and math.isfinite(result["loss"])
        sockets = _sockets_of_tree(child.pid)
        # the agent's rendezvous store and each rank's gloo: three processes at least
        assert len(sockets) >= 3, sockets
        assert all(ip in LOOPBACK for found in sockets.values() for ip, _ in found), sockets
    finally:
        child.stdin.close()
        child.wait(timeout=120)
    assert child.returncode == 0


def run_sampling_sockets(cmd: list[str], env: dict, out: Path) -> tuple[int, dict[tuple[str, int], str]]:
    """Run `cmd` (with the LAN hostname where the kernel allows), its processes' listening sockets sampled over and
    over until it ends; its exit code and each socket seen with its process's command line. stdout and stderr go to
    OUT.stdout and OUT.stderr (files, not pipes no one reads until the end)."""
    with open(f"{out}.stdout", "w") as stdout, open(f"{out}.stderr", "w") as stderr:
        run = subprocess.Popen(_with_lan_hostname(cmd), env=env, stdout=stdout, stderr=stderr)
        seen: dict[tuple[str, int], str] = {}
        hang_guard = time.monotonic() + 600  # as run_cli's
        try:
            while run.poll() is None and time.monotonic() < hang_guard:
                for pid in process_tree(run.pid):  # not by an environment tag: the router's new title overwrites it
                    try:
                        found = listening_sockets(pid)
                        name = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
                    except OSError:  # it ended meanwhile
                        continue
                    seen.update((s, name) for s in found)
                time.sleep(0.2)
        finally:
            if run.poll() is None:
                run.kill()  # its children die with it (infra/proc.py)
            run.wait()
    return run.returncode, seen


def test_every_socket_of_a_run_is_on_loopback(dp2_cli_run):
    """A whole short run (Prefect API server, router, engines, trainer group), its processes' listening sockets
    sampled over and over until it ends: the session's DP=2 run (tests/integration/conftest.py), whose training
    test_distributed_optimizer.py checks."""
    seen = dp2_cli_run.sockets
    assert dp2_cli_run.returncode == 0, dp2_cli_run.stdout + dp2_cli_run.stderr
    assert [s for s in seen if s[0] not in LOOPBACK] == [], seen
    names = " ".join(seen.values())
    # Prefect's API, the router (it renames itself sglang::router), an engine, the agent, the ranks
    for server in ("uvicorn", "router", "cli engine", "train.torchrun", "train.worker"):
        assert server in names, (server, seen)
