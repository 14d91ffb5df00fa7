"""`use_distributed_optimizer` (tasks/train/zero.py) in a DP=2 torchrun trainer group over gloo on tiny-llama.

The sharded optimizer takes the same steps as the unsharded one, and its checkpoints have the unsharded layout, so
they load at another DP size with or without the flag.
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from trainer_group_helpers import batch, local_trainer, trainer_kwargs

from sluiceway.storage.checkpoints import checkpoint_problem
from sluiceway.tasks.train.remote import RemoteTrainer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# One micro-batch per DP rank at DP=2 (4 samples, micro-batches of 2): see test_checkpoint_loads_at_another_dp_size.
LAYOUT = dict(global_batch_size=4, micro_batch_size=2)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The group's ranks run one torch thread each (RemoteTrainer's default); the in-process trainers compared
    with them bit for bit must too: a matrix product splits its sums by thread, so the thread count decides the
    order of the additions (with 2 threads here the step-3 weights differ by up to 5e-6)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
STEPS = 3


def weights(directory):
    return {k: v.clone() for k, v in load_file(directory / "model.safetensors").items()}  # no mmap of a reused file


def assert_equal(a, b):
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: max difference {float((a[k] - b[k]).abs().max())}"


def assert_state_equal(a, b, where="state"):
    """Two checkpoint states (nested dicts, lists, tensors) hold the same values, bit for bit."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_state_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_state_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def train_group(path, tok, root, **training):
    """A DP=2 group's weights after each of 3 steps, a checkpoint after the second, rank 0's optimizer bytes."""
    group = RemoteTrainer(trainer_kwargs(path, tok, **LAYOUT, **training), nproc=2, work_dir=root / "group")
    try:
        assert group.world_size == 2
        after = []
        for step in range(STEPS):
            group.train_rollout(batch(tok, 4), step)
            after.append(weights(group.write_weights(path, root / f"weights{step}")))
            if step == 1:
                group.save(root / "ckpt", step=1)
        nbytes = group.state()["optimizer_state_bytes"]
    finally:
        group.close()
    assert group.proc.returncode == 0
    return {"weights": after, "ckpt": root / "ckpt", "bytes": nbytes}


def checkpoint_state(directory):
    state = torch.load(directory / "tp0.pt", map_location="cpu", weights_only=False)
    del state["rng"]["python"]  # unseeded: differs between any two processes
    return state


@pytest.fixture(scope="module")
def dp2_runs(tiny, tmp_path_factory):
    """DP=2 with and without the flag."""
    path, tok = tiny
    return {
        flag: train_group(path, tok, tmp_path_factory.mktemp(f"flag{flag}"), use_distributed_optimizer=flag)
        for flag in (True, False)
    }


def test_three_steps_equal_the_unsharded_optimizer(tiny, dp2_runs):
    """Bit for bit, not just within 1e-6: AdamW is elementwise, and each rank steps its shard with the gradients,
    clip coefficient and step count the unsharded optimizer uses, so every element gets the same arithmetic."""
    initial = weights(tiny[0])
    sharded, unsharded = dp2_runs[True]["weights"], dp2_runs[False]["weights"]
    for step in range(STEPS):
        assert_equal(sharded[step], unsharded[step])
        before = initial if step == 0 else sharded[step - 1]
        assert any(not torch.equal(before[k], sharded[step][k]) for k in before), "the step changed nothing"
    # fp32: the weights are the masters; each rank holds half the two moments (and a step count).
    assert dp2_runs[True]["bytes"] == pytest.approx(dp2_runs[False]["bytes"] / 2, rel=0.01)


def test_checkpoint_loads_at_another_dp_size(tiny, dp2_runs, tmp_path):
    """A DP=2 sharded checkpoint holds what a DP=2 unsharded one holds (the full per-parameter layout), and its
    sha256 digests check; resumed at DP=1, with or without the flag, it trains step 3 bit-identically to a run
    that was DP=1 throughout and checkpointed there, and a DP=1 checkpoint resumed in a DP=2 sharded group gives
    the same step 3 as the DP=2 run.

    Bit-identical because the maths allows it in this layout: with one micro-batch per DP rank, DP=2's gradient
    is rank 0's plus rank 1's (gloo sums two values), the same single addition DP=1 makes accumulating its two
    micro-batches, and everything after that is elementwise. With more micro-batches per rank the additions
    group differently (DP=1: ((g1+g2)+g3)+g4, DP=2: (g1+g3)+(g2+g4)) and runs agree to about 1e-6 (lr 1e-2), not
    bit for bit; that is DP's doing, with or without the flag.
    """
    path, tok = tiny
    sharded, unsharded = dp2_runs[True]["ckpt"], dp2_runs[False]["ckpt"]
    assert checkpoint_problem(sharded) is None and checkpoint_problem(unsharded) is None
    assert_state_equal(checkpoint_state(sharded), checkpoint_state(unsharded))

    # DP=1 throughout: two steps, a checkpoint, a fresh trainer resumes and takes step 3.
    first = local_trainer(trainer_kwargs(path, tok, **LAYOUT))
    for step in range(2):
        first.train_rollout(batch(tok, 4), step)
    first.save(tmp_path / "dp1", step=1)
    reference = local_trainer(trainer_kwargs(path, tok, **LAYOUT))
    assert reference.load(tmp_path / "dp1") == 1
    reference.train_rollout(batch(tok, 4), 2)
    expected = reference.hf_state_dict(include_tied_lm_head=False)
    assert_equal(dp2_runs[True]["weights"][2], expected)

    for flag in (False, True):
        resumed = local_trainer(trainer_kwargs(path, tok, use_distributed_optimizer=flag, **LAYOUT))
        assert resumed.load(sharded) == 1 and resumed.weight_version == 2
        resumed.train_rollout(batch(tok, 4), 2)
        assert_equal(resumed.hf_state_dict(include_tied_lm_head=False), expected)

    group = RemoteTrainer(
        trainer_kwargs(path, tok, use_distributed_optimizer=True, **LAYOUT), nproc=2, work_dir=tmp_path / "group"
    )
    try:
        assert group.load(tmp_path / "dp1") == 1
        group.train_rollout(batch(tok, 4), 2)
        assert_equal(weights(group.write_weights(path, tmp_path / "weights")), expected)
    finally:
        group.close()


def test_bf16_sharded_masters(tiny, tmp_path):
    """bf16 compute over fp32 masters, which are sharded too: a DP=2 sharded group equals one unsharded process
    (bit for bit, as above), step after step and in its checkpoint (the master shards gathered into full fp32
    tensors), each rank holding half the 12 bytes a parameter (masters and moments) of the unsharded optimizer."""
    path, tok = tiny
    group = train_group(path, tok, tmp_path / "dp2", use_distributed_optimizer=True, bf16=True)
    local = local_trainer(trainer_kwargs(path, tok, bf16=True, **LAYOUT))
    for step in range(STEPS):
        local.train_rollout(batch(tok, 4), step)
        assert_equal(group["weights"][step], local.hf_state_dict(include_tied_lm_head=False))
        if step == 1:
            local.save(tmp_path / "dp1", step=1)
    assert_state_equal(checkpoint_state(group["ckpt"]), checkpoint_state(tmp_path / "dp1"))
    assert group["bytes"] == pytest.approx(local.optimizer_state_bytes() / 2, rel=0.01)


def test_cli_run_with_the_distributed_optimizer(dp2_cli_run):
    """`sluiceway run --actor-num-gpus-per-node 2 --use-distributed-optimizer`: a DP=2 group with the sharded
    optimizer trains two steps and checkpoints in the unsharded layout, its digests recorded. The session's run
    (tests/integration/conftest.py), whose listening sockets test_loopback_sockets.py checks."""
    run_dir = dp2_cli_run.run_dir
    assert dp2_cli_run.returncode == 0, dp2_cli_run.stdout + dp2_cli_run.stderr
    assert "step   2/2  reward" in dp2_cli_run.stdout
    log = (run_dir / "trainer" / "trainer.log").read_text()
    assert log.count("trainer group ready: 2 ranks, tensor parallel 1, distributed optimizer") == 1
    ckpt = run_dir / "checkpoints" / "latest"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert sorted(meta.pop("files")) == ["tp0.pt"] and checkpoint_problem(ckpt) is None
    assert meta == {"step": 1, "weight_version": 2, "tensor_parallel": 1}
    state = torch.load(ckpt / "tp0.pt", map_location="cpu", weights_only=False)
    moments = state["optimizer"]["state"]
    shapes = [t.shape for k, t in state["model"].items() if not k.endswith("_extra_state")]
    assert [m["exp_avg"].shape for m in moments.values()] == shapes  # one full-shape entry per parameter
