"""The trainer group's test set-up: trainer arguments as the group receives them, a local trainer made from them,
a batch of mixed samples, and the comparison of two trainers' metrics and gradients."""

from __future__ import annotations

import pytest
import torch

from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
from sluiceway.tasks.train.samples import TrainSample
from sluiceway.tasks.train.trainer import PolicyTrainer


def trainer_kwargs(path, tok, tp=1, **training):
    t = dict(global_batch_size=8, micro_batch_size=2, lr=1e-2, hf_checkpoint=str(path), clip_grad=0.5) | training
    return dict(
        hf_dir=str(path),
        training=TrainingConfig(**t).model_dump(),
        algorithm=AlgorithmConfig(eps_clip_high=0.28, entropy_coef=0.01).model_dump(),
        temperature=0.8,
        pad_token_id=tok.pad_token_id,
        tensor_parallel=tp,
    )


def local_trainer(kwargs) -> PolicyTrainer:
    kw = dict(kwargs)
    kw["training"] = TrainingConfig(**kw["training"])
    kw["algorithm"] = AlgorithmConfig(**kw["algorithm"])
    return PolicyTrainer(**kw)


def batch(tok, n=8):
    """Samples of different lengths with mixed advantages and partly masked responses."""
    prompts = ["What is 2 + 3?", "Sort: b a c", "Reverse abc", "Count the letters in banana"]
    answers = [" 5", " a b c", " The answer is cba, I think", " six", " 7 maybe", " c b a", " no", " 6 letters"]
    out = []
    for i in range(n):
        p, r = tok.encode(prompts[i % 4]), tok.encode(answers[i])
        mask = [1] * len(r)
        if len(r) > 3:
            mask[1] = 0  # a tool-output-like token left out of the loss
        out.append(TrainSample(p, r, mask, (-1.0) ** i * (0.5 + 0.1 * i), [-2.0] * len(r)))
    return out


def assert_same(a, b, tol=1e-5):
    (ma, ga), (mb, gb) = a, b
    for k in ("loss", "pg_loss", "entropy", "clipfrac", "logprob_mismatch"):
        assert ma[k] == pytest.approx(mb[k], abs=tol), k
    assert set(ga) == set(gb)
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], atol=tol, rtol=0, msg=k)
