"""`sluiceway run --advantage-estimator rloo --policy-loss cispo|sapo` on tiny-llama trains: finite losses, moved
weights (the formulas are checked by hand in tests/unit/train/test_rloo_cispo_sapo.py)."""

import math

import pytest
import torch
from cli_run import run_cli

from sluiceway.models.hf_megatron import hf_to_megatron
from sluiceway.models.zoo import load_hf_model, resolve_checkpoint
from sluiceway.storage.metrics import read_metrics
from sluiceway.storage.object_store import ObjectStore

pytestmark = pytest.mark.shared_prefect  # its runs use the worker's Prefect server: tests/integration/conftest.py


@pytest.mark.parametrize("policy_loss", ["cispo", "sapo"])
def test_rloo_with_cispo_or_sapo_trains(tmp_path, policy_loss):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    run_cli(run_dir, cache, "--num-rollout", "2", "--advantage-estimator", "rloo", "--policy-loss", policy_loss)
    m = read_metrics(ObjectStore.from_uri(str(run_dir / "tables")), "run").to_pylist()
    for name in ("train/loss", "train/pg_loss"):
        values = {r["step"]: r["value"] for r in m if r["name"] == name}
        assert set(values) == {0, 1} and all(math.isfinite(v) for v in values.values()), (name, values)
    clipfrac = [r["value"] for r in m if r["name"] == "train/clipfrac"]
    assert len(clipfrac) == 2 and (policy_loss == "cispo" or clipfrac == [0.0, 0.0])  # sapo has no hard clip
    hf = load_hf_model(resolve_checkpoint("tiny-llama", cache_dir=cache))
    initial = hf_to_megatron(hf.state_dict(), hf.config)
    trained = torch.load(run_dir / "checkpoints" / "latest" / "tp0.pt", map_location="cpu", weights_only=False)
    assert trained["weight_version"] == 2
    changed = [k for k, v in initial.items() if not torch.equal(v, trained["model"][k])]
    assert len(changed) >= len(initial) // 2, f"only {len(changed)} of {len(initial)} tensors changed"
