"""The long-lived torchrun trainer group over gloo on tiny-llama, against the in-process trainer.

TP=2 and DP=2 compute the same losses and full-model gradients as TP=1/DP=1 (1e-5, fp32); packing samples into
rows by token budget, or laying a prompt's samples out in one row with the prompt once, changes neither; a group
driven step after step and checkpointed resumes bit-identically.
"""

import pytest
import torch
from trainer_group_helpers import assert_same, batch, local_trainer, trainer_kwargs

from sluiceway.tasks.train.remote import RemoteTrainer, TrainerGroupError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.parametrize("layout", [{"tp": 2}, {"tp": 1}], ids=["tp2", "dp2"])
def test_tensor_and_data_parallel_match_one_process(tiny, tmp_path, layout):
    """The group shares prompts (the default); the reference lays out one sample per row."""
    path, tok = tiny
    ref = local_trainer(trainer_kwargs(path, tok, share_prompts=False)).gradients(batch(tok), step=0)
    group = RemoteTrainer(trainer_kwargs(path, tok, **layout), nproc=2, work_dir=tmp_path)
    try:
        assert group.world_size == 2
        assert_same(group.gradients(batch(tok), step=0), ref)
    finally:
        group.close()
    assert group.proc.returncode == 0


def test_group_resumes_bit_identically(tiny, tmp_path):
    """TP=2 group: 3 steps straight, with a checkpoint written after step 2, vs a new group that loads that
    checkpoint and trains step 3."""
    path, tok = tiny
    kwargs = trainer_kwargs(path, tok, tp=2, num_steps_per_rollout=2, global_batch_size=4)
    straight = RemoteTrainer(kwargs, nproc=2, work_dir=tmp_path / "a")
    try:
        for step in range(2):
            straight.train_rollout(batch(tok), step)
        straight.save(tmp_path / "ckpt", step=1)
        straight.train_rollout(batch(tok), 2)
        final = straight.write_weights(path, tmp_path / "weights_a")
    finally:
        straight.close()
    second = RemoteTrainer(kwargs, nproc=2, work_dir=tmp_path / "c")
    try:
        assert second.load(tmp_path / "ckpt") == 1 and second.weight_version == 2
        second.train_rollout(batch(tok), 2)
        resumed = second.write_weights(path, tmp_path / "weights_c")
        assert second.weight_version == 3
    finally:
        second.close()
    from safetensors.torch import load_file

    a, c = load_file(final / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert set(a) == set(c) and all(torch.equal(a[k], c[k]) for k in a)


def test_a_failing_group_reports_its_error(tiny, tmp_path):
    path, tok = tiny
    kwargs = trainer_kwargs(path, tok, tp=2) | {"hf_dir": str(tmp_path / "no-such-model")}
    with pytest.raises(TrainerGroupError, match="no-such-model"):
        RemoteTrainer(kwargs, nproc=2, work_dir=tmp_path)


@pytest.mark.parametrize(
    "layout", [{"tp": 2}, {"tp": 1}, {"tp": 1, "use_distributed_optimizer": True}], ids=["tp2", "dp2", "dp2-zero"]
)
def test_lora_group_matches_one_process(tiny, tmp_path, layout):
    """--lora-rank in a torchrun group: the adapters' gradients (peft's keys, TP slices merged) and the adapter
    written after a step equal one process's (also with the adapters' optimizer state sharded over DP)."""
    from sluiceway.models.lora import read_adapter_dir

    path, tok = tiny
    lora = dict(lora_rank=4, lora_alpha=8)
    local = local_trainer(trainer_kwargs(path, tok, **lora))
    ref = local.gradients(batch(tok), step=0)
    group = RemoteTrainer(trainer_kwargs(path, tok, **layout, **lora), nproc=2, work_dir=tmp_path)
    try:
        got = group.gradients(batch(tok), step=0)
        assert_same(got, ref)
        assert got[1] and all(".lora_" in k for k in got[1])
        local.train_rollout(batch(tok), 0)
        group.train_rollout(batch(tok), 0)
        _, theirs = read_adapter_dir(group.write_weights(path, tmp_path / "g", adapter_only=True))
        _, ours = read_adapter_dir(local.write_weights(path, tmp_path / "l", adapter_only=True))
        assert set(theirs) == set(ours)
        for k in ours:
            torch.testing.assert_close(theirs[k], ours[k], atol=1e-5, rtol=0, msg=k)
    finally:
        group.close()
