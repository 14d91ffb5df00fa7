"""Tinker's ppo and cispo losses (flows/tinker/losses.py) against a small example worked by hand: four tokens whose
probability ratios p/q are 1.5, 0.5, 1.1, 0.5 under advantages 1, 1, -1, -1 (tinker-docs' definitions)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("tinker")
from sluiceway.flows.tinker.futures import TinkerUserError  # noqa: E402
from sluiceway.flows.tinker.losses import elementwise_loss, loss_config  # noqa: E402

RATIOS = [1.5, 0.5, 1.1, 0.5]
ADV = [1.0, 1.0, -1.0, -1.0]
Q = [-1.0, -2.0, -0.5, -3.0]  # the sampler's log-probs


def case(**extra):
    logp = torch.tensor([math.log(r) + q for r, q in zip(RATIOS, Q)], dtype=torch.float64, requires_grad=True)
    inputs = {"logprobs": torch.tensor(Q, dtype=torch.float64), "advantages": torch.tensor(ADV, dtype=torch.float64)}
    inputs.update({k: torch.tensor(v, dtype=torch.float64) for k, v in extra.items()})
    return logp, inputs


def run(loss_fn, config=None, **extra):
    logp, inputs = case(**extra)
    loss = elementwise_loss(loss_fn, logp, inputs, loss_config(loss_fn, config or {}))
    loss.sum().backward()
    return loss.detach().tolist(), logp.grad.tolist(), logp.detach().tolist()


def test_ppo_by_hand():
    # clip(r, 0.8, 1.2) = 1.2, 0.8, 1.1, 0.8; min(r*A, clip*A) = 1.2, 0.5, -1.1, -0.8; the loss is its negative
    loss, grad, _ = run("ppo")
    assert loss == pytest.approx([-1.2, -0.5, 1.1, 0.8])
    assert sum(loss) == pytest.approx(0.2)
    # d/dlogp: 0 where the clipped term is the min and clipped (tokens 1 and 4), else -r*A
    assert grad == pytest.approx([0.0, -0.5, 1.1, 0.0])
    # thresholds from loss_fn_config: clip(r, 0.9, 1.05) = 1.05, 0.9, 1.05, 0.9
    loss, grad, _ = run("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05})
    assert loss == pytest.approx([-1.05, -0.5, 1.1, 0.9])
    assert grad == pytest.approx([0.0, -0.5, 1.1, 0.0])
    # per-token thresholds in loss_fn_inputs win over the config
    loss, _, _ = run("ppo", clip_low_threshold=[0.0] * 4, clip_high_threshold=[2.0] * 4)
    assert loss == pytest.approx([-1.5, -0.5, 1.1, 0.5])  # nothing clipped: importance sampling's loss
    assert run("importance_sampling")[0] == pytest.approx([-1.5, -0.5, 1.1, 0.5])


def test_cispo_by_hand():
    # default thresholds 0 and 4: nothing of this example clipped; loss -r*logp*A, gradient -r*A (r detached)
    loss, grad, logp = run("cispo")
    assert loss == pytest.approx([-r * lp * a for r, lp, a in zip(RATIOS, logp, ADV)])
    assert grad == pytest.approx([-1.5, -0.5, 1.1, 0.5])
    # thresholds 0.8 and 1.2: the coefficients become 1.2, 0.8, 1.1, 0.8; the gradient still flows on every token
    loss, grad, logp = run("cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    coef = [1.2, 0.8, 1.1, 0.8]
    assert loss == pytest.approx([-c * lp * a for c, lp, a in zip(coef, logp, ADV)])
    assert grad == pytest.approx([-1.2, -0.8, 1.1, 0.8])


def test_loss_configs_are_checked():
    assert loss_config("ppo", {}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert loss_config("cispo", {"clip_high_threshold": 2.0}) == {"clip_low_threshold": 0.0, "clip_high_threshold": 2.0}
    with pytest.raises(TinkerUserError, match="not \\['clip_ratio'\\]"):
        loss_config("ppo", {"clip_ratio": 0.2})
    with pytest.raises(TinkerUserError, match="above"):
        loss_config("cispo", {"clip_low_threshold": 2.0, "clip_high_threshold": 1.0})
    with pytest.raises(TinkerUserError, match="takes no settings"):
        loss_config("cross_entropy", {"beta": 1.0})
    with pytest.raises(TinkerUserError, match="does not implement the loss function 'dro'"):
        loss_config("dro", {})
    with pytest.raises(TinkerUserError, match="unknown loss function"):
        loss_config("nope", {})


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"learning_rate": float("nan")}, "learning_rate"),
        ({"learning_rate": 1e30}, "learning_rate"),
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"beta1": 1.0}, "beta1"),
        ({"beta2": -0.1}, "beta2"),
        ({"eps": 0.0}, "eps"),
        ({"weight_decay": float("inf")}, "weight_decay"),
        ({"grad_clip_norm": -1.0}, "grad_clip_norm"),
        ({"grad_clip_norm": "1"}, "grad_clip_norm"),
    ],
)
def test_adam_params_out_of_bounds_are_the_callers_error(params, field):
    """Issue 52 point 3: each had been applied (lr 1e30, eps 0 with beta2 0 destroyed the weights)."""
    from sluiceway.flows.tinker.adam import check_adam

    with pytest.raises(TinkerUserError, match=rf"adam_params\.{field} must be a finite number"):
        check_adam({"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12} | params)
    check_adam({"learning_rate": 1.0, "beta1": 0.0, "beta2": 0.999, "eps": 1e-8, "grad_clip_norm": 0.0})


def test_non_finite_loss_settings_are_refused():
    for bad in (float("nan"), float("inf"), True, "0.8"):
        with pytest.raises(TinkerUserError, match=r"loss_fn_config\['clip_low_threshold'\] must be a finite number"):
            loss_config("ppo", {"clip_low_threshold": bad})
