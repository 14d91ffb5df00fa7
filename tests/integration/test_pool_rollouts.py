"""A run that takes rollouts from remote pools beside its own engines (tasks/rollout/dispatch.py).

- The dispatcher's rule: local engines always qualify; a remote pool only while the version its agent reports
  is fresh enough, and not while benched; the pool with most room takes the group.
- End to end on tiny-llama, fully-async with max_staleness 1: pool "east" follows every weight version through
  its agent, pool "west" stays on the base weights, pool "dead" reports a version but its router is gone. The run
  finishes without waiting on either; trajectories name the pool that made them; no trained sample is older than
  the limit; "west" gets groups only while v0 is fresh enough; "dead"'s groups went elsewhere.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
from cli_run import BATCH, N, run_cli
from paths import DATA

from sluiceway.flows.pools import PoolsFile, PoolSpec, local_pools
from sluiceway.infra.proc import free_port
from sluiceway.models.zoo import resolve_checkpoint
from sluiceway.storage.metrics import metrics_frame
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import read_trajectories
from sluiceway.storage.weights.pool_registry import PoolRecord, PoolRegistry
from sluiceway.storage.weights.store import WeightStore
from sluiceway.tasks.rollout.dispatch import PoolDispatcher
from sluiceway.tasks.rollout.pool_target import PoolTarget, own_engines

pytestmark = pytest.mark.shared_prefect  # its runs use the worker's Prefect server: tests/integration/conftest.py

PACED = f"{DATA / 'gated_generate.py'}:generate"
PACE_S = 0.5  # seconds each sample waits before it generates: no CPU, time for east to load each new version


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rollout-pools", "east"], "rollout_pools: 'east' is not NAME=http://HOST:PORT"),
        (["--rollout-pools", "local=http://h:1", "--update-weight-mode", "delta"], "pool name 'local' is taken"),
        (["--rollout-pools", "east=http://h:1"], "rollout_pools need update_weight_mode delta"),
    ],
)
def test_bad_pool_flags_are_one_line(flags, message):
    proc = subprocess.run(
        [sys.executable, "-m", "sluiceway.flows.cli", "config", "--prompt-data", "env:arithmetic", *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_run_takes_groups_from_remote_pools_without_waiting_for_slow_ones(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    weights = tmp_path / "weight_store"
    model = resolve_checkpoint("tiny-llama", cache_dir=cache)
    wstore = WeightStore(ObjectStore.from_uri(str(weights)))
    spec = PoolsFile(
        pools=[PoolSpec(name=n, model=str(model), num_engines=1, weights_uri=str(weights), poll_interval_s=0.2)
               for n in ("east", "west")]
    )  # fmt: skip
    with local_pools(spec, tmp_path / "pools", poll=False) as (east, west):
        east.agent.start()  # follows every version the run publishes
        assert west.agent.poll_once() == 0  # reports the base weights once, then never updates
        PoolRegistry(wstore).write(PoolRecord(pool="dead", serving=0))  # claims v0; nothing listens
        dead = f"http://127.0.0.1:{free_port()}"
        steps = 4
        # Each sample first waits PACE_S (tests/data/gated_generate.py): a tiny-llama step is otherwise shorter than
        # east's catching up (its poll, the delta, the run's next read of the pools), and every group of a new
        # version could go to the run's own engines before east qualified (the fresh-clone suite saw it once).
        proc = run_cli(
            run_dir, cache, "--num-rollout", str(steps), "--mode", "fully-async", "--max-staleness", "1",
            "--rollout-max-concurrency", str(N), "--update-weight-mode", "delta", "--weights-uri", str(weights),
            "--rollout-pools", f"east={east.url}", f"west={west.url}", f"dead={dead}",
            "--custom-generate-function-path", PACED, env={"SLUICEWAY_TEST_PACE_S": str(PACE_S)},
        )  # fmt: skip
        assert east.agent.version == steps  # it loaded the last version the run published
    # "dead" was given a group, which failed (benched) or was hedged on the run's own engines first.
    assert "pool dead failed" in proc.stderr or "pool dead slow" in proc.stderr
    assert "Task was destroyed" not in proc.stderr  # nothing left pending by a cancelled request

    rows = read_trajectories(ObjectStore.from_uri(str(run_dir / "tables")), "run").to_pylist()
    trained = [r for r in rows if r["status"] != "aborted" and r["filter_reason"] is None]
    for k in range(steps):  # every step trained a full batch
        assert sum(r["step"] == k for r in trained) == BATCH * N
    pools = {r["pool"] for r in trained}
    assert {"local", "east", "west"} <= pools and "dead" not in {r["pool"] for r in rows}
    # Step k trains at version k: no trained token is more than max_staleness 1 behind.
    assert all(r["step"] - min(r["weight_versions"]) <= 1 for r in trained)
    assert {r["step"] for r in trained if r["pool"] == "west"} <= {0, 1}  # v0 is fresh enough for steps 0-1 only
    assert any(r["pool"] == "east" and r["weight_version"] >= 1 for r in trained)  # east served new versions
    m = metrics_frame(ObjectStore.from_uri(str(run_dir / "tables")), "run")
    assert m["rollout/pool/west/samples"].fillna(0).sum() == sum(r["pool"] == "west" for r in trained)


class SlowLink:
    """An HTTP hop that holds every request `delay_s` before passing it on: a pool behind a slow link."""

    def __init__(self, upstream: str, delay_s: float):
        import http.server
        import threading

        import httpx

        link = self
        self.requests = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the stdlib's name
                link.requests += 1
                body = self.rfile.read(int(self.headers["Content-Length"]))
                time.sleep(delay_s)
                try:
                    r = httpx.post(upstream + self.path, content=body, timeout=60, trust_env=False,
                                   headers={"Content-Type": "application/json"})  # fmt: skip
                    status, data = r.status_code, r.content
                except httpx.HTTPError:
                    status, data = 502, b"{}"
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up on us (the group was hedged): nothing to answer
                    pass

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_slow_pool_is_hedged_on_the_run_s_own_engines(tmp_path, caplog):
    from rollout_helpers import make_prompts, settings, start_stack

    from sluiceway.models.zoo import load_tokenizer
    from sluiceway.tasks.rollout.client import EngineClient
    from sluiceway.tasks.rollout.rollout import plan_step, run_rollout

    model = resolve_checkpoint("tiny-llama", cache_dir=tmp_path / "cache")
    tok = load_tokenizer(model)
    store = ObjectStore.from_uri(str(tmp_path / "tables"))
    router, engines = start_stack(tmp_path, model, 1)
    link = SlowLink(router.url, delay_s=30.0)  # the same engines, 30 s away
    s = settings(groups_needed=4, groups_submitted=4, max_concurrency=4)  # one group at a time per pool
    work = plan_step(store, "r", 0, make_prompts(tok, 4), s, [])

    async def go():
        async with EngineClient(router.url, engines.urls) as local, EngineClient(link.url, []) as far:
            slow = PoolTarget("slow", far, capacity=4, version=0)
            pools = PoolDispatcher([own_engines(local, s.max_concurrency), slow], min_version=0)
            return await run_rollout(dispatcher=pools, store=store, run_id="r", step=0, work=work, settings=s,
                                     decode=tok.decode)  # fmt: skip

    try:
        with caplog.at_level("INFO", logger="sluiceway"):
            result = asyncio.run(go())
    finally:
        link.close()
        engines.close()
        router.close()
    assert link.requests >= 1  # the slow pool was given a group ...
    assert "pool slow slow" in caplog.text  # ... which the run's engines generated too, and finished first
    rows = read_trajectories(store, "r", 0).to_pylist()
    assert result.groups_completed == 4 and len(rows) == 16
    assert {r["pool"] for r in rows} == {"local"} and {r["status"] for r in rows} <= {"completed", "truncated"}
