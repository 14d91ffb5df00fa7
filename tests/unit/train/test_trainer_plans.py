"""How the trainer lays samples out, in process on tiny-llama: plans cover every sample once, a prompt shared
by its samples is laid out once, and row layouts change neither loss nor gradients."""

import pytest
from trainer_group_helpers import assert_same, batch, local_trainer, trainer_kwargs

from sluiceway.tasks.train.collation import collate
from sluiceway.tasks.train.micro_batches import plan_micro_batches, shard_for_rank
from sluiceway.tasks.train.samples import TrainSample

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_plans_cover_every_sample_once():
    lengths = [30, 5, 12, 40, 7, 7, 22, 9]
    packed = plan_micro_batches(lengths, micro_batch_size=2, max_tokens=45)
    assert sorted(i for p in packed for i in p.samples) == list(range(8))
    assert all(p.tokens <= 45 for p in packed)
    assert plan_micro_batches([50, 3], 2, max_tokens=45)[0].samples == [0]  # too long: a row of its own
    # Unpacked: similar lengths share a micro-batch (24 padded positions instead of 66 in arrival order).
    unpacked = plan_micro_batches(lengths, 2, None)
    assert [p.samples for p in unpacked] == [[1, 4], [5, 7], [2, 6], [0, 3]]
    assert sum(p.tokens for p in unpacked) - sum(lengths) == 24
    for plans in (packed, plan_micro_batches(lengths, 2, None)):
        shares = [shard_for_rank(plans, 2, r) for r in range(2)]
        ids = sorted(i for share in shares for p in share for i in p.samples)
        assert ids == list(range(8))  # each micro-batch to exactly one DP rank


def test_shared_prompt_rows_lay_out_each_prompt_once():
    # Samples 0, 2, 3 share prompt 7 (length 10), 1 and 4 prompt 9 (length 5); lengths are prompt + response.
    lengths, prompts, prompt_lengths = [14, 8, 12, 11, 6], [7, 9, 7, 7, 9], [10, 5, 10, 10, 5]
    plans = plan_micro_batches(lengths, 3, None, prompts, prompt_lengths)
    rows = [[p.samples[k] for k in row] for p in plans for row in p.rows]
    assert sorted(map(sorted, rows)) == [[0, 2, 3], [1, 4]]
    assert sum(p.tokens for p in plans) == (5 + 3 + 1) + (10 + 4 + 2 + 1)  # each prompt once, padding included
    two = plan_micro_batches(lengths, 2, None, prompts, prompt_lengths)  # at most micro_batch_size samples each
    assert all(len(p.samples) <= 2 for p in two) and sorted(i for p in two for i in p.samples) == list(range(5))
    budget = plan_micro_batches(lengths, 8, 16, prompts, prompt_lengths)  # rows of at most 16 tokens
    assert all(p.tokens <= 16 and len(p.rows) == 1 for p in budget)
    assert sorted(i for p in budget for i in p.samples) == list(range(5))
    assert len(budget) == 3  # prompt 7 splits into [0, 2] (10+4+2) and [3] (10+1); [1, 4] (5+3+1) fits neither


def test_collate_lays_out_shared_prompts():
    a, b = TrainSample([1, 2, 3], [4, 5], [1, 1], 1.0, [0.0] * 2), TrainSample([1, 2, 3], [6], [1], -1.0, [0.0])
    mb = collate([a, b], pad_id=0, rows=[[0, 1]])
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 6]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 3]]
    # Sample b's tokens (prompt then response) sit at row positions 0, 1, 2, 5; it predicts 2, 3, 6.
    assert mb.unpack[1, :3].tolist() == [0, 1, 2] and mb.targets[1, :3].tolist() == [2, 3, 6]
    assert mb.unpack[0].tolist() == [0, 1, 2, 3] and mb.targets[0].tolist() == [2, 3, 4, 5]
    allowed = ~mb.attention_mask[0, 0]
    assert allowed[5].tolist() == [True, True, True, False, False, True]  # b's response: its prompt and itself
    assert allowed[3].tolist() == [True, True, True, True, True, False]  # a's response never sees b's


@pytest.mark.parametrize(
    "layout", [{"share_prompts": True}, {"max_tokens_per_gpu": 40}, {"max_tokens_per_gpu": 40, "share_prompts": True}]
)
def test_row_layouts_change_neither_loss_nor_gradients(tiny, layout):
    path, tok = tiny
    ref = local_trainer(trainer_kwargs(path, tok, share_prompts=False)).gradients(batch(tok), step=0)
    laid_out = local_trainer(trainer_kwargs(path, tok, **({"share_prompts": False} | layout))).gradients(
        batch(tok), step=0
    )
    assert_same(laid_out, ref)
