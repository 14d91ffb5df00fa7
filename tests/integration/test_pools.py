"""Two local pools (two tiny-llama engines behind a real router each) pull weight versions from a SeaweedFS S3
server through their agents: a full version, then a delta, then a corrupted delta they must refuse."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
import torch

from sluiceway.flows.pools import PoolsFile, PoolSpec, local_pools
from sluiceway.models.zoo import resolve_checkpoint
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.weights import safetensors_raw as st
from sluiceway.storage.weights.materialize import materialize
from sluiceway.storage.weights.model_dir import read_model_dir
from sluiceway.storage.weights.pool_registry import PoolRegistry
from sluiceway.storage.weights.publish import WeightPublisher
from sluiceway.storage.weights.store import WeightStore

pytestmark = pytest.mark.shared_prefect  # its runs use the worker's Prefect server: tests/integration/conftest.py


def perturbed(base: dict[str, st.RawTensor], step: int) -> dict[str, st.RawTensor]:
    """One small AdamW-like step: a few elements of a few float tensors move by about lr."""
    gen = torch.Generator().manual_seed(step)
    out = dict(base)
    for name in sorted(n for n, t in base.items() if t.dtype in ("F32", "BF16", "F16"))[:4]:
        t = st.to_torch(base[name])
        mask = torch.rand(t.shape, generator=gen) < 0.05
        step_ = 1e-3 * step * torch.sign(torch.randn(t.shape, generator=gen)) * mask
        out[name] = st.from_torch((t.float() + step_).to(t.dtype))
    return out


def served(url: str) -> tuple[str, str]:
    """(weight_version of a /generate answer, /get_weight_version) of one engine or router."""
    body = {"input_ids": [1, 5, 9, 11], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    gen = httpx.post(f"{url}/generate", json=body, timeout=60, trust_env=False)
    gen.raise_for_status()
    version = httpx.get(f"{url}/get_weight_version", timeout=10, trust_env=False).json()["weight_version"]
    return str(gen.json()["meta_info"]["weight_version"]), str(version)


def assert_pool_serves(pool, version: int) -> None:
    for url in pool.engines.urls:
        assert served(url) == (str(version), str(version)), url
    for _ in range(2):  # round robin: both engines answer through the router
        gen = httpx.post(f"{pool.url}/generate", json={"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 1}},
                         timeout=60, trust_env=False)  # fmt: skip
        assert gen.json()["meta_info"]["weight_version"] == str(version)
    status = json.loads(pool.agent.status_path.read_text())
    assert status["version"] == version and set(status["engines"].values()) == {version}
    # The same report on the store, where a run in another place reads what the pool serves.
    reported = PoolRegistry(pool.agent.wstore).record(pool.spec.name)
    assert reported.serving == version and reported.engines == status["engines"]


def test_pools_pull_deltas_and_refuse_a_corrupted_one(s3_server, tmp_path, monkeypatch):
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    model_dir = resolve_checkpoint("tiny-llama", cache_dir=tmp_path / "cache")
    monkeypatch.setenv("SLUICEWAY_CACHE", str(tmp_path / "cache"))
    uri = f"s3://{s3_server.bucket}/pools-{uuid.uuid4().hex[:8]}/weights"
    wstore = WeightStore(ObjectStore.from_uri(uri))
    publisher = WeightPublisher(wstore, full_every=10, keep=5)
    base = read_model_dir(model_dir)
    assert publisher.publish(1, perturbed(base, 1), model_dir).kind == "full"

    spec = PoolsFile(pools=[PoolSpec(name=n, model=str(model_dir), num_engines=2, weights_uri=uri) for n in "ab"])
    with local_pools(spec, tmp_path / "pools", poll=False) as pools:  # polled by hand: no timing to wait on
        for p in pools:
            assert p.agent.poll_once() == 1
            assert_pool_serves(p, 1)

        m2 = publisher.publish(2, perturbed(base, 2), model_dir)
        assert m2.kind == "delta" and m2.data_size < m2.raw_size / 4
        for p in pools:
            assert p.agent.poll_once() == 2
            assert_pool_serves(p, 2)

        # v3's delta gets one byte flipped inside one tensor's payload on the store.
        m3 = publisher.publish(3, perturbed(base, 3), model_dir)
        name, entry = next((n, e) for n, e in m3.tensors.items() if e.length)
        path = wstore.version_path(3, m3.data_file)
        data = bytearray(wstore.fs.cat_file(path))
        data[entry.offset + entry.length // 2] ^= 0x10
        wstore.fs.pipe_file(path, bytes(data))
        for p in pools:
            assert p.agent.poll_once() == 2
            assert "v3" in p.agent.error and repr(name) in p.agent.error
            assert_pool_serves(p, 2)
            assert json.loads(p.agent.status_path.read_text())["error"] == p.agent.error


@pytest.mark.slow  # a whole run: about 70 s on 2 busy cores
def test_run_publishes_to_the_weight_store_every_interval(tmp_path):
    """--update-weight-mode delta --update-weights-interval 2 over 2 steps: step 1's sync is skipped, step 2's
    version lands on the weight store, exactly the directory the run's own engines loaded."""
    from cli_run import run_cli

    run_dir = tmp_path / "run"
    small = ("--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4")
    run_cli(run_dir, tmp_path / "cache", *small, "--micro-batch-size", "4", "--num-rollout", "2",
            "--rollout-num-engines", "1", "--update-weight-mode", "delta", "--update-weights-interval", "2",
            "--save-interval", "2")  # fmt: skip
    wstore = WeightStore(ObjectStore.from_uri(str(run_dir / "weight_store")))
    assert wstore.versions() == [2]
    assert not (run_dir / "weights" / "v000001").exists()  # skipped: never written (2 are kept)
    pulled = materialize(wstore, 2, None, tmp_path / "pulled")
    assert raw(read_model_dir(pulled)) == raw(read_model_dir(run_dir / "weights" / "v000002"))


def raw(tensors: dict[str, st.RawTensor]) -> dict[str, tuple]:
    return {k: (t.dtype, t.shape, bytes(t.data)) for k, t in tensors.items()}
