"""The object store going down under a run (tables and checkpoints on a real SeaweedFS, reached through a TCP
proxy that the test takes down and brings back): a short outage is retried and the run finishes bit-identical
to an uninterrupted one; an outage that lasts is one line, and a resume once the store is back loses nothing.
Slow (tens of seconds of outage and retries each): `make test-all`."""

from __future__ import annotations

import time
import uuid

import pytest
from cli_run import BATCH, N
from tcp_proxy import TcpProxy
from test_faults import STEPS, checkpoint_step, cli, run_args, start, wait_for

from sluiceway.storage.metrics import metrics_frame
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import read_trajectories

pytestmark = pytest.mark.slow


@pytest.fixture
def proxied(s3_server):
    proxy = TcpProxy(s3_server.s3_port)
    proxy.up()
    yield proxy, s3_server.env() | {"AWS_ENDPOINT_URL": proxy.url}
    proxy.down()


def stored_run(s3_server, uri: str, run_id: str) -> tuple[int, list[int]]:
    store = ObjectStore.from_uri(uri, s3_server.endpoint_url, access_key=s3_server.access_key,
                                 secret_key=s3_server.secret_key)  # fmt: skip
    table = read_trajectories(store, run_id)
    keys = list(zip(*(table.column(c).to_pylist() for c in ("step", "group_id", "sample_index"))))
    assert len(keys) == len(set(keys))
    return len(keys), list(metrics_frame(store, run_id)["train/loss"].dropna().index)


def down_after_a_checkpoint(tmp_path, proxied, s3_server, retries: str | None, backoff_s: str | None):
    """A run with its tables and checkpoints behind the proxy, which goes down once a checkpoint is written
    (retries and backoff None: the run's defaults)."""
    proxy, env = proxied
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    uri = f"s3://{s3_server.bucket}/outage-{uuid.uuid4().hex[:8]}"
    extra = (["--stage-retries", retries] if retries else []) + (["--retry-backoff-s", backoff_s] if backoff_s else [])
    args = run_args(run_dir, "--storage-uri", uri, *extra)
    proc = start(args, cache, f"fault-{uuid.uuid4().hex}", env)
    wait_for(lambda: checkpoint_step(run_dir) is not None, proc, "a checkpoint")
    proxy.down()
    return proc, run_dir, cache, uri


def test_object_store_down_for_20_s(tmp_path, proxied, s3_server):
    proxy, _ = proxied
    proc, _, _, uri = down_after_a_checkpoint(tmp_path, proxied, s3_server, retries="5", backoff_s="2")
    time.sleep(20)
    proxy.up()
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out
    assert stored_run(s3_server, uri, "run") == (STEPS * BATCH * N, list(range(STEPS)))


def test_object_store_down_for_60_s_with_the_defaults(tmp_path, proxied, s3_server):
    """Issue 30: a 30 s outage (connection refused) ended the run after 2 + 4 + 8 s of retries, with 16 terminal
    lines. With the defaults a minute is ridden out, and the retrying shows on the terminal as one line a call."""
    proxy, _ = proxied
    proc, _, _, uri = down_after_a_checkpoint(tmp_path, proxied, s3_server, retries=None, backoff_s=None)
    time.sleep(60)
    proxy.up()
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out
    assert stored_run(s3_server, uri, "run") == (STEPS * BATCH * N, list(range(STEPS)))
    noise = [ln for ln in out.splitlines() if "WARNING" in ln or "ERROR" in ln or "\u21b3" in ln]
    assert len(noise) <= 2, out  # a stage's first retry, and the lease's missed beat at most


def test_object_store_down_for_good_then_resume(tmp_path, proxied, s3_server):
    proxy, env = proxied
    proc, run_dir, cache, uri = down_after_a_checkpoint(tmp_path, proxied, s3_server, retries="1", backoff_s="1")
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 1, out
    errors = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in out, out
    assert "object store" in errors[0] and f"sluiceway resume {run_dir}" in errors[0], errors[0]
    proxy.up()
    resumed = cli(["resume", str(run_dir)], cache, env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert stored_run(s3_server, uri, "run") == (STEPS * BATCH * N, list(range(STEPS)))
