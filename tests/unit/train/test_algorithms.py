"""GRPO advantages, the PPO-clip loss, KL estimators, answer extraction, and prompt scheduling."""

import pytest
import torch

from sluiceway.tasks.reward.math_answer import extract_answer, math_reward
from sluiceway.tasks.rollout.rollout import prompt_indices_for_step
from sluiceway.tasks.train.advantages import group_advantages
from sluiceway.tasks.train.losses import aggregate, kl_penalty, ppo_clip_loss


def test_grpo_advantages_are_group_standardised():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = group_advantages(rewards, groups, "grpo")
    # mean 0.5, sample std sqrt(4 x 0.25 / 3) = 1/sqrt(3): +-0.5 x sqrt(3) = +-0.8660
    h = 0.5 * 3**0.5
    assert torch.allclose(adv[:4], torch.tensor([h, -h, -h, h]), atol=1e-4)
    assert torch.equal(adv[4:], torch.zeros(4))  # no spread, no signal, no NaN


def test_dr_grpo_does_not_scale_by_std():
    adv = group_advantages(torch.tensor([2.0, 0.0]), torch.tensor([0, 0]), "dr_grpo")
    assert adv.tolist() == [1.0, -1.0]


def test_reinforce_pp_baseline_whitens_the_batch():
    adv = group_advantages(
        torch.tensor([3.0, 0.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1]), "reinforce_plus_plus_baseline",
        token_counts=torch.ones(4),
    )  # fmt: skip
    assert abs(adv.mean().item()) < 1e-6 and abs(adv.std().item() - 1) < 1e-4


def test_ppo_clip_stops_gradient_outside_the_trust_region():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.5, 0.05]], requires_grad=True)  # ratios e^0.5 (clipped) and e^0.05 (inside)
    loss, clipped = ppo_clip_loss(logp, old, torch.ones(1, 2), 0.2, 0.2)
    loss.sum().backward()
    assert clipped.tolist() == [[1.0, 0.0]]
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] < 0


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_is_zero_at_the_reference(kind):
    x = torch.randn(3, 5)
    assert torch.allclose(kl_penalty(x, x, kind), torch.zeros(3, 5))


def test_k3_is_non_negative():
    assert (kl_penalty(torch.randn(100), torch.randn(100), "k3") >= 0).all()


def test_token_mean_weighs_tokens_and_seq_mean_weighs_sequences():
    per_token = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(per_token, mask, "token_mean", 4).item() == pytest.approx(7 / 4)
    assert aggregate(per_token, mask, "seq_mean_token_mean", 2).item() == pytest.approx((1 + 4) / 2)


@pytest.mark.parametrize(
    "text,answer",
    [
        ("7 + 8 = 15", "15"),
        ("The answer is 12.", "12"),
        ("so \\boxed{\\frac{1}{2}} or \\boxed{3}", "3"),
        ("1,234 apples", "1,234"),
        ("no digits here", None),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_math_reward_compares_numbers():
    assert math_reward("The answer is 1,234.", "1234")[0] == 1.0
    assert math_reward("\\boxed{\\frac{1}{2}}", "0.5")[0] == 1.0
    assert math_reward("3 + 4 = 8", "7")[0] == 0.0


def test_prompt_schedule_covers_each_epoch_once():
    seen = [i for step in range(5) for i in prompt_indices_for_step(10, step, 4, seed=1)]
    assert sorted(seen[:10]) == list(range(10))  # the first epoch is a permutation
    assert len(seen) == 20
