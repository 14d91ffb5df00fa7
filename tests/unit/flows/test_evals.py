"""Evaluation you can read: greedy sampling is the argmax, eval sampling settings, the evals table (idempotent,
readable with polars) and its section in `sluiceway report`."""

from __future__ import annotations

import polars as pl
import pytest
import torch

from sluiceway.flows.cli import make_parser, resolve_config
from sluiceway.flows.report import render
from sluiceway.infra.errors import UserError
from sluiceway.models.engine import Engine, GenerateRequest, SamplingParams
from sluiceway.models.engine.sampling import TOP_K_ALL, sample
from sluiceway.models.zoo import load_hf_model, resolve_checkpoint
from sluiceway.storage.evals import EVALS, append_eval_samples, read_evals
from sluiceway.storage.metrics import append_metrics
from sluiceway.storage.object_store import ObjectStore
from sluiceway.tasks.rollout.prompts import eval_rollout_settings
from sluiceway.tasks.rollout.rollout import RolloutSettings

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


# ------------------------------------------------------------------------------------------------ greedy sampling


def test_greedy_rows_pick_the_argmax_whatever_the_seed_or_truncation():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 3
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.7])
    top_k = torch.tensor([TOP_K_ALL, TOP_K_ALL, 5, TOP_K_ALL])
    top_p, min_p = torch.tensor([1.0, 0.9, 0.3, 1.0]), torch.zeros(4)
    greedy_rows = [0, 2]
    draws = set()
    for seed in range(20):
        gens = [torch.Generator().manual_seed(seed * 10 + r) for r in range(4)]
        tokens, logprobs = sample(logits, temperature, top_k, top_p, min_p, gens)
        assert tokens[greedy_rows].tolist() == logits[greedy_rows].argmax(-1).tolist()
        # Reported under the unscaled distribution (T = 1), as the module says.
        ref = torch.log_softmax(logits[greedy_rows], -1).gather(-1, tokens[greedy_rows, None]).squeeze(-1)
        assert torch.allclose(logprobs[greedy_rows], ref)
        draws.add(tokens[1].item())
    assert len(draws) > 1  # the sampled row beside them does sample
    all_greedy = torch.zeros(4)
    tokens, _ = sample(logits, all_greedy, top_k, top_p, min_p, [torch.Generator() for _ in range(4)])
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_engine_at_temperature_0_decodes_the_models_argmax(tmp_path):
    model_dir = resolve_checkpoint("tiny-llama", cache_dir=tmp_path / "cache")
    hf = load_hf_model(model_dir)
    engine = Engine(model_dir, max_running_requests=4, max_total_len=256)
    prompts = [[5, 6, 7, 8], [40, 41]]
    try:

        def greedy(prompt, seed):
            sp = SamplingParams(max_new_tokens=12, temperature=0.0, top_p=0.5, sampling_seed=seed, ignore_eos=True)
            return GenerateRequest(prompt, sp, None)

        sampled = GenerateRequest([9, 9], SamplingParams(max_new_tokens=12, temperature=1.0, sampling_seed=3), None)
        first = engine.generate([greedy(prompts[0], 1), greedy(prompts[1], 2), sampled])
        again = engine.generate([greedy(prompts[0], 77), greedy(prompts[1], 78)])  # other seeds, other batch
    finally:
        engine.shutdown()
    for prompt, out, out2 in zip(prompts, first, again):
        assert out.output_ids == out2.output_ids and len(out.output_ids) == 12
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt + out.output_ids])).logits[0, len(prompt) - 1 : -1].float()
        chosen = logits.gather(-1, torch.tensor(out.output_ids)[:, None]).squeeze(-1)
        # Each token is the model's most likely next token (up to the engine's float rounding).
        assert (logits.max(-1).values - chosen).max() <= 1e-4


# ------------------------------------------------------------------------------------------------ config


def test_eval_sampling_flags_override_the_rollouts():
    base = ["eval", "--eval-prompt-data", "env:arithmetic", "--rollout-temperature", "0.8", "--rollout-top-p", "0.9"]
    rollout = RolloutSettings(2, 32, 0.8, 0.9, [0], 1, 1, 1)
    cfg = resolve_config(make_parser().parse_args(base))
    assert (cfg.eval.eval_temperature, cfg.eval.eval_top_p, cfg.eval.eval_max_response_len) == (None, None, None)
    assert eval_rollout_settings(cfg, rollout) == rollout  # unset: the rollout's values
    flags = ["--eval-temperature", "0", "--eval-top-p", "0.5", "--eval-max-response-len", "7"]
    cfg = resolve_config(make_parser().parse_args(base + flags))
    s = eval_rollout_settings(cfg, rollout)
    assert (s.temperature, s.top_p, s.max_new_tokens) == (0.0, 0.5, 7)  # 0 is greedy, not "unset"
    assert (s.n_samples, s.seed) == (rollout.n_samples, rollout.seed)
    with pytest.raises(UserError, match="eval_temperature"):
        resolve_config(make_parser().parse_args(base + ["--eval-temperature", "-1"]))


# ------------------------------------------------------------------------------------------------ the evals table


def _samples(run_id="r", step=2, temperature=0.0, prompts=2, n=2, answer="seven"):
    return [
        {
            "run_id": run_id,
            "step": step,
            "eval_set": "arith",
            "prompt_index": g,
            "sample_index": i,
            "prompt_id": f"arith:{g}",
            "prompt": f"<|user|> What is {g} + 4? | show work",
            "label": str(g + 4),
            "prompt_token_ids": [1, 2, 3],
            "response_token_ids": [10 + g, 20 + i],
            "response_text": f"{answer} {g}",
            "reward": float(g),
            "reward_details": {"answer": str(g)},
            "finish_reason": "stop",
            "weight_version": step,
            "temperature": temperature,
            "top_p": 1.0,
            "max_new_tokens": 8,
            "sampling_seed": 100 * g + i,
        }
        for g in range(prompts)
        for i in range(n)
    ]


def test_a_non_finite_eval_reward_is_never_written(tmp_path):
    store = ObjectStore.from_uri(str(tmp_path / "tables"))
    samples = _samples()
    samples[3]["reward"] = float("nan")  # the scorers' NaN is a failure (reward 0) before it gets here
    with pytest.raises(ValueError, match="eval sample 3: reward nan is not a finite number"):
        append_eval_samples(store, samples)
    assert read_evals(store, "r").num_rows == 0


def test_eval_samples_are_written_once_per_evaluation(tmp_path):
    store = ObjectStore.from_uri(str(tmp_path / "tables"))
    assert append_eval_samples(store, _samples()) is True
    assert append_eval_samples(store, _samples()) is False  # a retried eval: nothing added
    assert read_evals(store, "r").num_rows == 4
    # Other sampling settings at the same step are another evaluation, kept apart by their columns.
    assert append_eval_samples(store, _samples(temperature=0.7)) is True
    assert append_eval_samples(store, _samples(step=4)) is True
    table = read_evals(store, "r")
    assert table.num_rows == 12 and read_evals(store, "r", step=4).num_rows == 4
    assert sorted(set(zip(table["step"].to_pylist(), table["temperature"].to_pylist()))) == [
        (2, 0.0), (2, 0.7), (4, 0.0)
    ]  # fmt: skip
    assert read_evals(store, "other").num_rows == 0
    # Readable like the trajectories table.
    df = pl.read_delta(str(tmp_path / "tables" / EVALS))
    assert df.height == 12 and df.filter(pl.col("step") == 4)["response_token_ids"].to_list()[0] == [10, 20]
    assert df["reward_details"][0] == '{"answer": "0"}'
    with pytest.raises(ValueError, match="one evaluation per call"):
        append_eval_samples(store, _samples() + _samples(step=3))
    with pytest.raises(ValueError, match="appears twice"):
        append_eval_samples(store, _samples(step=5) + _samples(step=5)[:1])
    with pytest.raises(ValueError, match="missing fields"):
        append_eval_samples(store, [{k: v for k, v in _samples()[0].items() if k != "reward"}])
    assert read_evals(store, "r").num_rows == 12


def test_report_shows_eval_samples_per_set_and_step(tmp_path):
    run = tmp_path / "myrun"
    store = ObjectStore.from_uri(str(run / "tables"))
    append_metrics(store, "myrun", 0, {"reward_mean": 0.5}, tag="train")
    text = render(run)
    assert "Evaluation samples" not in text  # no samples, no section
    append_eval_samples(store, _samples(run_id="myrun", step=0, prompts=4, n=1, answer="x" * 200))
    append_eval_samples(store, _samples(run_id="myrun", step=0, temperature=0.7))
    text = render(run)
    assert "## Evaluation samples" in text
    assert "**arith**, step 0 (greedy, at most 8 tokens): 4 samples, mean reward 1.500" in text
    assert "**arith**, step 0 (temperature 0.7, top_p 1, at most 8 tokens): 4 samples, mean reward 0.500" in text
    examples = [ln for ln in text.splitlines() if "What is" in ln]
    assert len(examples) == 3 + 3  # three examples per evaluation
    # One line per answer, pipes escaped, long answers cut.
    assert "show work" in examples[0] and "\\| show work" in examples[0] and "x" * 79 + "…" in examples[0]
    assert "x" * 81 not in text


# ------------------------------------------------------------------------------------------------ end to end
