"""Advantages equal slime's, verl's and TRL's where the three agree (docs/algorithms.md), worked out by hand.

The peers' definitions, as read at slime 624b824a, verl 1dda039b and TRL f2cd5771:
- GRPO: (r - mean_group) / (std_group + eps) with torch's default std, the sample std (n - 1) -- slime
  `_post_process_rewards`, verl `compute_grpo_outcome_advantage`, TRL `GRPOTrainer` (eps 1e-4 there).
- REINFORCE++-baseline: r - mean_group broadcast to every response token, then whitened over all trained tokens
  of the batch with a Bessel-corrected variance, (x - mean) * rsqrt(var + 1e-8) -- slime
  `get_reinforce_plus_plus_baseline_advantages` + `distributed_masked_whiten`, verl
  `compute_reinforce_plus_plus_baseline_outcome_advantage` + `masked_whiten`.
"""

import pyarrow as pa
import pytest
import torch

from sluiceway.tasks.train.advantages import group_advantages, masked_whiten
from sluiceway.tasks.train.batch import build_train_samples


def test_grpo_smallest_case_uses_the_sample_std():
    # One group, rewards (1, 0): mean 0.5, centred (+0.5, -0.5).
    # Sample std: sqrt((0.25 + 0.25) / (2 - 1)) = sqrt(0.5) = 0.70711 -> +-0.5 / 0.70711 = +-0.70711 (all three peers).
    # The population std (0.5) would give +-1.0: sqrt(n / (n - 1)) = 1.414 times larger.
    adv = group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), "grpo")
    assert adv.tolist() == pytest.approx([0.70711, -0.70711], abs=1e-5)


def test_grpo_group_of_four():
    # Rewards (1, 1, 0, 0): mean 0.5, centred +-0.5, squared deviations 4 x 0.25 = 1, sample var 1/3,
    # std 0.57735 -> +-0.86603 (the population std 0.5 gave +-1.0: x1.155 at n = 4, as the issue measured).
    adv = group_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long), "grpo")
    assert adv.tolist() == pytest.approx([0.86603, 0.86603, -0.86603, -0.86603], abs=1e-5)


def test_grpo_singleton_and_identical_groups_give_zero_never_nan():
    # A group of one: its n - 1 std is undefined (torch gives nan); the guard makes it 0, as its centred reward is.
    # A group of equal rewards: centred 0, std 0 -> 0 / (0 + 1e-6) = 0.
    adv = group_advantages(torch.tensor([0.7, 1.0, 1.0]), torch.tensor([0, 1, 1]), "grpo")
    assert adv.tolist() == [0.0, 0.0, 0.0]


# Three groups of two; rewards (1, 0 | 1, 0 | 0.2, 0); trained (loss-mask) tokens (2, 2 | 1, 12 | 1, 1).
RPP_REWARDS = [1.0, 0.0, 1.0, 0.0, 0.2, 0.0]
RPP_GROUPS = [0, 0, 1, 1, 2, 2]
RPP_TOKENS = [2, 2, 1, 12, 1, 1]
# Centred per group: (0.5, -0.5, 0.5, -0.5, 0.1, -0.1), each value on each of the sample's trained tokens.
# Tokens N = 2 + 2 + 1 + 12 + 1 + 1 = 19.
# Mean over tokens: (0.5*2 - 0.5*2 + 0.5*1 - 0.5*12 + 0.1 - 0.1) / 19 = -5.5 / 19 = -0.289474.
# Deviations: 0.789474 (x3 tokens), -0.210526 (x14), 0.389474 (x1), 0.189474 (x1);
# squared sum: 3 x 0.623269 + 14 x 0.044321 + 0.151690 + 0.035900 = 2.677895.
# Bessel-corrected variance 2.677895 / 18 = 0.148772, std 0.385710.
# Advantages: 0.789474 / 0.385710 = 2.04681, -0.210526 / 0.385710 = -0.54582,
#             0.389474 / 0.385710 = 1.00976,  0.189474 / 0.385710 = 0.49123 (verl's values in the issue).
RPP_EXPECTED = [2.04681, -0.54582, 2.04681, -0.54582, 1.00976, 0.49123]


def test_reinforce_pp_baseline_whitens_over_trained_tokens():
    adv = group_advantages(
        torch.tensor(RPP_REWARDS), torch.tensor(RPP_GROUPS), "reinforce_plus_plus_baseline",
        token_counts=torch.tensor(RPP_TOKENS),
    )  # fmt: skip
    assert adv.tolist() == pytest.approx(RPP_EXPECTED, abs=1e-4)


def test_reinforce_pp_baseline_equals_whitening_the_broadcast_tokens():
    # The same numbers the peers' way: broadcast each centred reward over its tokens, whiten the flat token list.
    centred = [0.5, -0.5, 0.5, -0.5, 0.1, -0.1]
    flat = torch.tensor([c for c, n in zip(centred, RPP_TOKENS) for _ in range(n)], dtype=torch.float64)
    whitened = masked_whiten(flat, torch.ones_like(flat))
    firsts = [sum(RPP_TOKENS[:i]) for i in range(len(RPP_TOKENS))]
    assert [whitened[i].item() for i in firsts] == pytest.approx(RPP_EXPECTED, abs=1e-4)


def test_reinforce_pp_baseline_needs_token_counts():
    with pytest.raises(ValueError, match="token_counts"):
        group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), "reinforce_plus_plus_baseline")


def _table(rewards, groups, trained, untrained=0):
    """A step's trajectory rows as build_train_samples reads them: `untrained` masked (tool) tokens each."""
    rows = []
    for i, (r, g, n) in enumerate(zip(rewards, groups, trained)):
        mask = [1] * n + [0] * untrained
        rows.append({"group_id": g, "sample_index": i, "status": "completed", "filter_reason": None, "reward": r,
                     "prompt_token_ids": [1, 2], "response_token_ids": [5] * len(mask), "loss_mask": mask,
                     "rollout_logprobs": [-1.0] * len(mask)})  # fmt: skip
    return pa.Table.from_pylist(rows)


def test_the_step_batch_weighs_each_sample_by_its_trained_tokens():
    # Masked (tool) tokens do not count: 3 of them on every sample leave the token counts, and the result, unchanged.
    samples = build_train_samples(_table(RPP_REWARDS, RPP_GROUPS, RPP_TOKENS, untrained=3),
                                  "reinforce_plus_plus_baseline", True)  # fmt: skip
    assert [s.advantage for s in samples] == pytest.approx(RPP_EXPECTED, abs=1e-4)


def test_gspo_shares_grpo_advantages():
    table = _table([1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0], [3, 1, 4, 2])
    grpo = [s.advantage for s in build_train_samples(table, "grpo", True)]
    gspo = [s.advantage for s in build_train_samples(table, "gspo", True)]
    # GRPO's group of four (1, 0, 0, 1): +-0.5 / sqrt(1/3) = +-0.86603, whatever the lengths.
    assert gspo == grpo == pytest.approx([0.86603, -0.86603, -0.86603, 0.86603], abs=1e-5)
