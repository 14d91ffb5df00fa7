"""Collation: a step's TrainSamples -> this rank's micro-batches of model inputs and per-sample loss tensors.

`plan_optimizer_steps` shuffles the step's samples, splits them into optimizer steps and micro-batches (the plan,
packing and shared prompts: tasks/train/micro_batches.py), keeps this data-parallel rank's share, and `collate`s each
micro-batch: padded one sample per row, or several samples laid out per row (packed rows, shared prompts).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from sluiceway.flows.config import TrainingConfig
from sluiceway.models.megatron_logprobs import packed_attention_mask
from sluiceway.tasks.train.micro_batches import plan_micro_batches, shard_for_rank
from sluiceway.tasks.train.samples import TrainSample


@dataclass
class MicroBatch:
    """Model inputs plus per-sample loss tensors [n_samples, w-1] (index t scores the token at t+1).

    Unpacked, row i of `input_ids` is sample i, right-padded. Otherwise (packed rows, shared prompts) a row holds
    several samples back to back, `attention_mask` keeps them apart, and `unpack` maps each per-sample position
    to its place in the flattened [rows * s] positions, so the losses see the same per-sample layout either way.
    """

    input_ids: torch.Tensor  # [rows, s]
    loss_mask: torch.Tensor  # [n, w-1] 1 where the token at t+1 is a trained response token
    advantages: torch.Tensor  # [n, w-1]
    rollout_logprobs: torch.Tensor  # [n, w-1] the engine's log-probs
    attention_mask: torch.Tensor | None = None  # [rows, 1, s, s], laid-out rows only
    unpack: torch.Tensor | None = None  # [n, w-1] long, laid-out rows only
    rewards: torch.Tensor | None = None  # [n], for the token-level estimators
    position_ids: torch.Tensor | None = None  # [rows, s] RoPE positions, laid-out rows only
    targets: torch.Tensor | None = None  # [n, w-1] the token at t+1 of each sample, laid-out rows only
    teacher_logprobs: torch.Tensor | None = None  # [n, w-1] OPD's stored teacher log-probs, when all samples have them
    names: list[str] | None = None  # per sample, " (group G, sample I)" or "": to name one in an error
    # (sample, t) of every position where loss_mask > 0, found while the batch is on the host: on a GPU `nonzero`
    # waits for the device, a synchronisation inside the step (issue 44).
    loss_rows: torch.Tensor | None = None
    loss_cols: torch.Tensor | None = None

    def to(self, device: torch.device, non_blocking: bool = False) -> MicroBatch:
        """The batch on `device`. `non_blocking` (to a GPU): through pinned memory, so the copies never wait for
        the device; a plain copy from pageable memory waits for the work queued before it."""
        pin = non_blocking and device.type == "cuda"

        def move(t):
            if not isinstance(t, torch.Tensor):
                return t
            return (t.pin_memory() if pin and t.device.type == "cpu" else t).to(device, non_blocking=pin)

        return MicroBatch(**{k: move(t) for k, t in vars(self).items()})

    def per_sample(self, x: torch.Tensor) -> torch.Tensor:
        """Model output [rows, s-1] -> the per-sample layout [n, w-1]."""
        return x if self.unpack is None else torch.nn.functional.pad(x, (0, 1)).reshape(-1)[self.unpack]


def collate(samples: list[TrainSample], pad_id: int, rows: list[list[int]] | None = None) -> MicroBatch:
    """Tensors for one micro-batch: one sample per row, or with `rows` (sample indices) several laid out per row.

    In a laid-out row, a sample whose prompt equals that of the sample before it shares that prompt: only its
    response is laid out, and it continues from the prompt's end (RoPE positions, attention), attending to the
    prompt and to itself only, so it scores exactly as in a row of its own.
    """
    n = len(samples)
    lengths = [len(s.prompt_token_ids) + len(s.response_token_ids) for s in samples]
    w = max(lengths)
    mask = torch.zeros((n, w - 1))
    adv = torch.zeros((n, w - 1))
    rlp = torch.zeros((n, w - 1))
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    names = [s.name for s in samples]
    for i, s in enumerate(samples):
        p, r = len(s.prompt_token_ids), len(s.response_token_ids)
        # logprob index t predicts token t+1: response token j sits at p+j, predicted at p+j-1.
        span = slice(p - 1, p - 1 + r)
        mask[i, span] = torch.tensor(s.loss_mask, dtype=torch.float32)
        adv[i, span] = s.advantage
        rlp[i, span] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    teacher = None
    if samples and all(s.teacher_logprobs is not None for s in samples):
        teacher = torch.zeros((n, w - 1))
        for i, s in enumerate(samples):
            p, r = len(s.prompt_token_ids), len(s.response_token_ids)
            teacher[i, p - 1 : p - 1 + r] = torch.tensor(s.teacher_logprobs, dtype=torch.float32)
    loss_rows, loss_cols = (mask > 0).nonzero(as_tuple=True)
    if rows is None:
        ids = torch.full((n, w), pad_id, dtype=torch.long)
        for i, s in enumerate(samples):
            ids[i, : lengths[i]] = torch.tensor(s.prompt_token_ids + s.response_token_ids)
        return MicroBatch(ids, mask, adv, rlp, rewards=rewards, teacher_logprobs=teacher, names=names,
                          loss_rows=loss_rows, loss_cols=loss_cols)  # fmt: skip
    layouts = [_lay_out_row([samples[i] for i in row]) for row in rows]
    width = max(len(tokens) for tokens, *_ in layouts)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    segments = torch.full((len(rows), width), -1, dtype=torch.long)
    members = torch.full((len(rows), width), -1, dtype=torch.long)
    unpack = torch.zeros((n, w - 1), dtype=torch.long)
    targets = torch.zeros((n, w - 1), dtype=torch.long)
    for row_i, (row, (tokens, pos, seg, member, where)) in enumerate(zip(rows, layouts)):
        k = len(tokens)
        ids[row_i, :k], positions[row_i, :k] = torch.tensor(tokens), torch.tensor(pos)
        segments[row_i, :k], members[row_i, :k] = torch.tensor(seg), torch.tensor(member)
        for i, places in zip(row, where):
            unpack[i, : lengths[i] - 1] = row_i * width + torch.tensor(places[:-1])
            sample = samples[i]
            targets[i, : lengths[i] - 1] = torch.tensor((sample.prompt_token_ids + sample.response_token_ids)[1:])
    return MicroBatch(ids, mask, adv, rlp, packed_attention_mask(segments, members), unpack, rewards,
                       position_ids=positions, targets=targets, teacher_logprobs=teacher, names=names,
                       loss_rows=loss_rows, loss_cols=loss_cols)  # fmt: skip


def _lay_out_row(samples: list[TrainSample]):
    """One row's tokens, RoPE positions, segment (prompt group) and member (-1: shared prompt) per token, and per
    sample the row position of each of its own tokens (prompt then response)."""
    tokens: list[int] = []
    pos: list[int] = []
    seg: list[int] = []
    member: list[int] = []
    where: list[list[int]] = []
    prompt_at = 0
    for k, s in enumerate(samples):
        p, r = len(s.prompt_token_ids), len(s.response_token_ids)
        if k == 0 or s.prompt_token_ids != samples[k - 1].prompt_token_ids:
            prompt_at = len(tokens)
            tokens += s.prompt_token_ids
            pos += range(p)
            seg += [k] * p
            member += [-1] * p
        where.append(list(range(prompt_at, prompt_at + p)) + list(range(len(tokens), len(tokens) + r)))
        tokens += s.response_token_ids
        pos += range(p, p + r)
        seg += [seg[prompt_at]] * r
        member += [k] * r
    return tokens, pos, seg, member, where


@dataclass
class OptimizerStep:
    batches: list[MicroBatch]  # this DP rank's share
    n_tokens: float  # trained tokens of the whole optimizer step, all ranks (the loss normalisers)
    n_seqs: float
    longest: float  # most trained tokens in one sample


def plan_optimizer_steps(
    samples: list[TrainSample],
    step: int,
    training: TrainingConfig,
    pad_id: int,
    dp_size: int,
    dp_rank: int,
    device: torch.device,
) -> list[OptimizerStep]:
    """The step's samples, shuffled, as optimizer steps of this DP rank's micro-batches (on `device`).

    Filters can leave fewer samples than the global batch: the samples are then shared out over as many
    optimizer steps as they fill micro-batches (at most num_steps_per_rollout).
    """
    t = training
    order = list(range(len(samples)))
    random.Random(t.seed * 1_000_003 + step).shuffle(order)
    samples = [samples[i] for i in order]
    mbs = t.micro_batch_size
    n_micro = math.ceil(len(samples) / mbs)
    n_steps = min(t.num_steps_per_rollout, n_micro)
    per_step = math.ceil(n_micro / n_steps) * mbs  # whole micro-batches per optimizer step
    steps = []
    for start in range(0, len(samples), per_step):
        chunk = samples[start : start + per_step]
        lengths = [len(s.prompt_token_ids) + len(s.response_token_ids) for s in chunk]
        prompts = prompt_lengths = None
        if t.share_prompts:
            keys: dict[tuple[int, ...], int] = {}
            prompts = [keys.setdefault(tuple(s.prompt_token_ids), len(keys)) for s in chunk]
            prompt_lengths = [len(s.prompt_token_ids) for s in chunk]
        plans = plan_micro_batches(lengths, mbs, t.max_tokens_per_gpu, prompts, prompt_lengths)
        mine = shard_for_rank(plans, dp_size, dp_rank)
        batches = [collate([chunk[i] for i in p.samples], pad_id, p.rows).to(device) for p in mine]
        steps.append(
            OptimizerStep(
                batches,
                n_tokens=float(sum(sum(s.loss_mask) for s in chunk)),
                n_seqs=float(len(chunk)),
                longest=float(max(sum(s.loss_mask) for s in chunk)),
            )
        )
    return steps
