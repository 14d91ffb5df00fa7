"""Deployments on a real Prefect server: `sluiceway server`, `sluiceway serve --pool`, a process work pool
and a `prefect worker` on loopback running the rl flow on tiny-llama to completion."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from prefect_server import TINY_RUN_FLAGS, sluiceway_cmd, stop

from sluiceway.flows.logging_backends import read_scalars
from sluiceway.infra.proc import free_port
from sluiceway.storage.metrics import read_metrics
from sluiceway.storage.object_store import ObjectStore

PREFECT = str(Path(sys.executable).parent / "prefect")
POOL = "sluiceway-test-pool"
# Stands in for a credential in the worker's environment: it must reach neither Prefect's database nor artifacts.
SECRET = "worker-secret-6c1f2e9a7b"


@pytest.fixture(scope="module")
def server(prefect_server):
    """The session's Prefect server, shared with test_ui.py (tests/integration/conftest.py)."""
    return prefect_server


def test_serve_without_a_server_is_one_line(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/api"
    proc = subprocess.run(
        sluiceway_cmd("serve", "--api-url", url, "--home", str(tmp_path / "home")),
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: no Prefect server answers at {url}: start one with `sluiceway server` "
        "or set --api-url / PREFECT_API_URL"
    ]


def test_rl_deployment_runs_on_a_process_work_pool(server, tmp_path):
    env = server.env(SLUICEWAY_CACHE=str(tmp_path / "cache"), AWS_SECRET_ACCESS_KEY=SECRET)
    created = subprocess.run(
        [PREFECT, "work-pool", "create", "--type", "process", POOL],
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert created.returncode == 0, created.stdout + created.stderr
    run_dir = tmp_path / "run"
    serve = subprocess.run(
        sluiceway_cmd("serve", "--pool", POOL, "--flow", "rl", "--name", "pool-test", *TINY_RUN_FLAGS,
                      "--output-dir", str(run_dir)),
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert serve.returncode == 0, serve.stdout + serve.stderr
    assert f"registered sluiceway-rl/pool-test on work pool '{POOL}'" in serve.stdout
    dep = server.deployment("sluiceway-rl", "pool-test")
    assert dep["work_pool_name"] == POOL and dep["entrypoint"] == "sluiceway.flows.rl.rl_flow"
    assert "RunConfig" in dep["parameter_openapi_schema"]["definitions"]

    run = server.post(f"/deployments/{dep['id']}/create_flow_run", {"name": "pool-run"})
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen(
            [PREFECT, "worker", "start", "--pool", POOL, "--type", "process"],
            env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        final = server.wait_flow_run(run["id"])
    finally:
        stop(worker)
    assert final["state_type"] == "COMPLETED", server.logs_of(run["id"]) + log.read_text()[-4000:]

    metrics = read_metrics(ObjectStore.from_uri(str(run_dir / "tables")), "run").to_pylist()
    assert {r["step"] for r in metrics if r["name"] == "reward_mean"} == {0, 1}
    arts = {a["key"]: a for a in server.artifacts_of(run["id"])}
    assert {"sluiceway-run-progress", "sluiceway-run-metrics", "sluiceway-run-curves", "sluiceway-run-storage"} <= set(
        arts
    )
    table = arts["sluiceway-run-metrics"]["data"]
    table = json.loads(table) if isinstance(table, str) else table
    assert [row["step"] for row in table] == [0, 1] and all(row["reward"] is not None for row in table)
    assert float(arts["sluiceway-run-progress"]["data"]) == 100.0
    assert str(run_dir / "tables") in arts["sluiceway-run-storage"]["data"]
    assert [s for s, _ in read_scalars(run_dir / "tensorboard")["reward_mean"]] == [0, 1]
    # The worker's environment reached the flow (credentials work) but not Prefect's records.
    db = (server.home / "prefect.db").read_bytes()
    assert SECRET.encode() not in db
