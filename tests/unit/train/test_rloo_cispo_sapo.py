"""RLOO (`--advantage-estimator rloo`), CISPO and SAPO (`--policy-loss cispo|sapo`) checked by hand.

Every expected number is written out as arithmetic in the test (as in test_algorithm_family.py); no test compares an
implementation with itself, except where policy_objective is checked to be its documented pieces put together.
"""

import math

import pytest
import torch

from sluiceway.flows.cli import make_parser, resolve_config
from sluiceway.flows.config import AlgorithmConfig
from sluiceway.infra.errors import UserError
from sluiceway.tasks.train.advantages import group_advantages, rloo_advantages
from sluiceway.tasks.train.losses import (
    aggregate,
    cispo_loss,
    kl_penalty,
    policy_objective,
    ppo_clip_loss,
    sapo_loss,
    tis_weights,
)


def close(a, b, atol=1e-6):
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, atol=atol), (a.tolist(), b.tolist())


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


# --------------------------------------------------------------------------- RLOO


@pytest.mark.parametrize("normalize_by_std", [True, False])
def test_rloo_leave_one_out_baseline_by_hand(normalize_by_std):
    rewards = torch.tensor([1.0, 3.0, 5.0, 0.0, 1.0, 7.0, 4.0, 4.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3])
    adv = group_advantages(rewards, groups, "rloo", normalize_by_std)
    expected = [
        1 - (3 + 5) / 2,  # group 0 = {1, 3, 5}: each reward minus the mean of the other two
        3 - (1 + 5) / 2,
        5 - (1 + 3) / 2,
        0 - 1,  # group 1 = {0, 1}: the other sample's reward is the baseline
        1 - 0,
        0.0,  # group 2 holds one sample: no other sample, no baseline, advantage 0
        4 - 4,  # group 3 = {4, 4}: equal rewards, no signal
        4 - 4,
    ]
    # normalize_advantages_by_std is GRPO's option: rloo never divides by the group's std.
    close(adv, expected)


def test_rloo_is_dr_grpo_scaled_by_n_over_n_minus_one():
    r = torch.tensor([0.2, 0.9, 0.4, 0.5], dtype=torch.float64)
    # mean 0.5, n = 4: n/(n-1) * (r - mean) = 4/3 * [-0.3, 0.4, -0.1, 0]
    close(rloo_advantages(r), [4 / 3 * -0.3, 4 / 3 * 0.4, 4 / 3 * -0.1, 0.0], atol=1e-12)
    dr = group_advantages(r.float(), torch.zeros(4, dtype=torch.long), "dr_grpo")
    close(group_advantages(r.float(), torch.zeros(4, dtype=torch.long), "rloo"), 4 / 3 * dr)
    assert rloo_advantages(torch.tensor([3.0])).tolist() == [0.0]


# --------------------------------------------------------------------------- CISPO


def cispo_batch():
    # old log-prob 0: the ratios are exp(logp) = 1.5, 0.5, 1.1, 1.0
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.0]], dtype=torch.float64)).requires_grad_()
    old = torch.zeros(1, 4, dtype=torch.float64)
    adv = torch.tensor([[2.0, -1.0, 1.0, -3.0]], dtype=torch.float64)
    return logp, old, adv


def test_cispo_loss_and_gradient_by_hand():
    logp, old, adv = cispo_batch()
    loss, clipped = cispo_loss(logp, old, adv, 0.2, 0.28)  # weight clip [0.8, 1.28]
    # weights: clip(1.5) = 1.28, clip(0.5) = 0.8, 1.1 and 1.0 inside; L = -w * A * logp
    close(
        loss,
        [
            [
                -1.28 * 2.0 * math.log(1.5),
                -0.8 * -1.0 * math.log(0.5),
                -1.1 * 1.0 * math.log(1.1),
                -1.0 * -3.0 * 0.0,
            ]
        ],
        atol=1e-12,
    )
    assert clipped.tolist() == [[1.0, 1.0, 0.0, 0.0]]
    loss.sum().backward()
    # The weight is a constant: dL/dlogp = -w * A exactly. Were the weight differentiated, the unclipped tokens would
    # get an extra -A * logp * r (token 2: -1 * log 1.1 * 1.1 = -0.105).
    close(logp.grad, [[-1.28 * 2.0, -0.8 * -1.0, -1.1 * 1.0, -1.0 * -3.0]], atol=1e-12)


def test_cispo_keeps_the_gradient_of_tokens_ppo_clips_out():
    logp, old, adv = cispo_batch()
    ppo, ppo_clipped = ppo_clip_loss(logp, old, adv, 0.2, 0.28)
    ppo.sum().backward()
    # PPO drops token 0 (A > 0, r = 1.5 > 1.28) and token 1 (A < 0, r = 0.5 < 0.8): no gradient at all.
    assert ppo_clipped[0, :2].tolist() == [1.0, 1.0] and logp.grad[0, :2].tolist() == [0.0, 0.0]
    logp.grad = None
    cispo, _ = cispo_loss(logp, old, adv, 0.2, 0.28)
    cispo.sum().backward()
    close(logp.grad[0, :2], [-1.28 * 2.0, 0.8])  # CISPO still pushes them, with the capped weight


def test_cispo_without_a_lower_bound():
    logp, old, adv = cispo_batch()
    loss, clipped = cispo_loss(logp, old, adv, 1.0, 0.28)  # eps_low 1: bounds [0, 1.28], MiniMax-M1's setting
    loss.sum().backward()
    assert clipped.tolist() == [[1.0, 0.0, 0.0, 0.0]]  # only the upper clip remains
    close(logp.grad, [[-1.28 * 2.0, -0.5 * -1.0, -1.1 * 1.0, 3.0]], atol=1e-12)


# --------------------------------------------------------------------------- SAPO


def test_sapo_loss_and_gradient_by_hand():
    # ratios 1.0, 1.5, 0.5, 1.0; tau = 1 where A > 0 (tokens 0, 1) and 2 where A < 0 (tokens 2, 3)
    logp = torch.log(torch.tensor([[1.0, 1.5, 0.5, 1.0]], dtype=torch.float64)).requires_grad_()
    old = torch.zeros(1, 4, dtype=torch.float64)
    adv = torch.tensor([[1.0, 2.0, -1.0, -2.0]], dtype=torch.float64)
    loss, clipped = sapo_loss(logp, old, adv, tau_pos=1.0, tau_neg=2.0)
    # L = -A * (4 / tau) * sigmoid(tau * (r - 1))
    close(
        loss,
        [
            [
                -1.0 * 4.0 * 0.5,  # sigmoid(0) = 1/2: -2
                -2.0 * 4.0 * sigmoid(0.5),
                1.0 * (4.0 / 2.0) * sigmoid(2.0 * -0.5),
                2.0 * (4.0 / 2.0) * 0.5,  # 2
            ]
        ],
        atol=1e-12,
    )
    assert clipped.tolist() == [[0.0, 0.0, 0.0, 0.0]]  # no hard clip
    loss.sum().backward()

    # dL/dlogp = -A * g * r with the gate g = 4 s (1 - s), s = sigmoid(tau (r - 1))
    def gate(tau, r):
        s = sigmoid(tau * (r - 1.0))
        return 4.0 * s * (1.0 - s)

    expected = [
        -1.0 * 1.0 * 1.0,  # r = 1: g = 1, the on-policy gradient -A, as PPO's
        -2.0 * gate(1.0, 1.5) * 1.5,  # = -2 * 0.940015 * 1.5 = -2.820044
        1.0 * gate(2.0, 0.5) * 0.5,  # = 0.786448 * 0.5 = 0.393224
        2.0 * 1.0 * 1.0,
    ]
    close(logp.grad, [expected], atol=1e-12)
    assert logp.grad[0, 1].item() == pytest.approx(-2.820044, abs=1e-6)


def test_sapo_gate_is_soft_narrower_for_a_larger_tau_and_tends_to_the_unclipped_surrogate():
    r = torch.tensor([0.3, 0.8, 0.99, 1.0, 1.01, 1.3, 3.0], dtype=torch.float64)
    adv = torch.ones(1, 7, dtype=torch.float64)

    def grad(tau_pos, a=adv):
        logp = torch.log(r).unsqueeze(0).requires_grad_()
        sapo_loss(logp, torch.zeros_like(logp), a, tau_pos, tau_pos)[0].sum().backward()
        return logp.grad[0]

    unclipped = -r  # d(-A r)/dlogp = -A r with A = 1
    g1, g5 = grad(1.0), grad(5.0)
    # Every gradient has the unclipped surrogate's sign and at most its size, equal at r = 1 (gate 1 there).
    assert ((g1 / unclipped) > 0).all() and ((g1 / unclipped) <= 1 + 1e-12).all()
    assert g1[3].item() == pytest.approx(-1.0) and g5[3].item() == pytest.approx(-1.0)
    # Smooth: no jump across r = 1 (PPO's clip jumps from -r to 0 at the clip boundary instead).
    assert abs(g1[2].item() - g1[4].item()) < 0.03
    # A larger temperature damps off-policy tokens more: the gate -g/unclipped is smaller away from r = 1.
    off = torch.tensor([0, 1, 5, 6])
    assert ((g5 / unclipped)[off] < (g1 / unclipped)[off]).all()
    # tau -> 0: the gate tends to 1 and the gradient to the unclipped surrogate's -A r.
    close(grad(1e-4), unclipped.unsqueeze(0)[0], atol=1e-6)


def test_sapo_uses_tau_neg_for_negative_advantages():
    logp = torch.log(torch.tensor([[1.5, 1.5]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    sapo_loss(logp, torch.zeros_like(logp), adv, 1.0, 1.05)[0].sum().backward()
    # same |A| and ratio, the negative-advantage token's gate uses tau_neg = 1.05 > tau_pos: it is damped more
    s_pos, s_neg = sigmoid(0.5), sigmoid(1.05 * 0.5)
    close(logp.grad, [[-4 * s_pos * (1 - s_pos) * 1.5, 4 * s_neg * (1 - s_neg) * 1.5]], atol=1e-12)
    assert abs(logp.grad[0, 1]) < abs(logp.grad[0, 0])


def test_sapo_extreme_ratio_gives_a_finite_loss_and_zero_gradient():
    logp = torch.tensor([[60.0, -60.0]], requires_grad=True)
    loss, _ = sapo_loss(logp, torch.zeros_like(logp), torch.tensor([[1.0, -1.0]]), 1.0, 1.05)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all()
    assert logp.grad.abs().max().item() < 1e-6


# --------------------------------------------------------------------------- policy_objective and the config


def tensors(seed=0, n=3, w=5):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(n, w, generator=g) * 3).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(n, w, generator=g)
    rollout = old + 0.1 * torch.randn(n, w, generator=g)
    ref = old + 0.2 * torch.randn(n, w, generator=g)
    adv = torch.randn(n, 1, generator=g).expand(n, w).clone()
    mask = (torch.rand(n, w, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    entropy = torch.rand(n, w, generator=g).requires_grad_()
    return logp, old, rollout, ref, adv, mask, entropy


@pytest.mark.parametrize("policy_loss", ["cispo", "sapo"])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_policy_objective_with_cispo_and_sapo(policy_loss, mode):
    a = AlgorithmConfig(advantage_estimator="rloo", policy_loss=policy_loss, loss_agg_mode=mode, eps_clip_high=0.28,
                        sapo_tau_pos=0.9, sapo_tau_neg=1.2, use_tis=True, use_kl_loss=True, kl_loss_coef=0.1,
                        entropy_coef=0.01)  # fmt: skip
    logp, old, rollout, ref, adv, mask, entropy = tensors()
    n_tokens, n_seqs, max_len = 20.0, 6.0, 8.0
    loss, stats = policy_objective(logp, old, adv, mask, a, entropy=entropy, rollout_logp=rollout, ref_logp=ref,
                                   n_tokens=n_tokens, n_seqs=n_seqs, max_response_len=max_len)  # fmt: skip
    denom = {"token_mean": n_tokens, "seq_mean_token_mean": n_seqs}.get(mode, max_len)
    kw = {"num_seqs": n_seqs} if mode == "seq_mean_token_sum_norm" else {}
    if policy_loss == "cispo":
        pg, clipped = cispo_loss(logp, old, adv, 0.2, 0.28)
    else:
        pg, clipped = sapo_loss(logp, old, adv, 0.9, 1.2)
    pg = pg * tis_weights(old, rollout, a.tis_clip, a.tis_clip_low)
    kl = aggregate(kl_penalty(logp, ref, a.kl_loss_type), mask, mode, denom, **kw)
    ent = aggregate(entropy, mask, mode, denom, **kw)
    assert torch.equal(loss, aggregate(pg, mask, mode, denom, **kw) + 0.1 * kl - 0.01 * ent)
    assert stats["clipfrac"] == pytest.approx(float((clipped * mask).sum()) / n_tokens)
    if policy_loss == "cispo":
        assert stats["clipfrac"] > 0  # old differs from logp by ~0.3 in log space: some weights are clipped
    else:
        assert stats["clipfrac"] == 0.0
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad.abs().sum() > 0


def cfg_from(argv):
    return resolve_config(make_parser().parse_args(argv))


def test_policy_loss_flags_and_their_conflicts():
    base = ["run", "--prompt-data", "env:arithmetic"]
    cfg = cfg_from([*base, "--advantage-estimator", "rloo", "--policy-loss", "sapo", "--sapo-tau-neg", "1.5"])
    a = cfg.algorithm
    assert (a.advantage_estimator, a.policy_loss, a.sapo_tau_pos, a.sapo_tau_neg) == ("rloo", "sapo", 1.0, 1.5)
    assert cfg_from(base).algorithm.policy_loss == "ppo_clip"
    with pytest.raises(UserError, match="gspo and eps_clip_c need ppo_clip"):
        cfg_from([*base, "--advantage-estimator", "gspo", "--policy-loss", "cispo"])
    with pytest.raises(UserError, match="gspo and eps_clip_c need ppo_clip"):
        cfg_from([*base, "--policy-loss", "sapo", "--eps-clip-c", "3"])
    with pytest.raises(UserError, match="n_samples_per_prompt >= 2"):
        cfg_from([*base, "--advantage-estimator", "rloo", "--n-samples-per-prompt", "1", "--global-batch-size",
                  "8", "--micro-batch-size", "8"])  # fmt: skip
