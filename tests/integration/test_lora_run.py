"""`sluiceway run --lora-rank` on tiny-llama: the adapters train, the checkpoint holds them alone, the run's engines
serve each adapter version, and the weight store carries adapter versions a pool rebuilds exactly; with
--lora-sync merged the versions are full weights with the adapter folded in."""

from __future__ import annotations

import math

import pytest
import torch
from cli_run import run_cli

from sluiceway.models.lora import is_adapter_dir, read_adapter_dir
from sluiceway.models.zoo import load_hf_state_dict, resolve_checkpoint
from sluiceway.storage.metrics import read_metrics
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import read_trajectories
from sluiceway.storage.weights.materialize import materialize
from sluiceway.storage.weights.store import WeightStore

pytestmark = pytest.mark.shared_prefect  # its runs use the worker's Prefect server: tests/integration/conftest.py

LORA = ("--lora-rank", "8", "--lora-alpha", "16", "--lr", "1e-2", "--num-rollout", "3")


def test_lora_run_publishes_adapter_versions(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    run_cli(run_dir, cache, *LORA, "--update-weight-mode", "delta", "--weights-full-every", "10")
    tables = ObjectStore.from_uri(str(run_dir / "tables"))
    m = read_metrics(tables, "run").to_pylist()
    losses = {r["step"]: r["value"] for r in m if r["name"] == "train/loss"}
    assert set(losses) == {0, 1, 2} and all(math.isfinite(v) for v in losses.values())

    ckpt = torch.load(run_dir / "checkpoints" / "latest" / "tp0.pt", map_location="cpu", weights_only=False)
    assert ckpt["weight_version"] == 3
    assert ckpt["model"] and all(k.endswith(("_A", "_B")) for k in ckpt["model"])  # adapters only, no base

    # The run's engines loaded every adapter version: step s sampled with version s.
    rows = read_trajectories(tables, "run").to_pylist()
    assert {r["step"]: r["weight_version"] for r in rows} == {0: 0, 1: 1, 2: 2}

    latest = sorted((run_dir / "weights").glob("v*"))[-1]
    assert is_adapter_dir(latest)
    spec, adapter = read_adapter_dir(latest)
    assert spec.rank == 8 and spec.alpha == 16 and any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)

    # The weight store holds adapter versions (AdamW moves every fp32 element of an adapter, so the publisher often
    # finds a delta no smaller than the adapter and writes it whole: docs/benchmarks.md); a pool rebuilds v3 exactly.
    wstore = WeightStore(ObjectStore.from_uri(str(run_dir / "weight_store")))
    assert wstore.versions() == [1, 2, 3] and wstore.manifest(1).kind == "full"
    out = materialize(wstore, 3, None, tmp_path / "pool" / "v3")
    assert sorted(f.name for f in out.glob("*.safetensors")) == ["adapter_model.safetensors"]  # peft's name
    pool_spec, pool_adapter = read_adapter_dir(out)
    assert pool_spec == spec and all(torch.equal(pool_adapter[k], adapter[k]) for k in adapter)
    full_bytes = sum(f.stat().st_size for f in resolve_checkpoint("tiny-llama", cache_dir=cache).glob("*.safetensors"))
    assert wstore.manifest(3).data_size < 0.2 * full_bytes


# "plain" is behind slow (make test-all runs it): every assertion it makes, the kl run makes too on a run that
# differs only by --use-kl-loss, and LoRA training without the KL loss is test_lora_run_publishes_adapter_versions.
@pytest.mark.parametrize("kl", [pytest.param(False, marks=pytest.mark.slow), True], ids=["plain", "kl"])
def test_lora_sync_merged_publishes_full_weights(tmp_path, kl):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    extra = ("--use-kl-loss", "--kl-loss-coef", "0.1") if kl else ()
    run_cli(run_dir, cache, *LORA, "--lora-sync", "merged", *extra)
    latest = sorted((run_dir / "weights").glob("v*"))[-1]
    assert not is_adapter_dir(latest)
    merged = load_hf_state_dict(latest)
    ckpt = torch.load(run_dir / "checkpoints" / "latest" / "tp0.pt", map_location="cpu", weights_only=False)
    base = load_hf_state_dict(resolve_checkpoint("tiny-llama", cache_dir=cache))
    # (rounded as the version was written: bf16 where the run computes in bf16)
    changed = [k for k in merged if not torch.equal(merged[k], base[k].to(merged[k].dtype))]
    # Exactly the adapted projections moved: norms and embeddings are the base's.
    assert changed and all(k.endswith(("_proj.weight",)) for k in changed)
    assert ckpt["weight_version"] == 3
    if kl:
        kls = [r["value"] for r in read_metrics(ObjectStore.from_uri(str(run_dir / "tables")), "run").to_pylist()
               if r["name"] == "train/kl"]  # fmt: skip
        assert len(kls) == 3 and kls[-1] > 0
