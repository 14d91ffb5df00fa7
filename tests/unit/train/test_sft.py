"""Supervised fine-tuning in process: loss masks from the chat template, record formats, learning on tiny-llama."""

import json

import pytest
import torch

from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
from sluiceway.infra.errors import UserError
from sluiceway.models.chat import encode_prompt, render_prompt
from sluiceway.models.megatron_logprobs import token_logprobs
from sluiceway.storage.datasets import import_prompts, load_prompts
from sluiceway.storage.object_store import ObjectStore
from sluiceway.tasks.train.collation import collate
from sluiceway.tasks.train.sft_data import SftSettings, encode_row, sft_samples
from sluiceway.tasks.train.trainer import PolicyTrainer

TWO_TURNS = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "The answer is 5."},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "8"},
]


def trained_runs(tok, ids, mask):
    """The decoded text of each run of consecutive trained tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs, cur = runs + [cur], []
    runs += [cur] if cur else []
    return [tok.decode(r) for r in runs]


def test_two_turn_loss_mask(tiny):
    _, tok = tiny  # tests/conftest.py: the session's tiny-llama build, copied
    ids, mask = encode_row(tok, {"messages": TWO_TURNS}, SftSettings(), "f.jsonl:1", has_response=False)
    assert len(ids) == len(mask)
    # Trained: each assistant content and its end-of-turn token; not the header, not the newline after.
    assert trained_runs(tok, ids, mask) == ["The answer is 5.<|im_end|>", "8<|im_end|>"]
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    header = [im_start] + tok.encode("assistant\n", add_special_tokens=False)
    for start in [i for i in range(len(ids)) if ids[i : i + len(header)] == header]:
        assert mask[start : start + len(header)] == [0] * len(header)  # headers are never trained
        assert mask[start + len(header)] == 1  # the content right after is
    assert ids[-1] == im_end and mask[-1] == 1  # the sample ends at the last trained token
    # The prompt part is exactly the tokens the engine is given for the first user turn (token-in, token-out).
    prompt = encode_prompt(tok, render_prompt(tok, TWO_TURNS[:1], apply_chat_template=True))
    assert ids[: len(prompt)] == prompt and sum(mask[: len(prompt)]) == 0
    text = tok.apply_chat_template(TWO_TURNS, tokenize=False)
    assert tok.decode(ids) == text.removesuffix("\n")


def test_prompt_response_records(tiny, tmp_path):
    _, tok = tiny
    data = tmp_path / "pairs.jsonl"
    data.write_text(
        json.dumps({"prompt": "What is 1 + 1?", "response": "The answer is 2."})
        + "\n"
        + json.dumps({"prompt": [{"role": "user", "content": "Hi"}], "response": "Hello!"})
        + "\n"
    )
    store = ObjectStore.from_uri(str(tmp_path / "tables"))
    import_prompts(data, store, "datasets/pairs", input_key="prompt", label_key="response")
    rows = load_prompts(store, "datasets/pairs")
    where = lambda row: f"{data}:{row['prompt_id'].rsplit(':', 1)[1]}"  # noqa: E731
    chat = sft_samples(rows, tok, SftSettings(apply_chat_template=True), where, has_response=True)
    texts = [tok.decode(s.response_token_ids) for s in chat]
    assert texts == ["The answer is 2.<|im_end|>", "Hello!<|im_end|>"]
    assert tok.decode(chat[0].prompt_token_ids).endswith("<|im_start|>assistant\n")
    # A text prompt without the chat template is a completion: response, then EOS.
    plain = sft_samples(rows[:1], tok, SftSettings(), where, has_response=True)[0]
    assert tok.decode(plain.prompt_token_ids) == "What is 1 + 1?"
    assert tok.decode(plain.response_token_ids) == "The answer is 2.<|im_end|>" and all(plain.loss_mask)
    # Over-long: an error naming file and line, or the tail cut when asked.
    with pytest.raises(UserError, match=r"pairs.jsonl:1: \d+ tokens exceeds --sft-max-len 8"):
        sft_samples(rows[:1], tok, SftSettings(apply_chat_template=True, max_len=8), where, has_response=True)
    cut = sft_samples(rows[:1], tok, SftSettings(max_len=9, truncate=True), where, has_response=True)[0]
    assert len(cut.prompt_token_ids) + len(cut.response_token_ids) == 9


def sequence_nll(trainer, samples):
    """Mean NLL per trained token over `samples`, computed here, not by the trainer."""
    mb = collate(samples, trainer.pad_token_id)
    with torch.no_grad():
        lp = token_logprobs(trainer.model, mb.input_ids)
    return float(-(lp * mb.loss_mask).sum() / mb.loss_mask.sum())


def test_sft_steps_lower_the_loss(tiny):
    path, tok = tiny
    convs = [
        [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": f"It is {a + b}."}]
        for a, b in [(1, 2), (3, 4), (5, 1), (2, 2)]
    ]
    rows = [{"messages": c, "prompt_id": f"d:{i + 1}"} for i, c in enumerate(convs)]
    samples = sft_samples(rows, tok, SftSettings(), lambda r: r["prompt_id"], has_response=False)
    training = TrainingConfig(global_batch_size=4, micro_batch_size=2, lr=1e-2, hf_checkpoint=str(path))
    trainer = PolicyTrainer(path, training, AlgorithmConfig(loss_type="sft_loss"), 1.0, tok.pad_token_id)
    before = sequence_nll(trainer, samples)
    metrics = [trainer.train_sft(samples, step) for step in range(4)]
    after = sequence_nll(trainer, samples)
    assert after < before - 0.5, (before, after)
    assert metrics[0]["loss"] == pytest.approx(before, rel=1e-4)  # the token mean over the global batch
    assert metrics[0]["tokens"] == sum(sum(s.loss_mask) for s in samples)
    assert all(m["grad_norm"] > 0 and m["lr"] == 1e-2 and m["tokens_per_s"] > 0 for m in metrics)
    assert trainer.weight_version == 4
