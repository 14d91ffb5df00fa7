"""The megatron-core policy trainer on tiny-llama: the PPO step moves log-probs the right way, in fp32 and
in bf16 with fp32 master weights; weights leave in HF names; a checkpoint restores the exact state."""

import pytest
import torch
from trainer_helpers import make_trainer, sequence_logprob

from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
from sluiceway.models.zoo import load_hf_model
from sluiceway.tasks.train.samples import TrainSample
from sluiceway.tasks.train.trainer import PolicyTrainer


def samples(tok, advantages):
    prompt = tok.encode("What is 2 + 3?")
    responses = [tok.encode(" 5"), tok.encode(" 7"), tok.encode(" The answer is 5"), tok.encode(" no")]
    return [TrainSample(prompt, r, [1] * len(r), a, [0.0] * len(r)) for r, a in zip(responses, advantages)]


@pytest.mark.parametrize("bf16", [False, True])
def test_ppo_step_follows_the_advantage(tiny, bf16):
    path, tok = tiny
    trainer = make_trainer(path, tok, bf16=bf16)
    batch = samples(tok, [1.0, -1.0, 1.0, -1.0])
    before = [sequence_logprob(trainer, s) for s in batch]
    metrics = trainer.train_rollout(batch, step=0)
    after = [sequence_logprob(trainer, s) for s in batch]
    assert after[0] > before[0] and after[2] > before[2]  # advantage +1: more likely
    assert after[1] < before[1] and after[3] < before[3]  # advantage -1: less likely
    assert trainer.weight_version == 1
    assert metrics["ratio"] == pytest.approx(1.0, abs=1e-6)  # on-policy: old log-probs are the current ones
    assert all(m.dtype == torch.float32 for m in trainer.master)
    if bf16:
        assert next(trainer.model.parameters()).dtype == torch.bfloat16


def test_zero_advantages_leave_the_weights_alone(tiny):
    path, tok = tiny
    trainer = make_trainer(path, tok)
    before = {k: v.clone() for k, v in trainer.hf_state_dict().items()}
    trainer.train_rollout(samples(tok, [0.0] * 4), step=0)
    assert all(torch.equal(before[k], v) for k, v in trainer.hf_state_dict().items())


def test_weights_leave_in_hf_names_and_load_into_transformers(tiny):
    path, tok = tiny
    trainer = make_trainer(path, tok, bf16=True)
    trainer.train_rollout(samples(tok, [1.0, -1.0, 1.0, -1.0]), step=0)
    hf = load_hf_model(path)
    sd = trainer.hf_state_dict()
    assert set(sd) == set(hf.state_dict())
    hf.load_state_dict(sd)
    assert all(v.dtype == torch.float32 for v in sd.values())  # from the fp32 masters


def test_weights_written_for_bf16_engines_are_the_masters_rounded_to_nearest(tiny, tmp_path):
    import json

    from safetensors.torch import load_file

    path, tok = tiny
    training = TrainingConfig(global_batch_size=4, micro_batch_size=2, lr=1e-2, bf16=True, hf_checkpoint=str(path),
                              bf16_weight_rounding="nearest")  # fmt: skip
    trainer = PolicyTrainer(path, training, AlgorithmConfig(), temperature=1.0, pad_token_id=tok.pad_token_id)
    trainer.train_rollout(samples(tok, [1.0, -1.0, 1.0, -1.0]), step=0)
    out = trainer.write_weights(path, tmp_path, dtype="bfloat16")
    written = load_file(out / "model.safetensors")
    masters = trainer.hf_state_dict(include_tied_lm_head=False)
    assert set(written) == set(masters)
    assert all(torch.equal(written[k], v.to(torch.bfloat16)) for k, v in masters.items())
    config = json.loads((out / "config.json").read_text())
    assert {config.get(k) for k in ("torch_dtype", "dtype") if k in config} == {"bfloat16"}
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype="auto", local_files_only=True)
    assert next(hf.parameters()).dtype == torch.bfloat16  # "auto" reads the config: what an engine does


def test_kl_loss_runs_against_a_frozen_reference(tiny):
    path, tok = tiny
    trainer = make_trainer(path, tok, use_kl_loss=True, kl_loss_coef=0.1)
    trainer.train_rollout(samples(tok, [1.0, -1.0, 1.0, -1.0]), step=0)
    m = trainer.train_rollout(samples(tok, [1.0, -1.0, 1.0, -1.0]), step=1)
    assert m["kl"] > 0  # the policy moved away from the reference after the first step


def test_checkpoint_restores_weights_optimizer_and_version(tiny, tmp_path):
    path, tok = tiny
    a = make_trainer(path, tok, bf16=True)
    a.train_rollout(samples(tok, [1.0, -1.0, 1.0, -1.0]), step=0)
    a.save(tmp_path / "ckpt", step=0)
    b = make_trainer(path, tok, bf16=True)
    assert b.load(tmp_path / "ckpt") == 0 and b.weight_version == 1
    assert all(torch.equal(x, y) for x, y in zip(a.master, b.master))
    ma = a.train_rollout(samples(tok, [1.0, 1.0, -1.0, -1.0]), step=1)
    mb = b.train_rollout(samples(tok, [1.0, 1.0, -1.0, -1.0]), step=1)
    assert ma["loss"] == pytest.approx(mb["loss"], abs=1e-6)
    assert all(torch.equal(x, y) for x, y in zip(a.master, b.master))


def scheduled_trainer(path, tok, bf16=False):
    training = TrainingConfig(
        global_batch_size=4,
        micro_batch_size=2,
        lr=1e-2,
        bf16=bf16,
        hf_checkpoint=str(path),
        lr_warmup_iters=2,
        lr_decay_style="cosine",
        min_lr=1e-3,
    )
    return PolicyTrainer(
        path, training, AlgorithmConfig(), temperature=1.0, pad_token_id=tok.pad_token_id, total_iters=6
    )


def test_lr_warmup_then_cosine_decay_to_min_lr(tiny):
    path, tok = tiny
    trainer = scheduled_trainer(path, tok)
    lrs = []
    for step in range(6):
        lrs.append(trainer.train_rollout(samples(tok, [1.0, -1.0, 1.0, -1.0]), step=step)["lr"])
    assert lrs[0] == pytest.approx(5e-3) and lrs[1] == pytest.approx(1e-2)  # warmup: 1/2, 2/2 of lr
    assert lrs[2] == pytest.approx(1e-2)  # decay starts from lr
    assert lrs[2] > lrs[3] > lrs[4] > lrs[5] > 1e-3  # cosine decay towards min_lr


@pytest.mark.parametrize("bf16", [False, True])
def test_resume_is_bit_identical_to_an_uninterrupted_run(tiny, tmp_path, bf16):
    """Kill after step 1 (checkpoint), resume in a fresh trainer: steps 2-3 land on the same bits."""
    path, tok = tiny
    batches = [
        samples(tok, adv)
        for adv in ([1.0, -1.0, 1.0, -1.0], [-1.0, 1.0, 0.5, -0.5], [0.2, -0.2, 1.0, -1.0], [1.0, 1.0, -1.0, -1.0])
    ]
    straight = scheduled_trainer(path, tok, bf16)
    for step, b in enumerate(batches):
        straight.train_rollout(b, step)

    first = scheduled_trainer(path, tok, bf16)
    for step, b in enumerate(batches[:2]):
        first.train_rollout(b, step)
    first.save(tmp_path / "ckpt", step=1)
    del first
    resumed = scheduled_trainer(path, tok, bf16)
    start = resumed.load(tmp_path / "ckpt") + 1
    for step, b in enumerate(batches[start:], start=start):
        resumed.train_rollout(b, step)
    assert resumed.weight_version == straight.weight_version == 4
    assert all(torch.equal(a, b) for a, b in zip(straight.master, resumed.master))
    assert all(torch.equal(a, b) for a, b in zip(straight.model.parameters(), resumed.model.parameters()))


@pytest.mark.parametrize(
    "algo",
    [
        {"advantage_estimator": "gspo"},
        {"eps_clip_c": 3.0},
        {"use_tis": True, "tis_clip": 2.0, "tis_clip_low": 0.5},
        {"loss_agg_mode": "seq_mean_token_sum_norm"},
        {"loss_agg_mode": "seq_mean_token_mean", "entropy_coef": 0.01},
    ],
    ids=["gspo", "dual-clip", "tis", "dr-grpo-agg", "seq-mean+entropy"],
)
def test_every_objective_follows_the_advantage(tiny, algo):
    path, tok = tiny
    training = TrainingConfig(global_batch_size=4, micro_batch_size=2, lr=1e-2, hf_checkpoint=str(path))
    trainer = PolicyTrainer(
        path, training, AlgorithmConfig(**algo), temperature=1.0, pad_token_id=tok.pad_token_id, max_response_len=8
    )
    batch = samples(tok, [1.0, -1.0, 1.0, -1.0])
    before = [sequence_logprob(trainer, s) for s in batch]
    metrics = trainer.train_rollout(batch, step=0)
    after = [sequence_logprob(trainer, s) for s in batch]
    assert after[0] > before[0] and after[2] > before[2]
    assert after[1] < before[1] and after[3] < before[3]
    assert all(v == v for v in metrics.values())  # no NaN anywhere
