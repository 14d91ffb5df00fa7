"""The trainer group as rank actors on a real multi-node Ray cluster (ray.cluster_utils.Cluster: a head and two
worker nodes, each its own raylet with one CPU, on this machine).

DP=2 and TP=2 groups spread over two nodes compute the same losses and gradients as one process (1e-5, fp32); a
node removed mid-training fails the call with one line naming the rank and the node; nothing of a group stays on
the cluster after close.
"""

from __future__ import annotations

import signal

import pytest
from trainer_group_helpers import assert_same, batch, local_trainer, trainer_kwargs

from sluiceway.tasks.train.remote import TrainerGroupError

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def cluster():
    """A head (no CPUs: nothing of the group lands there) and two worker nodes of one CPU each."""
    from ray.cluster_utils import Cluster

    handler = signal.getsignal(signal.SIGTERM)
    # Nodes on this machine (their address is its own: the test's traffic never leaves it).
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [c.add_node(num_cpus=1) for _ in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    signal.signal(signal.SIGTERM, handler)
    yield c, nodes
    ray.shutdown()
    c.shutdown()


def _group_left_nothing(cpus: int = 2, wait_s: float = 10):
    """Every placement group removed and every CPU of the worker nodes free again (no actor holds one)."""
    import time

    for _ in range(int(wait_s * 10)):  # removal is asynchronous
        pgs = [p for p in ray.util.placement_group_table().values() if p["state"] != "REMOVED"]
        free = ray.available_resources().get("CPU", 0)
        if not pgs and free == cpus:
            return [], []
        time.sleep(0.1)
    return [f"{free} of {cpus} CPUs free"], pgs


@pytest.mark.parametrize("layout", [{"tp": 1}, {"tp": 2}], ids=["dp2", "tp2"])
def test_a_group_over_two_nodes_matches_one_process(tiny, cluster, layout):
    from sluiceway.tasks.train.ray_group import RayTrainer

    path, tok = tiny
    ref = local_trainer(trainer_kwargs(path, tok, share_prompts=False)).gradients(batch(tok), step=0)
    kwargs = trainer_kwargs(path, tok, **layout)
    group = RayTrainer(kwargs, num_nodes=2, ranks_per_node=1)
    try:
        assert group.world_size == 2
        assert len({node_id for _, node_id in group.nodes}) == 2  # one rank on each worker node
        assert_same(group.gradients(batch(tok), step=0), ref)
    finally:
        group.close()
    alive, pgs = _group_left_nothing()
    assert not alive and not pgs, (alive, pgs)


def test_a_node_removed_mid_training_is_one_clear_error(tiny, cluster):
    from sluiceway.tasks.train.ray_group import RayTrainer

    c, nodes = cluster
    path, tok = tiny
    kwargs = trainer_kwargs(path, tok)
    group = RayTrainer(kwargs, num_nodes=2, ranks_per_node=1)
    try:
        group.train_rollout(batch(tok), 0)
        c.remove_node(nodes[1])
        with pytest.raises(TrainerGroupError, match=r"trainer rank \d .* died|trainer rank \d on node"):
            for step in range(1, 4):
                group.train_rollout(batch(tok), step)
    finally:
        group.close()
        nodes[1] = c.add_node(num_cpus=1)  # the next test gets its two nodes back
        c.wait_for_nodes()
    alive, pgs = _group_left_nothing()
    assert not alive and not pgs, (alive, pgs)


@pytest.fixture
def three_nodes(cluster):
    """The module's cluster with a third worker node (the engine's), removed after the test."""
    c, _ = cluster
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c
    for node in list(c.worker_nodes)[2:]:  # back to two worker nodes, whichever a test removed
        c.remove_node(node)


@pytest.mark.shared_prefect
def test_sluiceway_run_on_a_ray_cluster(tmp_path, three_nodes):
    """`sluiceway run --ray-address`: trainer ranks on two nodes, the engine on a third; then nothing of the run
    is left on the cluster."""
    from cli_run import BATCH, N, run_cli

    from sluiceway.storage.object_store import ObjectStore
    from sluiceway.storage.trajectories import read_trajectories

    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, tmp_path / "cache", "--num-rollout", "2", "--ray-address", three_nodes.address,
                   "--actor-num-nodes", "2", "--tensor-model-parallel-size", "2")  # fmt: skip
    assert "step   2/2  reward" in proc.stdout, proc.stdout + proc.stderr
    table = read_trajectories(ObjectStore.from_uri(str(run_dir / "tables")), "run")
    keys = list(zip(*(table.column(c).to_pylist() for c in ("step", "group_id", "sample_index"))))
    assert len(keys) == len(set(keys)) == 2 * BATCH * N
    assert set(table.column("weight_version").to_pylist()) == {0, 1}
    assert (run_dir / "logs" / "ray-engine-0.log").exists()
    alive, pgs = _group_left_nothing(cpus=3)
    assert not alive and not pgs, (alive, pgs)


@pytest.mark.slow  # a run killed by a lost node, then resumed on the cluster: about 2 minutes on 2 cores
def test_a_lost_node_fails_the_run_in_one_line_and_resume_finishes(tmp_path, three_nodes):
    import os
    import subprocess
    import sys
    import time

    from cli_run import BATCH, N, cli_args

    from sluiceway.storage.object_store import ObjectStore
    from sluiceway.storage.trajectories import read_trajectories

    c = three_nodes
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    ray_flags = ["--ray-address", c.address, "--actor-num-nodes", "2", "--num-rollout", "4"]
    env = {**os.environ, "SLUICEWAY_CACHE": str(cache)}
    cmd = cli_args(run_dir, *ray_flags)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    meta = run_dir / "checkpoints" / "latest" / "meta.json"
    deadline = time.monotonic() + 300
    while not meta.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    victim = sorted(c.worker_nodes, key=id)[0]
    c.remove_node(victim)  # a trainer rank's node or the engine's: either way the run cannot go on as it was
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, out + err
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    resumed = subprocess.run([sys.executable, "-m", "sluiceway.flows.cli", "resume", str(run_dir)], env=env,
                             capture_output=True, text=True, timeout=600)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    table = read_trajectories(ObjectStore.from_uri(str(run_dir / "tables")), "run")
    keys = list(zip(*(table.column(k).to_pylist() for k in ("step", "group_id", "sample_index"))))
    assert len(keys) == len(set(keys)) == 4 * BATCH * N  # nothing lost, nothing duplicated


def test_a_killed_run_leaves_nothing_on_the_cluster(tmp_path, three_nodes):
    """SIGKILL of the flow's process mid-run: Ray removes its actors (trainer ranks, engines) and placement group."""
    import os
    import signal
    import subprocess
    import time

    from cli_run import cli_args

    run_dir = tmp_path / "run"
    args = cli_args(run_dir, "--ray-address", three_nodes.address, "--actor-num-nodes", "2", "--num-rollout", "50")
    env = {**os.environ, "SLUICEWAY_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    meta = run_dir / "checkpoints" / "latest" / "meta.json"
    deadline = time.monotonic() + 300
    while not meta.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    alive, pgs = _group_left_nothing(cpus=3, wait_s=60)
    assert not alive and not pgs, (alive, pgs)
