"""Inference pools that join and leave a live run through the pool registry (issue 34).

A real `sluiceway run` on tiny-llama (fully-async, max_staleness 1, its own engine, `--rollout-pools auto`) and
real pools, each `sluiceway pools up` in its own process (router, one engine, agent), registering beside the
run's weight store. Each pool runs in a network namespace of its own behind a veth pair, and the run reaches it
through a proxy on the far end, the URL the pool registers (tests/wan_helpers.py); where the machine cannot make
namespaces, the pools run on loopback. Pool A joins at step 3, pool B at step 5 (the test holds the run's
generation while each one starts: tests/data/gated_generate.py), A drains at step 7 (`sluiceway pools drain A`),
B is SIGKILLed at step 8. Every step's groups are stored exactly once and trained once, no trained token is
staler than the limit, the metrics count each pool's samples per step, no registered URL reaches the run's output
or its table, and the run finishes. A second run has no engines of its own and finishes on one pool alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from cli_run import BATCH, N, cli_args, run_cli
from paths import DATA
from wan_helpers import remote_pool

from sluiceway.flows.pools import PoolsFile, PoolSpec, local_pools
from sluiceway.infra.netns import NetnsUnavailable, WanLink
from sluiceway.models.zoo import resolve_checkpoint
from sluiceway.storage.metrics import metrics_frame
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import read_trajectories
from sluiceway.storage.weights.pool_registry import PoolRegistry
from sluiceway.storage.weights.store import WeightStore

pytestmark = pytest.mark.shared_prefect  # its runs use the worker's Prefect server: tests/integration/conftest.py

GATED = f"{DATA / 'gated_generate.py'}:generate"
HEARTBEAT_S = 1.0  # the pools' heartbeat: silent after 3, dropped after 10 (tasks/rollout/pool_directory.py)


def _pool_yaml(path: Path, name: str, model: Path, weights: Path) -> Path:
    spec = {"name": name, "region": f"test-{name}", "model": str(model), "num_engines": 1, "capacity": N,
            "weights_uri": str(weights), "poll_interval_s": 0.3, "heartbeat_s": HEARTBEAT_S}  # fmt: skip
    path.write_text(yaml.safe_dump({"pools": [spec]}))
    return path


def _start_pool(tmp: Path, name: str, model: Path, weights: Path) -> subprocess.Popen:
    cfg = _pool_yaml(tmp / f"{name}.yaml", name, model, weights)
    log = open(tmp / f"pool-{name}.log", "wb")  # noqa: SIM115 - kept open for the process's life
    cmd = [sys.executable, "-m", "sluiceway.flows.cli", "pools", "up", str(cfg), "--work-dir", str(tmp / "pools")]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip


class _Places:
    """Where the test's pools run: each in its own network namespace (`remote_pool`: `pools up` inside it, its
    router reached through a proxy on the namespace's end of the veth), or on loopback where namespaces fail."""

    def __init__(self, stack: contextlib.ExitStack, tmp: Path, model: Path, weights: Path) -> None:
        self.stack, self.tmp, self.model, self.weights = stack, tmp, model, weights
        self.netns = True
        self.tag = os.getpid() % 1000

    def start(self, name: str, index: int) -> subprocess.Popen:
        if self.netns:
            try:
                link = WanLink(f"swe{self.tag}{index}", subnet=f"10.79.{(self.tag * 3 + index) % 250}").start()
            except NetnsUnavailable:
                self.netns = False
            else:
                self.stack.callback(link.close)
                pool = self.stack.enter_context(remote_pool(
                    link, self.tmp / f"pool-{name}", model=str(self.model), weights_uri=str(self.weights),
                    store_env={}, name=name, poll_interval_s=0.3, router_port=31000, capacity=N,
                    heartbeat_s=HEARTBEAT_S,
                ))  # fmt: skip
                return pool.process
        process = _start_pool(self.tmp, name, self.model, self.weights)
        self.stack.callback(_kill, process)
        return process


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def _wait(what: str, cond, run: subprocess.Popen, timeout_s: float = 300.0, tmp: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if run.poll() is not None:
            raise AssertionError(f"the run ended ({run.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            logs = "".join(p.read_text(errors="replace")[-2000:] for p in (tmp or Path()).glob("*.log"))
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.05)


def test_pools_join_drain_and_vanish_during_a_run(tmp_path):
    cache, run_dir, weights = tmp_path / "cache", tmp_path / "run", tmp_path / "weight_store"
    model = resolve_checkpoint("tiny-llama", cache_dir=cache)
    wstore = WeightStore(ObjectStore.from_uri(str(weights)))
    registry = PoolRegistry(wstore)
    gate = tmp_path / "hold"
    # Steps enough that the run is still generating when B is killed: from step 7 to step 8 the test drains A
    # (a CLI start, A's exit, the run's next read of the pools) while the run goes on, and with 10 steps a fast
    # run once finished during it, before B could fall silent.
    steps = 14
    env = dict(os.environ, SLUICEWAY_CACHE=str(cache), SLUICEWAY_TEST_PACE_S="1.0", SLUICEWAY_TEST_GATE=str(gate))
    args = cli_args(
        run_dir, "--num-rollout", str(steps), "--mode", "fully-async", "--max-staleness", "1",
        "--rollout-max-concurrency", str(N), "--update-weight-mode", "delta", "--weights-uri", str(weights),
        "--rollout-pools", "auto", "--custom-generate-function-path", GATED,
    )  # fmt: skip
    run_log = tmp_path / "run.log"
    pools: dict[str, subprocess.Popen] = {}
    urls: set[str] = set()  # what the pools registered: never to be seen in the run's output or tables
    with open(run_log, "wb") as log:
        run = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    newest = lambda: wstore.newest() or 0  # noqa: E731 - the trainer's steps so far (version k after step k)

    def serving(name: str, version: int) -> bool:
        r = registry.records().get(name)
        if r is not None and r.url:
            urls.add(r.url)
        return r is not None and r.serving is not None and r.serving >= version

    def join(name: str, at_step: int) -> None:
        _wait(f"step {at_step}", lambda: newest() >= at_step - 1, run, tmp=tmp_path)
        gate.touch()  # the run generates nothing while the pool starts: it joins at this step
        pools[name] = places.start(name, len(pools))
        _wait(f"pool {name} serving v{newest()}", lambda: serving(name, newest()), run, tmp=tmp_path)
        gate.unlink()

    with contextlib.ExitStack() as stack:
        places = _Places(stack, tmp_path, model, weights)
        try:
            join("A", 3)
            join("B", 5)
            _wait("step 7", lambda: newest() >= 6, run, tmp=tmp_path)
            cli = [sys.executable, "-m", "sluiceway.flows.cli"]
            drain = subprocess.run([*cli, "pools", "drain", "A", "--weights-uri", str(weights)], capture_output=True,
                                   text=True, timeout=120)  # fmt: skip
            assert drain.returncode == 0, drain.stderr
            _wait("pool A to deregister", lambda: "A" not in registry.records(), run, timeout_s=120, tmp=tmp_path)
            a_left = time.time()
            assert pools["A"].wait(timeout=60) == 0  # its only pool left: `pools up` ends by itself
            said = lambda text: text in run_log.read_text(errors="replace")  # noqa: E731
            _wait("the run to see A leave", lambda: said("pool A left"), run, timeout_s=60, tmp=tmp_path)
            _wait("step 8", lambda: newest() >= 7, run, tmp=tmp_path)
            gate.touch()  # B's groups in flight wait here, then fail: B is gone
            _kill(pools["B"])
            b_killed = time.time()
            _wait("the run to see B fall silent", lambda: said("pool B: no heartbeat"), run, timeout_s=60,
                  tmp=tmp_path)  # fmt: skip
            gate.unlink()
            assert run.wait(timeout=600) == 0, run_log.read_text(errors="replace")[-5000:]
        finally:
            gate.unlink(missing_ok=True)
            if run.poll() is None:
                run.kill()
                run.wait(timeout=30)
    out = run_log.read_text(errors="replace")

    rows = read_trajectories(ObjectStore.from_uri(str(run_dir / "tables")), "run").to_pylist()
    # Stored exactly once: one row per (step, group, sample), each stored group whole.
    keys = Counter((r["step"], r["group_id"], r["sample_index"]) for r in rows)
    assert max(keys.values()) == 1
    groups = Counter((r["step"], r["group_id"]) for r in rows)
    assert set(groups.values()) == {N}
    trained = [r for r in rows if r["status"] != "aborted" and r["filter_reason"] is None]
    for k in range(steps):  # every step trained a full batch
        assert sum(r["step"] == k for r in trained) == BATCH * N, k
    assert all(r["step"] - min(r["weight_versions"]) <= 1 for r in trained)  # max_staleness 1
    by_pool = Counter(r["pool"] for r in trained)
    assert by_pool["A"] > 0 and by_pool["B"] > 0 and by_pool["local"] > 0, by_pool
    assert min(r["step"] for r in rows if r["pool"] == "A") >= 2  # joined at step 3 (fully-async: one ahead)
    assert min(r["step"] for r in rows if r["pool"] == "B") >= 4
    assert all(r["created_at"].timestamp() <= a_left for r in rows if r["pool"] == "A")  # drained, then left
    # B's samples were all sent before it was killed: a row is built (created_at) after its whole group and its
    # reward, which under load can come after the kill for a group B finished just before it, so the check is on
    # when each sample's request started (created_at less its generation time).
    assert all(r["created_at"].timestamp() - (r["gen_time_s"] or 0.0) <= b_killed for r in rows if r["pool"] == "B")
    assert {r["engine"] for r in rows if r["pool"] in ("A", "B")} == {"router"}  # no pool URL in the table

    # What the run said: joins, the drain, B's silence; never a pool's URL (nor in the table).
    for line in ("pool A (", "pool B (", "pool A draining", "pool A left", "pool B: no heartbeat"):
        assert line in out, line
    assert len(urls) == 2  # A's and B's
    for url in urls:
        host_port = url.rsplit("//", 1)[-1]
        assert host_port not in out and not any(host_port in str(v) for r in rows for v in r.values())

    m = metrics_frame(ObjectStore.from_uri(str(run_dir / "tables")), "run")  # index: step
    for name in ("A", "B"):
        col = f"rollout/pool/{name}/samples"
        assert m[col].fillna(0).sum() == by_pool[name]
        per_step = Counter(r["step"] for r in trained if r["pool"] == name)
        assert {k: int(v) for k, v in m[col].dropna().items() if v} == dict(per_step)


def test_a_run_with_no_engines_of_its_own_finishes_on_a_pool(tmp_path):
    cache, run_dir, weights = tmp_path / "cache", tmp_path / "run", tmp_path / "weight_store"
    model = resolve_checkpoint("tiny-llama", cache_dir=cache)
    spec = PoolsFile(pools=[PoolSpec(name="only", model=str(model), num_engines=1, weights_uri=str(weights),
                                     poll_interval_s=0.2, heartbeat_s=HEARTBEAT_S)])  # fmt: skip
    steps = 3
    with local_pools(spec, tmp_path / "pools"):
        proc = run_cli(
            run_dir, cache, "--num-rollout", str(steps), "--rollout-num-engines", "0", "--rollout-pools", "auto",
            "--update-weight-mode", "delta", "--weights-uri", str(weights),
        )  # fmt: skip
    rows = read_trajectories(ObjectStore.from_uri(str(run_dir / "tables")), "run").to_pylist()
    trained = [r for r in rows if r["status"] != "aborted" and r["filter_reason"] is None]
    assert {r["pool"] for r in rows} == {"only"}
    for k in range(steps):  # sync mode: step k sampled at version k, which the pool had to fetch first
        assert sum(r["step"] == k for r in trained) == BATCH * N
        assert {r["weight_version"] for r in trained if r["step"] == k} == {k}
    assert "pool only (local) joined" in proc.stderr
    assert not (run_dir / "logs" / "router.log").exists()  # no router, no engine of its own


def test_sigterm_drains_a_pool_then_it_deregisters_and_exits(tmp_path):
    # What Kubernetes does when it scales a Deployment down (docs/deploy.md): SIGTERM to `pools up`.
    model = resolve_checkpoint("tiny-llama", cache_dir=tmp_path / "cache")
    weights = tmp_path / "weight_store"
    registry = PoolRegistry(WeightStore(ObjectStore.from_uri(str(weights))))
    pool = _start_pool(tmp_path, "east", model, weights)
    try:
        deadline = time.monotonic() + 300
        while "east" not in registry.records():
            assert pool.poll() is None and time.monotonic() < deadline, (tmp_path / "pool-east.log").read_text()
            time.sleep(0.05)
        assert registry.records()["east"].state == "serving"
        os.killpg(pool.pid, signal.SIGTERM)
        assert pool.wait(timeout=120) == 0
    finally:
        if pool.poll() is None:
            os.killpg(pool.pid, signal.SIGKILL)
    log = (tmp_path / "pool-east.log").read_text()
    assert registry.records() == {} and "draining pools east" in log and "pool east left" in log
