"""A NaN or inf never reaches the weights: a non-finite reward, advantage or log-prob, loss or gradient stops the
step before the optimizer steps, with one line naming the step and, where one sample is to blame, the sample."""

import pytest
import torch
from trainer_helpers import make_trainer

from sluiceway.flows.faults import explain
from sluiceway.storage.tables import conform
from sluiceway.storage.trajectories import TRAJECTORY_SCHEMA, _rows_to_table
from sluiceway.tasks.train.batch import build_train_samples
from sluiceway.tasks.train.samples import NonFiniteTraining, TrainSample, check_samples

NAN = float("nan")


def rows(bad_reward: float) -> list[dict]:
    from storage_helpers import batch

    out = batch(step=3, groups=(0, 1), samples=2)
    for r in out:
        r["reward"] = bad_reward if (r["group_id"], r["sample_index"]) == (1, 0) else float(r["sample_index"])
    return out


@pytest.mark.parametrize("bad", [NAN, float("inf")])
def test_build_train_samples_refuses_a_non_finite_reward_naming_the_sample(bad):
    # Past the table writer's own check, as a table from a build before it could hold it.
    table = conform(_rows_to_table(rows(bad)), TRAJECTORY_SCHEMA, what="trajectory")
    with pytest.raises(NonFiniteTraining) as info:
        build_train_samples(table, "grpo", True)
    line = str(info.value)
    assert f"step 3 (group 1, sample 0) has a non-finite reward {bad!r}" in line and "\n" not in line
    assert "`sluiceway resume`" in line
    assert explain(info.value).message == line and explain(info.value).exit_code == 1  # the terminal's one line


def test_train_samples_name_their_rows():
    table = conform(_rows_to_table(rows(0.5)), TRAJECTORY_SCHEMA, what="trajectory")
    samples = build_train_samples(table, "grpo", True)
    assert [(s.group_id, s.sample_index) for s in samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert samples[2].name == " (group 1, sample 0)"


@pytest.mark.parametrize(
    "change, words",
    [
        ({"advantage": NAN}, "non-finite advantage nan"),
        ({"rollout_logprobs": [-0.5, float("-inf")]}, "non-finite rollout log-prob -inf"),
        ({"teacher_logprobs": [NAN, -1.0]}, "non-finite teacher log-prob nan"),
        ({"reward": float("inf")}, "non-finite reward inf"),
    ],
)
def test_check_samples_names_the_sample_and_what(change, words):
    good = dict(prompt_token_ids=[1, 2], response_token_ids=[3, 4], loss_mask=[1, 1], advantage=0.5,
                rollout_logprobs=[-0.5, -0.5], group_id=0, sample_index=0)  # fmt: skip
    samples = [TrainSample(**good), TrainSample(**(good | {"group_id": 4, "sample_index": 2} | change))]
    with pytest.raises(NonFiniteTraining, match=rf"step 7 \(group 4, sample 2\) has a {words}"):
        check_samples(samples, step=7)
    check_samples(samples[:1], step=7)  # finite: nothing to say


def batch(tok, **change):
    prompt = tok.encode("What is 2 + 3?")
    out = []
    for i, text in enumerate([" 5", " 7", " The answer is 5", " no"]):
        r = tok.encode(text)
        out.append(TrainSample(prompt, r, [1] * len(r), [1.0, -1.0][i % 2], [-1.0] * len(r), group_id=i // 2,
                               sample_index=i % 2, reward=float(i % 2)))  # fmt: skip
    for k, v in change.items():
        setattr(out[3], k, v)
    return out


def unchanged(trainer, before) -> bool:
    return trainer.weight_version == 0 and all(torch.equal(before[k], v) for k, v in trainer.hf_state_dict().items())


def test_a_non_finite_rollout_logprob_is_refused_before_the_step(tiny):
    """Today a NaN engine log-prob only reaches the mismatch metrics, so the step would go on: refused instead."""
    path, tok = tiny
    trainer = make_trainer(path, tok)
    before = {k: v.clone() for k, v in trainer.hf_state_dict().items()}
    bad = batch(tok)
    bad[3].rollout_logprobs = [NAN] * len(bad[3].response_token_ids)
    with pytest.raises(NonFiniteTraining, match=r"step 5 \(group 1, sample 1\) has a non-finite rollout log-prob nan"):
        trainer.train_rollout(bad, step=5)
    assert unchanged(trainer, before)


@pytest.mark.parametrize("bf16", [False, True])
def test_a_nan_loss_from_one_sample_stops_before_the_optimizer_step_naming_it(tiny, monkeypatch, bf16):
    path, tok = tiny
    trainer = make_trainer(path, tok, bf16=bf16)
    before = {k: v.clone() for k, v in trainer.hf_state_dict().items()}
    logprobs = trainer._logprobs

    def one_sample_nan(model, mb, temperature=None):  # the policy's log-probs of (group 1, sample 1) go NaN
        logp, ent = logprobs(model, mb, temperature)
        rows = [i for i, n in enumerate(mb.names) if n == " (group 1, sample 1)"]
        if model is trainer.model and rows:
            logp = logp.clone()
            logp[rows[0]] = NAN
        return logp, ent

    monkeypatch.setattr(trainer, "_logprobs", one_sample_nan)
    with pytest.raises(NonFiniteTraining) as info:
        trainer.train_rollout(batch(tok), step=1)
    line = str(info.value)
    assert line.startswith("train: non-finite loss nan at step 1 (weight version 0) from sample (group 1, sample 1): "
                           "its policy log-prob is nan; refused before the optimizer step")  # fmt: skip
    assert "\n" not in line
    assert unchanged(trainer, before)  # today's trainer stepped first and raised after
    assert all(p.grad is None for p in trainer.model.parameters())
    # Nothing of the refused step lingers: the next good step is the one a fresh trainer takes.
    monkeypatch.undo()
    trainer.train_rollout(batch(tok), step=1)
    fresh = make_trainer(path, tok, bf16=bf16)
    fresh.train_rollout(batch(tok), step=1)
    assert all(torch.equal(a, b) for a, b in zip(trainer.master, fresh.master))


def test_a_nan_gradient_with_a_finite_loss_stops_before_the_optimizer_step(tiny):
    path, tok = tiny
    trainer = make_trainer(path, tok, bf16=True)
    before = {k: v.clone() for k, v in trainer.hf_state_dict().items()}
    next(trainer.model.parameters()).register_hook(lambda g: g * NAN)
    with pytest.raises(NonFiniteTraining, match=r"non-finite gradient norm nan at step 2 \(weight version 0\); "):
        trainer.train_rollout(batch(tok), step=2)
    assert unchanged(trainer, before)
    assert not trainer.optimizer.state  # AdamW never stepped: no moments
