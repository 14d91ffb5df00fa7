"""Remote pool settings: pools.yaml, the weight store's default URI, and the dtype weight versions are
published in."""

from __future__ import annotations

import json

import pytest
import torch

from sluiceway.flows.config import RunConfig
from sluiceway.flows.pools import load_pools
from sluiceway.infra.errors import UserError
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.weights.store import WeightStore


def test_pools_yaml(tmp_path):
    f = tmp_path / "pools.yaml"
    f.write_text("- {name: a, model: tiny-llama, num_engines: 2, weights_uri: /tmp/w}\n")
    assert load_pools(f).pools[0].num_engines == 2
    f.write_text("seaweedfs: {}\npools:\n  - {name: a, region: eu, model: m, weights_uri: s3://b/w}\n")
    spec = load_pools(f)
    assert spec.seaweedfs is not None and spec.pools[0].region == "eu"
    f.write_text("- {name: a, model: m, weights_uri: w, num_engine: 2}\n")
    with pytest.raises(UserError, match="num_engine"):
        load_pools(f)
    f.write_text("- {name: a, model: m, weights_uri: w}\n- {name: a, model: m, weights_uri: w}\n")
    with pytest.raises(UserError, match="unique"):
        load_pools(f)


def test_weights_uri_default(tmp_path):
    cfg = RunConfig.model_validate({"data": {"prompt_data": "env:arithmetic"}})
    cfg.storage.output_dir = str(tmp_path / "run")
    assert cfg.weights_uri == str(tmp_path / "run" / "weight_store")
    cfg.storage.storage_uri = "s3://bucket/root/"
    assert cfg.weights_uri == f"s3://bucket/root/weights/{cfg.run_id}"
    cfg.sync.weights_uri = "s3://elsewhere/w"
    assert cfg.weights_uri == "s3://elsewhere/w"


@pytest.mark.parametrize("bf16", [False, True])
def test_published_dtype_follows_the_training_dtype(tmp_path, bf16):
    """The trainer writes fp32 masters in a --bf16 run too; the run publishes what its engines serve."""

    from safetensors.torch import save_file

    from sluiceway.tasks.sync.publish import publish_weights, weight_publisher

    cfg = RunConfig.model_validate({"data": {"prompt_data": "env:arithmetic"}, "training": {"bf16": bf16}})
    cfg.storage.output_dir = str(tmp_path / "run")
    hf = tmp_path / "weights" / "v000001"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    save_file({"w": torch.randn(8, 8), "ids": torch.arange(4)}, hf / "model.safetensors")
    publish_weights(weight_publisher(cfg), 1, hf, cfg.weights_uri)
    m = WeightStore(ObjectStore.from_uri(cfg.weights_uri)).manifest(1)
    assert {k: e.dtype for k, e in m.tensors.items()} == {"w": "BF16" if bf16 else "F32", "ids": "I64"}
    # ... and its config says so: an engine loading with dtype "auto" serves the published dtype, not fp32.
    published = json.loads(WeightStore(ObjectStore.from_uri(cfg.weights_uri)).read_file(1, "config.json"))
    assert published == ({"torch_dtype": "bfloat16"} if bf16 else {})


def _rollout_cfg(**rollout) -> dict:
    return {"data": {"prompt_data": "env:arithmetic"}, "rollout": rollout, "sync": {"update_weight_mode": "delta"}}


def test_rollout_pools_take_fixed_pools_auto_and_registry_uris():
    from sluiceway.flows.config.run import validate_for

    cfg = validate_for(_rollout_cfg(rollout_pools=["auto", "east=http://h:1", "s3://replica/w"]), "run")
    assert cfg.remote_pools == [("east", "http://h:1")]
    assert cfg.pool_registry_uris == [cfg.weights_uri, "s3://replica/w"]
    with pytest.raises(ValueError, match="'east' is not NAME=http://HOST:PORT, auto, or a pool registry"):
        validate_for(_rollout_cfg(rollout_pools=["east"]), "run")
    for url in ("http://[::1", "http://h:99999", "http://:1"):  # issue 40: InvalidURL at the first request
        with pytest.raises(ValueError, match="is not NAME=http://HOST:PORT"):
            validate_for(_rollout_cfg(rollout_pools=[f"east={url}"]), "run")


def test_a_run_without_engines_of_its_own_needs_pools_and_no_eval():
    from sluiceway.flows.config.run import validate_for

    with pytest.raises(ValueError, match="no engines: set rollout_num_engines >= 1"):
        validate_for(_rollout_cfg(rollout_num_engines=0), "run")
    cfg = validate_for(_rollout_cfg(rollout_num_engines=0, rollout_pools=["auto"]), "run")
    assert not cfg.has_own_engines
    bad = _rollout_cfg(rollout_num_engines=0, rollout_pools=["auto"]) | {
        "eval": {"eval_interval": 1, "eval_prompt_data": ["env:arithmetic"]}
    }
    with pytest.raises(ValueError, match="eval_interval needs the run's own engines"):
        validate_for(bad, "run")
