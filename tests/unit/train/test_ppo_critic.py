"""PPO with a megatron-core critic and token-level REINFORCE++ in the trainer, on tiny-llama.

By hand: per-token advantages in the trainer's micro-batch layout (masked tokens, a one-token response, whitening
across micro-batches) and GAE targets. Then the real thing: the value head, a PPO step that trains policy and
critic, the clipped value loss, REINFORCE++'s reward-side KL to the reference, the critic-only warm-up, and a
checkpoint round trip that resumes bit-identically with the critic.
"""

import math

import pytest
import torch
from torch.nn.functional import pad
from trainer_helpers import make_trainer, sequence_logprob

from sluiceway.flows.cli import make_parser, resolve_config
from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
from sluiceway.infra.errors import UserError
from sluiceway.models.value_model import ValueHead
from sluiceway.tasks.train.advantages import ValueTargets, masked_whiten, reinforce_pp_returns, token_advantages
from sluiceway.tasks.train.collation import collate
from sluiceway.tasks.train.losses import kl_penalty
from sluiceway.tasks.train.parallel import is_tensor_parallel
from sluiceway.tasks.train.samples import TrainSample
from sluiceway.tasks.train.trainer import PolicyTrainer

PROMPT = [5, 6]  # two prompt tokens: response token j is scored at index 1 + j


def hand_samples() -> list[TrainSample]:
    """A: three tokens, the middle one masked (a tool output), reward 1; B: one token, reward 0; C: two, reward 2."""
    specs = [([7, 8, 9], [1, 0, 1], 1.0), ([7], [1], 0.0), ([8, 9], [1, 1], 2.0)]
    return [TrainSample(PROMPT, r, m, 0.0, [0.0] * len(r), reward=w) for r, m, w in specs]


def not_needed(mb):
    raise AssertionError("kl_coef = 0: no policy or reference log-probs are needed")


def policy_masters(trainer):
    return [m.detach().clone() for m in trainer.master]


def critic_masters(trainer):
    return [m.detach().clone() for m in trainer.critic.master]


def changed(before, after):
    return any(not torch.equal(a, b) for a, b in zip(before, after))


def ppo_samples(tok, rewards):
    prompt = tok.encode("What is 2 + 3?")
    # As many tokens in the right answers as in the wrong ones (2 + 5 each): whitening keeps them symmetric.
    responses = [tok.encode(t) for t in (" 5", " 7", " The answer is 5", " It is 7")]
    return [TrainSample(prompt, r, [1] * len(r), 0.0, [0.0] * len(r), reward=w) for r, w in zip(responses, rewards)]


# ---------------------------------------------------------------------------------------------------------------------
# By hand
# ---------------------------------------------------------------------------------------------------------------------


def test_reinforce_pp_advantages_by_hand_across_micro_batches():
    """gamma 0.5 over trained tokens only: A's masked middle token is skipped, B's single token gets its reward.

    Returns on trained tokens: A [0.5, -, 1], B [0], C [1, 2]; mean 0.9, sample std sqrt(0.55); the whitening
    spans both micro-batches, so the result equals one whitening of the whole batch.
    """
    a, b, c = hand_samples()
    steps = [[collate([a, b], pad_id=0)], [collate([c], pad_id=0)]]
    algo = AlgorithmConfig(advantage_estimator="reinforce_plus_plus", gamma=0.5)
    targets, metrics = token_advantages(steps, algo, not_needed, None, None)
    assert targets is None  # no critic
    std = math.sqrt(2.2 / 4)  # squared deviations 0.16 + 0.01 + 0.81 + 0.01 + 1.21 = 2.2 over 5 tokens, n - 1 = 4
    w = lambda g: (g - 0.9) / math.sqrt(std**2 + 1e-8)  # noqa: E731
    ab, cc = steps[0][0].advantages, steps[1][0].advantages
    torch.testing.assert_close(ab[0], torch.tensor([0.0, w(0.5), 0.0, w(1.0)]))  # index 2: the masked token
    torch.testing.assert_close(ab[1], torch.tensor([0.0, w(0.0), 0.0, 0.0]))  # one token, then padding
    torch.testing.assert_close(cc[0], torch.tensor([0.0, w(1.0), w(2.0)]))
    # adv_std is the population std of the whitened advantages: sqrt((n - 1) / n) = sqrt(4/5)
    assert metrics["adv_mean"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["adv_std"] == pytest.approx(math.sqrt(0.8), abs=1e-5)
    assert metrics["adv_max"] == pytest.approx(w(2.0), rel=1e-6) and metrics["adv_min"] == pytest.approx(w(0.0))
    # The same as advantages.reinforce_pp_returns on the batch in one tensor.
    whole = collate([a, b, c], pad_id=0)
    torch.testing.assert_close(
        reinforce_pp_returns(whole.rewards, whole.loss_mask, gamma=0.5), torch.cat([ab, pad(cc, (0, 1))])
    )


def test_ppo_gae_targets_by_hand_on_the_critic_values(tiny):  # noqa: F811
    """With lambda = 1 the GAE return is the discounted reward whatever the values: R_t = gamma^(trained tokens
    after t) x reward; the advantage before whitening is R_t - V_t, V being the critic's values before the step."""
    path, tok = tiny
    trainer = make_trainer(path, tok, advantage_estimator="ppo", gamma=0.5, lambd=1.0)
    a, b, c = hand_samples()
    steps = [[collate([a, b], pad_id=0)], [collate([c], pad_id=0)]]
    targets, metrics = token_advantages(steps, trainer.algorithm, not_needed, None, trainer.critic)
    (t_ab,), (t_c,) = targets
    with torch.no_grad():
        assert torch.equal(t_ab.old_values, trainer.critic.values(steps[0][0]))
    expect_ab = torch.tensor([[0.0, 0.5, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(t_ab.returns, expect_ab)
    torch.testing.assert_close(t_c.returns, torch.tensor([[0.0, 1.0, 2.0]]))
    # Advantages: R - V over the trained tokens, whitened over the whole batch (5 tokens).
    mbs, tgs = [steps[0][0], steps[1][0]], [t_ab, t_c]
    raw = torch.cat([(t.returns - t.old_values)[mb.loss_mask > 0] for t, mb in zip(tgs, mbs)])
    advantages = torch.cat([mb.advantages[mb.loss_mask > 0] for mb in mbs])
    torch.testing.assert_close(advantages, masked_whiten(raw, torch.ones_like(raw)))
    values = torch.cat([t.old_values[mb.loss_mask > 0] for t, mb in zip(tgs, mbs)])
    returns = torch.tensor([0.5, 1.0, 0.0, 1.0, 2.0])
    assert metrics["value_mean"] == pytest.approx(float(values.mean()), abs=1e-6)
    assert metrics["returns_mean"] == pytest.approx(0.9)
    explained = 1 - float((returns - values).var(unbiased=False) / returns.var(unbiased=False))
    assert metrics["explained_var"] == pytest.approx(explained, abs=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# The critic on megatron-core
# ---------------------------------------------------------------------------------------------------------------------


def test_value_head_is_a_replicated_scalar_on_its_own_copy_of_the_model(tiny):  # noqa: F811
    path, tok = tiny
    trainer = make_trainer(path, tok, advantage_estimator="ppo")
    critic = trainer.critic
    head = critic.model.output_layer
    assert isinstance(head, ValueHead) and head.weight.shape == (1, trainer.hf_config.hidden_size)
    assert not is_tensor_parallel(head.weight) and not getattr(head.weight, "tensor_model_parallel", False)
    assert trainer.ref_model is None  # kl_coef = 0 and no KL loss: no reference
    # Same HF weights as the policy, but separate tensors.
    policy = dict(trainer.model.named_parameters())
    for name, p in critic.model.named_parameters():
        if name != "output_layer.weight":
            assert torch.equal(p, policy[name]) and p.data_ptr() != policy[name].data_ptr()
    mb = collate(ppo_samples(tok, [1.0, 0.0, 1.0, 0.0])[:2], trainer.pad_token_id)
    with torch.no_grad():
        v = critic.values(mb)
    assert v.shape == mb.loss_mask.shape and v.dtype == torch.float32 and v.abs().max() < 1.0  # small init


@pytest.mark.parametrize("bf16", [False, True])
def test_ppo_step_trains_policy_and_critic_and_reports_value_metrics(tiny, bf16):  # noqa: F811
    path, tok = tiny
    trainer = make_trainer(path, tok, bf16=bf16, advantage_estimator="ppo")
    batch = ppo_samples(tok, [1.0, 0.0, 1.0, 0.0])
    pol, cri = policy_masters(trainer), critic_masters(trainer)
    before = [sequence_logprob(trainer, s) for s in batch]
    metrics = trainer.train_rollout(batch, step=0)
    after = [sequence_logprob(trainer, s) for s in batch]
    assert changed(pol, policy_masters(trainer)) and changed(cri, critic_masters(trainer))
    assert after[0] > before[0] and after[2] > before[2]  # rewarded answers more likely
    assert after[1] < before[1] and after[3] < before[3]
    for key in ("value_loss", "value_clipfrac", "explained_var", "value_mean", "returns_mean", "critic_grad_norm"):
        assert math.isfinite(metrics[key]), key
    assert metrics["returns_mean"] == pytest.approx(0.5)  # gamma 1: every token's return is its reward; 7 of 14
    assert metrics["value_clipfrac"] == 0.0  # one optimizer step: the values are still the old ones
    assert metrics["adv_mean"] == pytest.approx(0.0, abs=1e-5)  # whitened over the batch's tokens
    assert all(m.dtype == torch.float32 for m in trainer.critic.master)
    # The critic learnt: its loss on the same batch went down.
    assert trainer.train_rollout(batch, step=1)["value_loss"] < metrics["value_loss"]


def test_packed_micro_batches_give_the_same_ppo_step(tiny):  # noqa: F811
    """Packing (several samples per row, kept apart by the attention mask) or sharing the prompt between its samples'
    responses changes neither the values, the whitened advantages nor the losses: the critic reads its values in the
    same per-sample layout."""
    path, tok = tiny
    runs = []
    for packing, share in ((None, False), (64, False), (None, True), (64, True)):
        training = TrainingConfig(
            global_batch_size=4,
            micro_batch_size=2,
            lr=1e-2,
            hf_checkpoint=str(path),
            max_tokens_per_gpu=packing,
            share_prompts=share,
        )
        algo = AlgorithmConfig(advantage_estimator="ppo", gamma=0.9, lambd=0.8)
        trainer = PolicyTrainer(path, training, algo, temperature=1.0, pad_token_id=tok.pad_token_id)
        runs.append(trainer.train_rollout(ppo_samples(tok, [1.0, 0.0, 1.0, 0.0]), step=0))
    for run in runs[1:]:
        for key in ("value_mean", "returns_mean", "explained_var", "adv_min", "adv_max", "value_loss", "loss"):
            assert run[key] == pytest.approx(runs[0][key], abs=1e-5), key


def test_value_loss_clipped_vs_unclipped(tiny):  # noqa: F811
    """Values 1 above their old values with returns 1 above the values: the clipped value (old + 0.2) is 1.8 from the
    return, so the loss is 0.5 x 1.8^2 on every token and no gradient flows; unclipped it is 0.5 x 1^2 and the
    critic moves."""
    path, tok = tiny
    trainer = make_trainer(path, tok, advantage_estimator="ppo", value_clip=0.2)
    critic = trainer.critic
    mb = collate(ppo_samples(tok, [1.0, 0.0, 1.0, 0.0]), trainer.pad_token_id)
    with torch.no_grad():
        v = critic.values(mb)
    targets = [ValueTargets(old_values=v - 1.0, returns=v + 1.0)]
    n = float(mb.loss_mask.sum())
    before = critic_masters(trainer)
    m = critic.train_step([mb], targets, n)
    assert m["value_loss"] == pytest.approx(0.5 * 1.8**2, rel=1e-5) and m["value_clipfrac"] == pytest.approx(1.0)
    assert m["critic_grad_norm"] == 0.0 and not changed(before, critic_masters(trainer))
    critic.algorithm = AlgorithmConfig(advantage_estimator="ppo", value_clip=None)
    m = critic.train_step([mb], targets, n)
    assert m["value_loss"] == pytest.approx(0.5, rel=1e-5) and m["value_clipfrac"] == 0.0
    assert m["critic_grad_norm"] > 0 and changed(before, critic_masters(trainer))


def test_critic_only_warm_up_leaves_the_policy_alone(tiny):  # noqa: F811
    path, tok = tiny
    trainer = make_trainer(path, tok, advantage_estimator="ppo", num_critic_only_steps=1)
    batch = ppo_samples(tok, [1.0, 0.0, 1.0, 0.0])
    pol, cri = policy_masters(trainer), critic_masters(trainer)
    trainer.train_rollout(batch, step=0)
    assert not changed(pol, policy_masters(trainer)) and changed(cri, critic_masters(trainer))
    trainer.train_rollout(batch, step=1)
    assert changed(pol, policy_masters(trainer))


# ---------------------------------------------------------------------------------------------------------------------
# REINFORCE++ with the reward-side KL
# ---------------------------------------------------------------------------------------------------------------------


def test_reinforce_plus_plus_with_kl_coef_shapes_rewards_with_the_reference(tiny):  # noqa: F811
    path, tok = tiny
    assert make_trainer(path, tok, advantage_estimator="reinforce_plus_plus").ref_model is None
    trainer = make_trainer(path, tok, advantage_estimator="reinforce_plus_plus", kl_coef=0.5, kl_loss_type="k1")
    assert trainer.ref_model is not None and trainer.critic is None
    batch = ppo_samples(tok, [1.0, 0.0, 1.0, 0.0])
    first = trainer.train_rollout(batch, step=0)
    assert first["reward_kl"] == 0.0  # the policy is the reference before its first step
    # After a step the policy has moved: advantages = whitened returns of reward - 0.5 x k1 per token.
    mb = collate(batch, trainer.pad_token_id)
    with torch.no_grad():
        logp = trainer._logprobs(trainer.model, mb)[0]
        ref = trainer._logprobs(trainer.ref_model, mb)[0]
    kl = kl_penalty(logp, ref, "k1") * mb.loss_mask
    expected = reinforce_pp_returns(mb.rewards, mb.loss_mask, kl, kl_coef=0.5, gamma=1.0)
    policy = lambda m: trainer._logprobs(trainer.model, m)[0]  # noqa: E731
    reference = lambda m: trainer._logprobs(trainer.ref_model, m)[0]  # noqa: E731
    _, metrics = token_advantages([[mb]], trainer.algorithm, policy, reference, None)
    torch.testing.assert_close(mb.advantages, expected, atol=1e-5, rtol=1e-5)
    assert metrics["reward_kl"] == pytest.approx(float(kl.sum() / mb.loss_mask.sum()), abs=1e-6) and kl.abs().sum() > 0
    assert trainer.train_rollout(batch, step=1)["reward_kl"] != 0.0


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoint
# ---------------------------------------------------------------------------------------------------------------------


def test_checkpoint_with_the_critic_resumes_bit_identically(tiny, tmp_path):  # noqa: F811
    """Train 2 rollouts, save, train 1 more; a fresh trainer that loads and trains the same rollout lands on the same
    bits, policy and critic (weights and AdamW state)."""
    path, tok = tiny
    rollouts = [ppo_samples(tok, r) for r in ([1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0])]
    a = make_trainer(path, tok, advantage_estimator="ppo")
    for step, batch in enumerate(rollouts[:2]):
        a.train_rollout(batch, step)
    a.save(tmp_path / "ckpt", step=1)
    a.train_rollout(rollouts[2], step=2)
    b = make_trainer(path, tok, advantage_estimator="ppo")
    assert b.load(tmp_path / "ckpt") == 1 and b.critic.rollouts_trained == 2
    b.train_rollout(rollouts[2], step=2)
    assert all(torch.equal(x, y) for x, y in zip(a.master, b.master))
    assert all(torch.equal(x, y) for x, y in zip(a.critic.master, b.critic.master))
    assert all(torch.equal(x, y) for x, y in zip(a.critic.model.parameters(), b.critic.model.parameters()))
    sa, sb = a.critic.optimizer.state_dict()["state"], b.critic.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)


def test_a_checkpoint_without_a_critic_is_refused_by_a_ppo_trainer(tiny, tmp_path):  # noqa: F811
    path, tok = tiny
    grpo = make_trainer(path, tok)
    grpo.save(tmp_path / "ckpt", step=0)
    with pytest.raises(RuntimeError, match="no critic"):
        make_trainer(path, tok, advantage_estimator="ppo").load(tmp_path / "ckpt")


# ---------------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------------


def cfg(*flags):
    return resolve_config(make_parser().parse_args(["run", "--prompt-data", "env:arithmetic", *flags]))


def test_config_token_level_estimators_and_their_invariants():
    c = cfg("--advantage-estimator", "ppo", "--rollout-batch-size", "64", "--n-samples-per-prompt", "1",
            "--gamma", "0.99", "--lambd", "0.95", "--value-clip", "0.5", "--critic-lr", "1e-5",
            "--num-critic-only-steps", "2")  # fmt: skip
    a = c.algorithm
    assert (a.gamma, a.lambd, a.value_clip, a.critic_lr, a.num_critic_only_steps) == (0.99, 0.95, 0.5, 1e-5, 2)
    assert cfg("--advantage-estimator", "reinforce_plus_plus", "--kl-coef", "0.01").algorithm.kl_coef == 0.01
    with pytest.raises(UserError, match="kl_coef"):
        cfg("--kl-coef", "0.01")  # grpo: the KL goes in the loss (--use-kl-loss), not the reward
    with pytest.raises(UserError, match="critic_lr"):
        cfg("--critic-lr", "1e-5")
    with pytest.raises(UserError, match="num_critic_only_steps"):
        cfg("--advantage-estimator", "ppo", "--num-critic-only-steps", "10", "--num-rollout", "10")
