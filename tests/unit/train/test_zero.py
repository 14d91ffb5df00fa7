"""`use_distributed_optimizer` in one process (a DP group of one, so the shard is the whole model): the policy and
PPO's critic step bit-identically to the unsharded optimizer, in fp32 and with bf16 compute over fp32 masters, and
checkpoints move between the two in both directions. The DP=2 groups: tests/integration/test_distributed_optimizer.py.
"""

import pytest
import torch
from trainer_group_helpers import batch

from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
from sluiceway.tasks.train.trainer import PolicyTrainer


def make(path, tok, sharded, bf16):
    training = TrainingConfig(global_batch_size=8, micro_batch_size=2, lr=1e-2, clip_grad=0.5, bf16=bf16,
                              hf_checkpoint=str(path), use_distributed_optimizer=sharded)  # fmt: skip
    algorithm = AlgorithmConfig(advantage_estimator="ppo")
    return PolicyTrainer(path, training, algorithm, temperature=0.8, pad_token_id=tok.pad_token_id)


def same_weights(a, b):
    for x, y in ((a.model, b.model), (a.critic.model, b.critic.model)):
        assert all(torch.equal(p, q) for p, q in zip(x.parameters(), y.parameters()))
    sa, sb = a.hf_state_dict(), b.hf_state_dict()  # from the fp32 masters
    return set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_sharded_steps_and_checkpoints_match_the_unsharded_optimizer(tiny, tmp_path, bf16):
    path, tok = tiny
    plain, sharded = make(path, tok, False, bf16), make(path, tok, True, bf16)
    assert sharded.zero is not None and sharded.critic.zero is not None and plain.zero is None
    for step in range(2):
        plain.train_rollout(batch(tok), step)
        sharded.train_rollout(batch(tok), step)
        assert same_weights(plain, sharded)
    per_param = 12 if bf16 else 8  # masters (bf16 only) and two moments, fp32
    n = sum(p.numel() for m in (sharded.model, sharded.critic.model) for p in m.parameters())
    assert sharded.optimizer_state_bytes() == pytest.approx(per_param * n, rel=1e-3)
    assert plain.optimizer_state_bytes() == pytest.approx(per_param * n, rel=1e-3)
    plain.save(tmp_path / "plain", step=1)
    sharded.save(tmp_path / "sharded", step=1)
    crossed = [make(path, tok, True, bf16), make(path, tok, False, bf16)]
    assert crossed[0].load(tmp_path / "plain") == 1 and crossed[1].load(tmp_path / "sharded") == 1
    for t in [plain, *crossed]:
        t.train_rollout(batch(tok), 2)
    assert same_weights(plain, crossed[0]) and same_weights(plain, crossed[1])
