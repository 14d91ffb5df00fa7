"""--bf16-weight-rounding stochastic (tasks/train/weight_rounding.py): the bf16 copy of an fp32 master is one of its
two bf16 neighbours, unbiased over the per-weight thresholds, fixed for a given master (so no jitter and exact
resumes); the trainer computes with it, publishes exactly it, and a checkpoint restores it."""

import pytest
import torch
from safetensors.torch import load_file
from test_trainer import samples
from trainer_helpers import make_trainer

from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
from sluiceway.tasks.train.trainer import PolicyTrainer
from sluiceway.tasks.train.weight_rounding import MasterRounding, stochastic_bf16


def neighbours(x):
    """The bf16 values just below and above each fp32 `x` (by magnitude: truncate, and truncate + one step)."""
    down = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)
    up = ((x.view(torch.int32) & ~0xFFFF) + 0x10000).view(torch.float32)
    return down, up


def test_each_value_goes_to_one_of_its_neighbours_and_is_unbiased():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, generator=g) * 0.2).repeat(4096, 1)  # each value rounded with 4096 thresholds
    t = torch.randint(0, 1 << 16, x.shape, generator=g)
    r = stochastic_bf16(x, t).float()
    down, up = neighbours(x)
    assert bool(((r == down) | (r == up)).all())
    spacing = (up - down)[0].abs()
    assert bool(((r.mean(0) - x[0]).abs() < 0.05 * spacing).all())  # the mean's standard error is ~0.008 spacing
    assert bool(((r == x) | (x.to(torch.bfloat16).float() != x)).all())  # values on the grid stay where they are


def test_an_update_below_half_a_spacing_reaches_the_bf16_copy_in_expectation():
    """Round to nearest loses it (the dead zone at the grid); stochastic rounding keeps it on average."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(200_000, generator=g)
    w = (z.sign() * (0.1 + 0.2 * z.abs())).to(torch.bfloat16).float()  # |w| >= 0.1, on the bf16 grid
    step = 1e-5  # Adam moves each weight by about lr; bf16's spacing is >= 4.9e-4 here
    rounding = MasterRounding("stochastic", [w.numel()], seed=3, tp_rank=0, device=torch.device("cpu"))
    before, after = torch.empty(w.shape, dtype=torch.bfloat16), torch.empty(w.shape, dtype=torch.bfloat16)
    rounding.copy([before], [w])
    rounding.copy([after], [w + step])
    assert torch.equal(before.float(), w)
    assert torch.equal((w + step).to(torch.bfloat16).float(), w)  # nearest: nothing moved
    moved = (after.float() - before.float()).mean()
    assert moved == pytest.approx(step, rel=0.1)


def stochastic_trainer(path, tok):
    training = TrainingConfig(global_batch_size=4, micro_batch_size=2, lr=1e-3, bf16=True, hf_checkpoint=str(path),
                              bf16_weight_rounding="stochastic")  # fmt: skip
    return PolicyTrainer(path, training, AlgorithmConfig(), temperature=1.0, pad_token_id=tok.pad_token_id)


def test_the_trainer_computes_with_publishes_and_restores_the_stochastic_copy(tiny, tmp_path):
    path, tok = tiny
    trainer = stochastic_trainer(path, tok)
    nearest = make_trainer(path, tok, bf16=True)  # what the engines load from the checkpoint: rounded to nearest
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), nearest.model.parameters()))
    trainer.train_rollout(samples(tok, [1.0, -1.0, 1.0, -1.0]), step=0)
    params = [p for _, p in trainer.model.named_parameters()]
    expected = [torch.empty_like(p) for p in params]
    trainer.rounding.copy(expected, trainer.master)
    assert all(torch.equal(p, e) for p, e in zip(params, expected))
    nearest = sum(int((p != m.to(torch.bfloat16)).sum()) for p, m in zip(params, trainer.master))
    assert nearest > 0  # it is not round-to-nearest

    out = trainer.write_weights(path, tmp_path / "w", dtype="bfloat16")
    written = load_file(out / "model.safetensors")
    model_hf = trainer.transform.hf_state_dict(trainer._model_weights_fp32, include_tied_lm_head=False)
    assert set(written) == set(model_hf)
    assert all(torch.equal(written[k], v.to(torch.bfloat16)) for k, v in model_hf.items())

    trainer.save(tmp_path / "ckpt", step=0)
    resumed = stochastic_trainer(path, tok)
    resumed.load(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), resumed.model.parameters()))
