"""Train/inference mismatch corrections beside TIS (`--use-tis --tis-mode icepop|mis`, `--custom-tis-function-path`)
checked by hand on constructed log-probs: which tokens and sequences are masked, the weights kept, the step
statistics (mismatch KL, masked shares), and the config's one-line errors.

Every expected number is written out as arithmetic in the test; log-probs are built as rollout + d, so the ratio
exp(old - rollout) of each token is exp(d), chosen away from the band's edges.
"""

import math
from pathlib import Path

import pytest
import tis_helpers
import torch

from sluiceway.flows.cli import make_parser, resolve_config
from sluiceway.flows.config import AlgorithmConfig
from sluiceway.infra.errors import UserError
from sluiceway.tasks.train.losses import (
    icepop_weights,
    mis_weights,
    mismatch_band,
    mismatch_kl,
    mismatch_weights,
    policy_objective,
    tis_weights,
)

LN = math.log


def close(a, b, atol=1e-6):
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, atol=atol, rtol=0), (a, b)


def pair(d, rollout=-1.0, dtype=torch.float64):
    """(old, rollout) log-probs whose per-token ratio exp(old - rollout) is exp(d)."""
    d = torch.tensor(d, dtype=dtype)
    r = torch.full_like(d, rollout)
    return r + d, r


def objective(a, d, adv, mask, n_tokens=None, n_seqs=None):
    """policy_objective with logp = old (PPO ratio 1, unclipped: per-token pg = -A before the correction)."""
    old, rollout = pair(d, dtype=torch.float32)
    logp = old.clone().requires_grad_()
    mask = torch.tensor(mask, dtype=torch.float32)
    adv = torch.tensor(adv, dtype=torch.float32)
    n_tokens = float(mask.sum()) if n_tokens is None else n_tokens
    n_seqs = float(mask.shape[0]) if n_seqs is None else n_seqs
    loss, stats = policy_objective(logp, old, adv, mask, a, entropy=torch.zeros_like(logp), rollout_logp=rollout,
                                   ref_logp=None, n_tokens=n_tokens, n_seqs=n_seqs, max_response_len=8.0)  # fmt: skip
    loss.backward()
    return loss, stats, logp.grad


# --------------------------------------------------------------------------- the per-token pieces


def test_band_defaults_to_one_over_b():
    assert mismatch_band(2.0, None) == (0.5, 2.0)  # [1/b, b]
    assert mismatch_band(5.0, 0.5) == (0.5, 5.0)  # IcePop's own setting: alpha 0.5, beta 5
    assert mismatch_band(1.25, None) == (0.8, 1.25)


def test_icepop_masks_tokens_outside_the_band_and_keeps_the_ratio_inside():
    # ratios k = 1, 1.5, 1.99, 2.01, 0.49, 0.6 against the band [0.5, 2]:
    #   inside: 1, 1.5, 1.99, 0.6 (weight = k, as slime's icepop_function); outside: 2.01 (> 2), 0.49 (< 0.5) -> 0
    old, rollout = pair([LN(1.0), LN(1.5), LN(1.99), LN(2.01), LN(0.49), LN(0.6)])
    w, kept = icepop_weights(old, rollout, 0.5, 2.0)
    assert kept.tolist() == [True, True, True, False, False, True]
    close(w, [1.0, 1.5, 1.99, 0.0, 0.0, 0.6], atol=1e-12)
    # TIS on the same ratios clamps instead: 2.01 -> 2, 0.49 -> 0.5 (both kept, bounded)
    close(tis_weights(old, rollout, 2.0, 0.5), [1.0, 1.5, 1.99, 2.0, 0.5, 0.6], atol=1e-12)
    # an extreme log-ratio (+-100, past the [-20, 20] clamp) is masked, never inf or nan
    w, kept = icepop_weights(*pair([100.0, -100.0]), 0.5, 2.0)
    assert w.tolist() == [0.0, 0.0] and not kept.any()


def test_mis_masks_whole_sequences_on_the_geometric_mean_ratio():
    # band [0.8, 1.25] (tis_clip 1.25, lower bound 1 / 1.25). log rho_i = mean of d over the trained tokens:
    d = [
        [0.1, -0.1, 0.3],  # mask 1 1 1: (0.1 - 0.1 + 0.3) / 3 = 0.1, rho = e^0.1 = 1.10517 -> kept, w = e^0.1
        [0.5, 0.5, 9.0],  # mask 1 1 0: (0.5 + 0.5) / 2 = 0.5, rho = e^0.5 = 1.64872 > 1.25 -> masked
        [-0.2, -0.4, 0.0],  # mask 1 1 0: -0.3, rho = e^-0.3 = 0.74082 < 0.8 -> masked
        [0.05, -0.05, 7.0],  # mask 1 1 0: 0, rho = 1 -> kept (the untrained 7.0 would give e^(7/3) = 10.3)
        [3.0, 3.0, 3.0],  # mask 0 0 0: no trained token, rho = 1 -> kept (weights never reach the loss)
    ]
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.float64)
    w, kept = mis_weights(*pair(d), mask, 0.8, 1.25)
    assert kept.tolist() == [True, False, False, True, True]
    e01 = math.exp(0.1)  # 1.1051709
    close(w, [[e01] * 3, [0.0] * 3, [0.0] * 3, [1.0] * 3, [1.0] * 3], atol=1e-12)
    # token-level IcePop on the same band would mask row 0's third token (e^0.3 = 1.35 > 1.25), MIS keeps it
    assert icepop_weights(*pair(d), 0.8, 1.25)[1][0].tolist() == [True, True, False]


def test_mismatch_kl_is_k3_of_rollout_vs_trainer():
    # kl = e^d - 1 - d:  d = 0 -> 0;  d = ln 2 -> 2 - 1 - 0.693147 = 0.306853;
    #                    d = -ln 2 -> 0.5 - 1 + 0.693147 = 0.193147
    close(mismatch_kl(*pair([0.0, LN(2), -LN(2)])), [0.0, 1 - LN(2), LN(2) - 0.5], atol=1e-12)
    assert torch.isfinite(mismatch_kl(*pair([200.0]))).all()  # clamped at d = 20


# --------------------------------------------------------------------------- through policy_objective


def test_policy_objective_with_icepop_masks_tokens_out_of_loss_and_gradient():
    # ratios k = [[1, 3, e^0.1], [1/3, 1, 1]], band [0.5, 2] (tis_clip 2): masked (0, 1) (3 > 2) and (1, 0) (1/3 < 0.5)
    # w = [[1, 0, e^0.1], [0, 1, 1]];  token (1, 2) is untrained (mask 0);  5 trained tokens
    a = AlgorithmConfig(use_tis=True, tis_mode="icepop", tis_clip=2.0)
    d = [[0.0, LN(3), 0.1], [-LN(3), 0.0, 0.0]]
    adv = [[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]]
    loss, stats, grad = objective(a, d, adv, [[1, 1, 1], [1, 1, 0]])
    e01 = math.exp(0.1)
    # pg = -A * w on trained tokens: -1, 0, -e^0.1 | 0, +2  -> token mean (1 - e^0.1) / 5 = -0.0210342
    close(loss, (1 - e01) / 5)
    # d loss / d logp = -A * w / 5: masked tokens get no gradient
    close(grad, [[-1 / 5, 0.0, -e01 / 5], [0.0, 2 / 5, 0.0]])
    assert stats["tis_masked_frac"] == pytest.approx(2 / 5) and stats["tis_clipfrac"] == pytest.approx(2 / 5)
    assert stats["tis_weight_mean"] == pytest.approx((1 + e01 + 1) / 5)  # 0.6210342
    assert stats["tis_masked_seq_frac"] == 0.0  # no sequence lost all its tokens
    # k3 per trained token: 0, 3 - 1 - ln 3 = 0.9013877, e^0.1 - 1.1 = 0.0051709, 1/3 - 1 + ln 3 = 0.4319456, 0
    kl = (3 - 1 - LN(3)) + (e01 - 1.1) + (1 / 3 - 1 + LN(3))
    assert stats["mismatch_kl"] == pytest.approx(kl / 5, abs=1e-6)  # 0.2677008


def test_policy_objective_with_mis_masks_sequences():
    # band [0.8, 1.25]; mean d per sequence: 0.1 (kept, w = e^0.1), (0.5 + 0.3) / 2 = 0.4 (e^0.4 = 1.49, masked),
    # (-0.1 + 0) / 2 = -0.05 (kept, w = e^-0.05 = 0.951229)
    a = AlgorithmConfig(use_tis=True, tis_mode="mis", tis_clip=1.25)
    d = [[0.1, 0.1], [0.5, 0.3], [-0.1, 0.0]]
    adv = [[1.0, 1.0], [1.0, 1.0], [-1.0, -1.0]]
    loss, stats, grad = objective(a, d, adv, [[1, 1], [1, 1], [1, 1]])
    e01, em005 = math.exp(0.1), math.exp(-0.05)
    # pg = -A * w: -e^0.1 twice, 0 twice, +e^-0.05 twice -> (-2 e^0.1 + 2 e^-0.05) / 6 = -0.0513138
    close(loss, (-2 * e01 + 2 * em005) / 6)
    close(grad, [[-e01 / 6] * 2, [0.0, 0.0], [em005 / 6] * 2])
    assert stats["tis_masked_seq_frac"] == pytest.approx(1 / 3)
    assert stats["tis_masked_frac"] == pytest.approx(2 / 6)
    assert stats["tis_weight_mean"] == pytest.approx((2 * e01 + 2 * em005) / 6)  # 0.6854668
    # statistics are shares of the whole step: with 12 tokens and 6 sequences in the step, this micro-batch
    # contributes half as much
    _, half, _ = objective(a, d, adv, [[1, 1], [1, 1], [1, 1]], n_tokens=12.0, n_seqs=6.0)
    assert half["tis_masked_seq_frac"] == pytest.approx(1 / 6) and half["tis_masked_frac"] == pytest.approx(2 / 12)


def test_truncate_and_no_tis_statistics():
    # truncate (TIS), tis_clip 2, no lower clip: ratios 3, 1, 1/3 -> w = 2, 1, 1/3; one clamped (3 -> 2)
    d, adv, mask = [[LN(3), 0.0, -LN(3)]], [[1.0, 1.0, 1.0]], [[1, 1, 1]]
    loss, stats, _ = objective(AlgorithmConfig(use_tis=True), d, adv, mask)
    close(loss, -(2 + 1 + 1 / 3) / 3)
    assert stats["tis_clipfrac"] == pytest.approx(1 / 3) and stats["tis_masked_frac"] == 0.0
    assert stats["tis_weight_mean"] == pytest.approx((2 + 1 + 1 / 3) / 3)
    # without use_tis nothing is weighted (mean weight 1, nothing masked) but the mismatch is still measured:
    # k3: 3 - 1 - ln 3 = 0.9013877, 0, 1/3 - 1 + ln 3 = 0.4319456
    loss, stats, _ = objective(AlgorithmConfig(), d, adv, mask)
    close(loss, -1.0)
    assert stats["tis_weight_mean"] == pytest.approx(1.0) and stats["tis_clipfrac"] == 0.0
    assert stats["mismatch_kl"] == pytest.approx((2 - LN(3) + 1 / 3 - 1 + LN(3)) / 3, abs=1e-6)


# --------------------------------------------------------------------------- --custom-tis-function-path


def test_custom_function_weights_and_metrics():
    # tis_helpers.half_weights: 0.5 where |d| <= 1, else 0.  d = 0, 2, 0.5 -> w = 0.5, 0, 0.5;  A = 1
    a = AlgorithmConfig(use_tis=True, custom_tis_function_path="tis_helpers:half_weights")
    loss, stats, grad = objective(a, [[0.0, 2.0, 0.5]], [[1.0, 1.0, 1.0]], [[1, 1, 1]])
    close(loss, -(0.5 + 0 + 0.5) / 3)
    close(grad, [[-0.5 / 3, 0.0, -0.5 / 3]])
    assert stats["tis_abs_gap"] == pytest.approx((0 + 2 + 0.5) / 3)  # its metric, as a token mean, prefixed tis_
    assert stats["tis_w"] == pytest.approx(1 / 3)  # a name already starting with tis_ is kept as it is
    assert stats["tis_masked_frac"] == pytest.approx(1 / 3) and stats["tis_clipfrac"] == pytest.approx(1 / 3)


def test_custom_function_from_a_file_returning_weights_only():
    # plain_weights: clamp(exp(d), max=tis_clip 2): d = ln 3, 0 -> 2, 1
    path = f"{Path(tis_helpers.__file__)}:plain_weights"
    a = AlgorithmConfig(use_tis=True, custom_tis_function_path=path)
    old, rollout = pair([[LN(3), 0.0]], dtype=torch.float32)
    w, bounded, metrics = mismatch_weights(old, rollout, torch.ones(1, 2), a)
    close(w, [[2.0, 1.0]])
    assert metrics == {} and not bounded.any()


# --------------------------------------------------------------------------- config


def cfg_from(*flags):
    return resolve_config(make_parser().parse_args(["run", "--prompt-data", "env:arithmetic", *flags]))


def test_flags_select_the_correction():
    a = cfg_from("--use-tis", "--tis-mode", "icepop", "--tis-clip", "5", "--tis-clip-low", "0.5").algorithm
    assert (a.use_tis, a.tis_mode, a.tis_clip, a.tis_clip_low) == (True, "icepop", 5.0, 0.5)
    assert cfg_from().algorithm.tis_mode == "truncate"
    a = cfg_from("--use-tis", "--custom-tis-function-path", "tis_helpers:half_weights").algorithm
    assert a.custom_tis_function_path == "tis_helpers:half_weights"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tis-mode", "icepop"], "tis_mode icepop corrects the loss only with use_tis: add --use-tis"),
        (["--custom-tis-function-path", "tis_helpers:half_weights"], "only with use_tis"),
        (["--use-tis", "--tis-mode", "mis", "--custom-tis-function-path", "tis_helpers:half_weights"],
         "custom_tis_function_path replaces tis_mode mis: give one of them"),
        (["--use-tis", "--tis-mode", "icepop", "--tis-clip", "0.8"], "lower bound 1.25 is above tis_clip 0.8"),
        (["--use-tis", "--tis-clip-low", "3"], "lower bound 3 is above tis_clip 2"),
        (["--use-tis", "--tis-mode", "token"], "--tis-mode: invalid choice: 'token'"),
        (["--use-tis", "--custom-tis-function-path", "no_such_module_zz:fn"], "cannot import no_such_module_zz"),
        (["--use-tis", "--custom-tis-function-path", "tis_helpers:missing"], "has no function 'missing'"),
        (["--use-tis", "--custom-tis-function-path", "tis_helpers"], "expected 'module:function'"),
        (["--use-tis", "--custom-tis-function-path", "/nowhere/tis.py:fn"], "not found"),
        (["--use-tis", "--custom-tis-function-path", "tis_helpers:two_args"],
         "must take (old_logp, rollout_logp, mask, algorithm)"),
    ],
)  # fmt: skip
def test_config_errors_are_one_line(flags, message):
    with pytest.raises(UserError) as e:
        cfg_from(*flags)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
