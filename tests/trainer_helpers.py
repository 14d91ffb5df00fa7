"""Building a tiny policy trainer and reading a sample's log-prob, for the trainer and critic tests (the `tiny`
checkpoint fixture is in conftest.py)."""

import torch

from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
from sluiceway.tasks.train.collation import collate
from sluiceway.tasks.train.trainer import PolicyTrainer


def make_trainer(path, tok, bf16=False, **algo):
    training = TrainingConfig(global_batch_size=4, micro_batch_size=2, lr=1e-2, bf16=bf16, hf_checkpoint=str(path))
    return PolicyTrainer(path, training, AlgorithmConfig(**algo), temperature=1.0, pad_token_id=tok.pad_token_id)


def sequence_logprob(trainer, sample):
    from sluiceway.models.megatron_logprobs import token_logprobs

    mb = collate([sample], trainer.pad_token_id)
    with torch.no_grad():
        lp = token_logprobs(trainer.model, mb.input_ids)
    return float((lp.float() * mb.loss_mask).sum())
