"""Hand-computed checks of the advantage estimators and losses in tasks/train/{advantages,losses}.py.

Every expected number is written out as arithmetic in the test; no test compares an implementation with itself.
"""

import math

import pytest
import torch

from sluiceway.tasks.train.advantages import (
    gae,
    group_advantages,
    masked_whiten,
    reinforce_pp_returns,
    terminal_rewards,
)
from sluiceway.tasks.train.losses import (
    aggregate,
    gspo_loss,
    ppo_clip_loss,
    ppo_clip_loss_with_stats,
    sft_loss,
    tis_weights,
    value_loss,
)


def close(a, b, atol=1e-5):
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, atol=atol), (a.tolist(), b.tolist())


# --------------------------------------------------------------------------- group estimators


@pytest.mark.parametrize(
    "estimator,expected",
    [
        # group 0 = {1, 3}: mean 2, sample std sqrt(2) -> centred [-1, 1], /std -> [-1/sqrt(2), 1/sqrt(2)]
        # groups 1 and 2 hold one sample each: 0 (no n - 1 std); group 3 = {4, 4} has equal rewards: 0
        ("grpo", [-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0, 0.0, 0.0, 0.0]),
        ("dr_grpo", [-1.0, 1.0, 0.0, 0.0, 0.0, 0.0]),
        # centred [-1, 1, 0, 0, 0, 0], one token each: batch mean 0, var 2/5 -> +-1/sqrt(0.4) = +-sqrt(2.5)
        ("reinforce_plus_plus_baseline", [-math.sqrt(2.5), math.sqrt(2.5), 0.0, 0.0, 0.0, 0.0]),
    ],
)
def test_group_estimators_with_singletons_and_equal_rewards(estimator, expected):
    rewards = torch.tensor([1.0, 3.0, 0.0, 5.0, 4.0, 4.0])
    groups = torch.tensor([0, 0, 1, 2, 3, 3])
    adv = group_advantages(rewards, groups, estimator, token_counts=torch.ones(6))
    assert torch.isfinite(adv).all()
    close(adv, expected, atol=1e-4)


# --------------------------------------------------------------------------- terminal rewards


def test_terminal_rewards_go_on_the_last_trained_token():
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    out = terminal_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    # row 0: last trained token 1 (right padding); row 1: token 2 (a masked token in the middle); row 2: none
    close(out, [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]])


# --------------------------------------------------------------------------- GAE

# Row 0: tokens [policy, env (masked), policy, pad]; terminal reward 1 on token 2. V = [0.5, 9 (ignored), 0.2, 7].
# Row 1: tokens [policy, policy, pad, pad];        terminal reward 0 on token 1. V = [0.3, 0.1, ...].
GAE_MASK = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
GAE_V = torch.tensor([[0.5, 9.0, 0.2, 7.0], [0.3, 0.1, -4.0, 5.0]])
GAE_R = terminal_rewards(torch.tensor([1.0, 0.0]), GAE_MASK)


def test_gae_by_hand_with_a_masked_middle_token_and_right_padding():
    adv, ret = gae(GAE_R, GAE_V, GAE_MASK, gamma=0.9, lam=0.5)
    # row 0, token 2 (last): delta = 1 + 0 - 0.2 = 0.8, A = 0.8
    # row 0, token 0: next trained token is 2 -> delta = 0 + 0.9*0.2 - 0.5 = -0.32, A = -0.32 + 0.9*0.5*0.8 = 0.04
    # row 1, token 1 (last): delta = 0 - 0.1 = -0.1, A = -0.1
    # row 1, token 0: delta = 0 + 0.9*0.1 - 0.3 = -0.21, A = -0.21 + 0.45*(-0.1) = -0.255
    close(adv, [[0.04, 0.0, 0.8, 0.0], [-0.255, -0.1, 0.0, 0.0]])
    # returns = A + V on trained tokens: 0.54, 1.0; 0.045, 0.0
    close(ret, [[0.54, 0.0, 1.0, 0.0], [0.045, 0.0, 0.0, 0.0]])


def test_gae_lam_one_is_monte_carlo_return_minus_value():
    adv, ret = gae(GAE_R, GAE_V, GAE_MASK, gamma=0.9, lam=1.0)
    # row 0: G = [0.9*1, -, 1] (the env token is not a step), A = G - V = [0.9 - 0.5, 1 - 0.2] = [0.4, 0.8]
    # row 1: G = [0, 0], A = [-0.3, -0.1]
    close(adv, [[0.4, 0.0, 0.8, 0.0], [-0.3, -0.1, 0.0, 0.0]])
    close(ret, [[0.9, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # lam = 1: returns are the MC returns


def test_gae_lam_zero_is_one_step_td():
    adv, ret = gae(GAE_R, GAE_V, GAE_MASK, gamma=0.9, lam=0.0)
    # A_t = delta_t: row 0 [-0.32, 0.8], row 1 [-0.21, -0.1]; returns r + gamma V_next: [0.18, 1.0], [0.09, 0.0]
    close(adv, [[-0.32, 0.0, 0.8, 0.0], [-0.21, -0.1, 0.0, 0.0]])
    close(ret, [[0.18, 0.0, 1.0, 0.0], [0.09, 0.0, 0.0, 0.0]])


def test_gae_gamma_zero_ignores_the_future():
    adv, _ = gae(GAE_R, GAE_V, GAE_MASK, gamma=0.0, lam=0.95)
    close(adv, [[0.0 - 0.5, 0.0, 1.0 - 0.2, 0.0], [-0.3, -0.1, 0.0, 0.0]])  # A_t = r_t - V_t


def test_gae_masked_tokens_neither_get_advantage_nor_break_the_recursion():
    torch.manual_seed(0)
    r, v = torch.randn(3, 6), torch.randn(3, 6)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 1, 0, 1, 0], [0, 1, 1, 1, 1, 0]], dtype=torch.float32)
    r = r * mask  # rewards only on trained tokens here
    adv, ret = gae(r, v, mask, gamma=0.7, lam=0.6)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()
    for i in range(3):  # the same as running on the compacted row of trained tokens alone
        keep = mask[i] > 0
        a_c, r_c = gae(r[i, keep][None], v[i, keep][None], torch.ones(1, int(keep.sum())), gamma=0.7, lam=0.6)
        close(adv[i, keep], a_c[0])
        close(ret[i, keep], r_c[0])
    # the values on masked tokens are never read
    v2 = torch.where(mask > 0, v, torch.full_like(v, 1e6))
    close(gae(r, v2, mask, gamma=0.7, lam=0.6)[0], adv)


def test_gae_reward_on_a_masked_env_token_goes_to_the_preceding_action():
    r = torch.tensor([[0.0, 2.0, 1.0]])  # 2 is an environment reward on a masked (env) token
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv, _ = gae(r, torch.zeros(1, 3), mask, gamma=0.5, lam=1.0)
    # token 2: A = 1; token 0: r_eff = 0 + 2 (undiscounted), A = 2 + 0.5*1 = 2.5
    close(adv, [[2.5, 0.0, 1.0]])


def test_gae_whitening_is_over_trained_tokens_and_leaves_returns_alone():
    adv, ret = gae(GAE_R[:1], GAE_V[:1], GAE_MASK[:1], gamma=0.9, lam=0.5, whiten_advantages=True)
    # raw advantages 0.04 and 0.8: mean 0.42, sample std 0.38 x sqrt(2) -> -+1/sqrt(2)
    close(adv, [[-1 / math.sqrt(2), 0.0, 1 / math.sqrt(2), 0.0]], atol=1e-4)
    close(ret, [[0.54, 0.0, 1.0, 0.0]])


def test_gae_carries_no_gradient():
    v = GAE_V.clone().requires_grad_(True)
    adv, ret = gae(GAE_R, v, GAE_MASK)
    assert not adv.requires_grad and not ret.requires_grad


# --------------------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_returns_with_kl_shaping_by_hand():
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])  # the 9 is on a padding token: ignored
    adv = reinforce_pp_returns(rewards, mask, kl, kl_coef=0.5, gamma=1.0)
    # token rewards: row 0 [-0.05, -0.1, -0.15 + 1 = 0.85], row 1 [-0.2, -0.25]
    # returns (suffix sums): row 0 [0.7, 0.75, 0.85], row 1 [-0.45, -0.25]
    g = [0.7, 0.75, 0.85, -0.45, -0.25]
    mean = sum(g) / 5  # 0.32
    std = math.sqrt(sum((x - mean) ** 2 for x in g) / 4)  # sqrt(1.528 / 4): Bessel-corrected, n - 1
    w = [(x - mean) / std for x in g]
    close(adv, [[w[0], w[1], w[2]], [w[3], w[4], 0.0]], atol=1e-4)
    assert abs(adv[mask > 0].mean().item()) < 1e-5


def test_reinforce_pp_discounting_and_equal_returns():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = reinforce_pp_returns(torch.tensor([1.0, 0.0]), mask, None, 0.0, gamma=0.5)
    g = [0.25, 0.5, 1.0, 0.0, 0.0]  # 0.5^2, 0.5, 1 ; no reward in row 1
    mean = sum(g) / 5
    std = math.sqrt(sum((x - mean) ** 2 for x in g) / 4)
    close(adv, [[(g[0] - mean) / std, (g[1] - mean) / std, (g[2] - mean) / std], [-mean / std, -mean / std, 0.0]])
    # all returns equal (gamma = 1, same reward, no KL): whitening gives 0, never NaN
    flat = reinforce_pp_returns(torch.tensor([1.0, 1.0]), mask, None, 0.0, gamma=1.0)
    assert torch.equal(flat, torch.zeros(2, 3))


def test_masked_whiten_ignores_masked_values():
    out = masked_whiten(torch.tensor([[1.0, 100.0, 3.0]]), torch.tensor([[1.0, 0.0, 1.0]]))
    close(out, [[-1 / math.sqrt(2), 0.0, 1 / math.sqrt(2)]], atol=1e-4)  # mean 2, sample std sqrt(2) over {1, 3}


# --------------------------------------------------------------------------- PPO clip + dual clip

# one row, old_logp = 0, eps_low = eps_high = 0.2
#   token: A,   r    -> branch
#   0:    +1,  1.5   -> upper clip active: loss = -1 * 1.2 = -1.2, grad 0
#   1:    +1,  0.5   -> unclipped (A > 0, r below the band): loss = -0.5, grad -A r = -0.5
#   2:    -1,  0.5   -> lower clip active: loss = 0.8, grad 0
#   3:    -1,  1.5   -> unclipped: loss = 1.5, grad -A r = 1.5
#   4:    -1,  4.0   -> unclipped 4.0; with clip_c = 3 the dual clip bounds it: 3.0, grad 0
#   5:    -2,  2.5   -> unclipped 5.0; dual bound -A c = 6 > 5: inactive, grad 2 * 2.5 = 5
PPO_A = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0, -2.0]])
PPO_R = torch.tensor([[1.5, 0.5, 0.5, 1.5, 4.0, 2.5]])


def test_ppo_clip_both_sides_by_hand():
    logp = PPO_R.log().requires_grad_(True)
    loss, clipped = ppo_clip_loss(logp, torch.zeros(1, 6), PPO_A, 0.2, 0.2)
    close(loss, [[-1.2, -0.5, 0.8, 1.5, 4.0, 5.0]])
    assert clipped.tolist() == [[1.0, 0.0, 1.0, 0.0, 0.0, 0.0]]
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    close(grad, [[0.0, -0.5, 0.0, 1.5, 4.0, 5.0]])  # d(-A r)/dlogp = -A r


def test_dual_clip_active_and_inactive_by_hand():
    logp = PPO_R.log().requires_grad_(True)
    loss, stats = ppo_clip_loss_with_stats(logp, torch.zeros(1, 6), PPO_A, 0.2, 0.2, clip_c=3.0)
    close(loss, [[-1.2, -0.5, 0.8, 1.5, 3.0, 5.0]])
    assert stats["clipped"].tolist() == [[1.0, 0.0, 1.0, 0.0, 0.0, 0.0]]
    assert stats["clipped_high"].tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    assert stats["clipped_low"].tolist() == [[0.0, 0.0, 1.0, 0.0, 0.0, 0.0]]
    assert stats["dual_clipped"].tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]]
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    close(grad, [[0.0, -0.5, 0.0, 1.5, 0.0, 5.0]])
    # the two-output form agrees and still reports the ordinary clip only
    loss2, clipped2 = ppo_clip_loss(logp, torch.zeros(1, 6), PPO_A, 0.2, 0.2, clip_c=3.0)
    close(loss2, loss.detach())
    assert clipped2.tolist() == stats["clipped"].tolist()
    # without clip_c nothing is dual-clipped
    _, s0 = ppo_clip_loss_with_stats(logp, torch.zeros(1, 6), PPO_A, 0.2, 0.2)
    assert s0["dual_clipped"].sum() == 0
    with pytest.raises(ValueError):
        ppo_clip_loss(logp, torch.zeros(1, 6), PPO_A, 0.2, 0.2, clip_c=1.0)


def test_asymmetric_clip_higher():
    # eps_low = 0.2, eps_high = 0.28 (DAPO): r = 1.25 with A > 0 is inside the band, r = 1.3 is clipped to 1.28
    logp = torch.tensor([[1.25, 1.3]]).log()
    loss, clipped = ppo_clip_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), 0.2, 0.28)
    close(loss, [[-1.25, -1.28]])
    assert clipped.tolist() == [[0.0, 1.0]]


# --------------------------------------------------------------------------- GSPO


def gspo_batch():
    # 4 sequences of 3 tokens, old_logp = 0 except on a masked token (must be ignored)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    logp = torch.tensor(
        [
            [0.3, -0.1, 0.1],  # mean 0.1 -> s = e^0.1 = 1.10517, inside [0.8, 1.2]
            [0.5, 0.3, 7.0],  # mean over 2 trained tokens 0.4 -> s = e^0.4 = 1.49182 (> 1.2)
            [-0.5, -0.3, 7.0],  # mean -0.4 -> s = e^-0.4 = 0.67032 (< 0.8)
            [0.6, 0.2, 0.4],  # mean 0.4 -> s = 1.49182
        ]
    )
    old = torch.zeros(4, 3)
    old[1, 2] = -5.0
    adv = torch.tensor([1.0, 2.0, -1.0, -1.0])
    return logp, old, adv, mask


def test_gspo_sequence_ratio_and_clipping_by_hand():
    logp, old, adv, mask = gspo_batch()
    loss, clipped = gspo_loss(logp, old, adv, mask, 0.2, 0.2)
    s0, s3 = math.exp(0.1), math.exp(0.4)
    expected = [
        [-s0, -s0, -s0],  # A = 1, unclipped: -A s
        [-2 * 1.2, -2 * 1.2, 0.0],  # A = 2, s > 1.2: upper clip, -A * 1.2; masked token 0
        [0.8, 0.8, 0.0],  # A = -1, s < 0.8: lower clip, -A * 0.8
        [s3, s3, s3],  # A = -1, s > 1: unclipped, -A s
    ]
    close(loss, expected)
    assert clipped.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]


def test_gspo_gradient_matches_the_stop_gradient_formula():
    logp, old, adv, mask = gspo_batch()
    logp = logp.clone().requires_grad_(True)
    loss, _ = gspo_loss(logp, old, adv, mask, 0.2, 0.2)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    # d/dlogp_t [-A sg(s) exp(logp_t - sg(logp_t))] = -A s on each trained token where the clip is inactive, else 0
    s0, s3 = math.exp(0.1), math.exp(0.4)
    close(grad, [[-s0, -s0, -s0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [s3, s3, s3]])
    # averaged per sequence (seq_mean_token_mean) it equals the sequence-level GSPO gradient:
    # d/dlogp_t [-A exp(mean_t(logp - old))] = -A s / |y|  (|y| = 3 for rows 0 and 3)
    agg = aggregate(gspo_loss(logp, old, adv, mask, 0.2, 0.2)[0], mask, "seq_mean_token_mean", 1.0)
    (g_agg,) = torch.autograd.grad(agg, logp)
    close(g_agg[0], [-s0 / 3] * 3)
    close(g_agg[3], [s3 / 3] * 3)
    seq_obj = -adv[0] * torch.exp((logp[0] - old[0]).mean())
    (g_seq,) = torch.autograd.grad(seq_obj, logp)
    close(g_agg[0], g_seq[0])


def test_gspo_accepts_per_token_advantages():
    logp, old, adv, mask = gspo_batch()
    a, _ = gspo_loss(logp, old, adv, mask, 0.2, 0.2)
    b, _ = gspo_loss(logp, old, adv[:, None].expand(4, 3), mask, 0.2, 0.2)
    close(a, b)


# --------------------------------------------------------------------------- TIS


def test_tis_weights_clip_high_and_low_and_are_detached():
    old = torch.zeros(1, 3, requires_grad=True)
    rollout = torch.tensor([[-1.0, 0.5, 0.1]])
    # exp(old - rollout) = [e^1 = 2.718 -> 2.0, e^-0.5 = 0.60653, e^-0.1 = 0.90484]
    w = tis_weights(old, rollout, clip_high=2.0)
    close(w, [[2.0, math.exp(-0.5), math.exp(-0.1)]])
    assert not w.requires_grad
    w_low = tis_weights(old, rollout, clip_high=2.0, clip_low=0.8)
    close(w_low, [[2.0, 0.8, math.exp(-0.1)]])
    # used as a per-token multiplier: the policy-gradient still flows through logp only
    logp = torch.zeros(1, 3, requires_grad=True)
    pg, _ = ppo_clip_loss(logp, torch.zeros(1, 3), torch.ones(1, 3), 0.2, 0.2)
    (g,) = torch.autograd.grad((pg * w_low).sum(), logp)
    close(g, [[-2.0, -0.8, -math.exp(-0.1)]])  # -A r w with r = 1
    with pytest.raises(ValueError):
        tis_weights(old, rollout, clip_high=1.0, clip_low=2.0)


# --------------------------------------------------------------------------- value loss


def test_clipped_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.5, 1.0, 2.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5, 1.0]])
    returns = torch.tensor([[2.0, 0.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, clipped = value_loss(values, old, returns, mask, clip=0.2)
    # t0: (1 - 2)^2 = 1; V_clip = 0.5 + 0.2 = 0.7, (0.7 - 2)^2 = 1.69 -> 0.5 * 1.69 = 0.845, clipped term wins
    # t1: V = old: both 0.25 -> 0.125
    # t2: (1 - 0)^2 = 1; V_clip = 0.7, 0.49 -> 0.5 * 1 = 0.5 (unclipped wins)
    # t3: masked -> 0
    close(loss, [[0.845, 0.125, 0.5, 0.0]])
    assert clipped.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    (g,) = torch.autograd.grad(loss.sum(), values)
    # t0: the clipped term is flat in V (clamp saturated) -> 0; t1: V - R = 0.5; t2: V - R = 1; t3 masked
    close(g, [[0.0, 0.5, 1.0, 0.0]])
    plain, _ = value_loss(values, old, returns, mask, clip=None)
    close(plain, [[0.5, 0.125, 0.5, 0.0]])


# --------------------------------------------------------------------------- SFT + aggregation


def test_sft_loss_is_masked_nll():
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    per_token = sft_loss(logp, mask)
    close(per_token, [[1.0, 2.0, 0.0]])
    assert aggregate(per_token, mask, "token_mean", 2).item() == pytest.approx((1 + 2) / 2)


def test_seq_mean_token_sum_norm_divides_by_a_constant_length():
    per_token = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # token sums 3 and 4, each / L_max = 4 -> 0.75 and 1.0; mean over the 2 sequences = 0.875
    assert aggregate(per_token, mask, "seq_mean_token_sum_norm", 4).item() == pytest.approx((3 / 4 + 4 / 4) / 2)
    # as one micro-batch of a 4-sequence global batch: / 4 sequences
    out = aggregate(per_token, mask, "seq_mean_token_sum_norm", 4, num_seqs=4).item()
    assert out == pytest.approx((3 / 4 + 4 / 4) / 4)
    # micro-batches sum to the global value
    parts = sum(
        aggregate(per_token[i : i + 1], mask[i : i + 1], "seq_mean_token_sum_norm", 4, num_seqs=2) for i in (0, 1)
    )
    assert parts.item() == pytest.approx(0.875)
    with pytest.raises(ValueError):
        aggregate(per_token, mask, "no_such_mode", 1)
