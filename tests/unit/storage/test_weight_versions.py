"""Weight versions on disk (tasks/sync/disk.py): complete model directories, the newest `keep` kept, the oldest
one's directory and model file reused in place; and readers that must not see such a rewrite (the engine)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from sluiceway.infra.engine.llama import LlamaRunner
from sluiceway.models.zoo import load_hf_model, load_hf_state_dict, resolve_checkpoint
from sluiceway.storage.weights import safetensors_raw
from sluiceway.tasks.sync.disk import version_dir, write_weight_version


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return resolve_checkpoint("tiny-llama", cache_dir=tmp_path_factory.mktemp("cache"))


def perturbed(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in sd.items()}


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_versions_are_complete_and_the_oldest_is_reused_in_place(model_dir, tmp_path, dtype):
    base = load_hf_state_dict(model_dir)
    root = tmp_path / "weights"
    inodes = {}
    for v in range(1, 6):
        sd = perturbed(base, v)
        path = write_weight_version(sd, model_dir, root, v, keep=2, dtype=dtype)
        assert path == version_dir(root, v)
        assert sorted(p.name for p in root.iterdir()) == [f"v{u:06d}" for u in range(max(1, v - 1), v + 1)]
        got = load_file(path / "model.safetensors")
        want_dtype = torch.float32 if dtype is None else torch.bfloat16
        assert set(got) == set(sd)
        for k, t in sd.items():
            assert got[k].dtype == want_dtype and torch.equal(got[k], t.to(want_dtype)), k
        assert (path / "config.json").exists() and (path / "tokenizer.json").exists()
        inodes[v] = (path / "model.safetensors").stat().st_ino
    # From the third version on, each one is written into the file of the version it evicts.
    assert inodes[3] == inodes[1] and inodes[4] == inodes[2] and inodes[5] == inodes[3]
    # A retried sync of a version that exists returns it as it is.
    before = load_file(version_dir(root, 5) / "model.safetensors")
    write_weight_version(perturbed(base, 99), model_dir, root, 5, keep=2, dtype=dtype)
    after = load_file(version_dir(root, 5) / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("pack", [False, True])
def test_the_engine_does_not_see_its_weight_file_rewritten(model_dir, tmp_path, pack):
    """safetensors maps the file it loads; the engine copies, so an in-place rewrite leaves what it serves."""
    config = load_hf_model(model_dir).config
    path = write_weight_version(load_hf_state_dict(model_dir), model_dir, tmp_path, 1)
    runner = LlamaRunner(config, load_hf_state_dict(path), pack_weights=pack)
    ids = torch.randint(3, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    before = runner.forward_full(ids)
    other = perturbed(load_hf_state_dict(model_dir), 7)
    raw = {k: safetensors_raw.from_torch(v) for k, v in sorted(other.items())}
    safetensors_raw.write(path / "model.safetensors", raw, {"format": "pt"}, reuse=True)
    reread = load_file(path / "model.safetensors")
    assert all(torch.equal(reread[k], other[k]) for k in other)  # the file did change, in place
    assert torch.equal(runner.forward_full(ids), before)
