"""The objectives in tasks/train/losses.py are their per-token pieces put together as documented, and the LR
schedule of tasks/train/lr_schedule.py has its documented shape (no model: milliseconds)."""

import math

import pytest
import torch

from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
from sluiceway.tasks.train.losses import (
    aggregate,
    gspo_loss,
    kl_penalty,
    policy_objective,
    ppo_clip_loss,
    sft_loss,
    sft_objective,
    tis_weights,
    value_loss,
    value_objective,
)
from sluiceway.tasks.train.lr_schedule import lr_factor, lr_schedule


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


@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_policy_objective_is_surrogate_tis_kl_and_entropy_aggregated(estimator, mode):
    a = AlgorithmConfig(advantage_estimator=estimator, loss_agg_mode=mode, eps_clip_high=0.28, use_tis=True,
                        use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01)  # fmt: skip
    logp, old, rollout, ref, adv, mask, entropy = tensors()
    n_tokens, n_seqs, max_len = 20.0, 6.0, 8.0
    loss, stats = policy_objective(logp, old, adv, mask, a, entropy=entropy, rollout_logp=rollout, ref_logp=ref,
                                   n_tokens=n_tokens, n_seqs=n_seqs, max_response_len=max_len)  # fmt: skip

    denom = {"token_mean": n_tokens, "seq_mean_token_mean": n_seqs}.get(mode, max_len)
    kw = {"num_seqs": n_seqs} if mode == "seq_mean_token_sum_norm" else {}
    if estimator == "gspo":
        pg, clipped = gspo_loss(logp, old, adv, mask, 0.2, 0.28)
    else:
        pg, clipped = ppo_clip_loss(logp, old, adv, 0.2, 0.28)
    pg = pg * tis_weights(old, rollout, a.tis_clip, a.tis_clip_low)
    kl = aggregate(kl_penalty(logp, ref, a.kl_loss_type), mask, mode, denom, **kw)
    ent = aggregate(entropy, mask, mode, denom, **kw)
    expected = aggregate(pg, mask, mode, denom, **kw) + 0.1 * kl - 0.01 * ent
    assert torch.equal(loss, expected)
    assert stats["pg_loss"] == aggregate(pg, mask, mode, denom, **kw).item()
    assert stats["kl"] == kl.item() and stats["entropy"] == ent.item() and stats["loss"] == loss.item()
    assert stats["clipfrac"] == pytest.approx(float((clipped * mask).sum()) / n_tokens)
    gap = (logp.detach() - rollout).abs() * mask
    assert stats["logprob_mismatch_max"] == float(gap.max())
    loss.backward()
    assert logp.grad is not None and entropy.grad is not None


def test_policy_objective_without_reference_has_no_kl_term():
    logp, old, rollout, _, adv, mask, entropy = tensors(1)
    a = AlgorithmConfig()
    n_tokens = float(mask.sum())
    loss, stats = policy_objective(logp, logp.detach(), adv, mask, a, entropy=entropy, rollout_logp=rollout,
                                   ref_logp=None, n_tokens=n_tokens, n_seqs=3.0, max_response_len=5.0)  # fmt: skip
    assert stats["kl"] == 0.0 and stats["loss"] == stats["pg_loss"]
    assert stats["ratio"] == pytest.approx(1.0)  # old = current: ratio 1 on every trained token, token mean
    assert stats["clipfrac"] == 0.0


def test_value_and_sft_objectives_are_token_means_over_the_step():
    logp, old, _, ref, _, mask, entropy = tensors(2)
    loss, stats = value_objective(logp, old, ref, mask, 0.2, 30.0)
    per_token, clipped = value_loss(logp, old, ref, mask, 0.2)
    assert torch.equal(loss, aggregate(per_token, mask, "token_mean", 30.0))
    assert stats == {"value_loss": loss.item(), "value_clipfrac": float(clipped.sum()) / 30.0}
    loss, stats = sft_objective(logp, entropy, mask, 30.0)
    assert torch.equal(loss, aggregate(sft_loss(logp, mask), mask, "token_mean", 30.0))
    assert stats["entropy"] == aggregate(entropy.detach(), mask, "token_mean", 30.0).item()


def training(**kw):
    return TrainingConfig(global_batch_size=2, micro_batch_size=1, lr=1e-3, hf_checkpoint="x", **kw)


def test_lr_schedule_warms_up_then_decays_to_min_lr():
    t = training(lr_warmup_iters=2, lr_decay_style="cosine", min_lr=1e-4)
    assert [lr_factor(t, i, 10) for i in range(2)] == [0.5, 1.0]
    assert lr_factor(t, 6, 10) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(t, 10, 10) == pytest.approx(0.1) and lr_factor(t, 50, 10) == pytest.approx(0.1)
    linear = training(lr_decay_style="linear", min_lr=0.0, lr_decay_iters=4)
    assert [lr_schedule(linear, 100)(i) for i in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert lr_factor(training(), 7) == 1.0  # constant
