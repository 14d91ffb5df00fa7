"""Weight versions on disk (tasks/sync/disk.py): complete model directories, the newest `keep` kept, the oldest
one's directory and model file reused in place; readers that must not see such a rewrite (the engine); the
checksums each version records, and what a resume does with a damaged version."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from sluiceway.models.engine.llama import LlamaRunner
from sluiceway.models.zoo import load_hf_model, load_hf_state_dict, resolve_checkpoint
from sluiceway.storage.digests import file_sha256
from sluiceway.storage.weights import safetensors_raw
from sluiceway.storage.weights.checksums import CHECKSUMS, checksums_problem, published_path, version_problem
from sluiceway.tasks.sync.disk import settle_versions, version_dir, write_adapter_version, write_weight_version


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


def _flip_byte(path, at=None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_version_records_its_checksums_and_a_flipped_byte_is_named(model_dir, tmp_path):
    path = write_weight_version(perturbed(load_hf_state_dict(model_dir), 1), model_dir, tmp_path, 1, dtype="bfloat16")
    record = json.loads((path / CHECKSUMS).read_text())
    assert record["weight_version"] == 1
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(record["files"]) and CHECKSUMS not in record[
        "files"
    ]
    # The digest taken while writing is the file's.
    assert record["files"]["model.safetensors"]["sha256"] == file_sha256(path / "model.safetensors")
    assert checksums_problem(path) is None
    _flip_byte(path / "model.safetensors")
    problem = checksums_problem(path)
    assert problem.startswith("model.safetensors does not match the sha256 recorded when it was written"), problem
    assert record["files"]["model.safetensors"]["sha256"][:12] in problem  # what was expected
    (path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:-10])
    assert "model.safetensors has" in checksums_problem(path) and "were written (truncated?)" in checksums_problem(path)
    (path / CHECKSUMS).write_text('{"files": {')
    assert checksums_problem(path) == "checksums.json is unreadable (JSONDecodeError)"


def test_a_resume_rebuilds_a_damaged_version_and_drops_newer_ones(model_dir, tmp_path, caplog):
    base = load_hf_state_dict(model_dir)
    root = tmp_path / "weights"
    states = {v: perturbed(base, v) for v in (1, 2, 3)}
    for v in (1, 2):
        write_weight_version(states[v], model_dir, root, v)
    good = (version_dir(root, 2) / "model.safetensors").read_bytes()
    write_weight_version(states[3], model_dir, root, 3, keep=3)  # written after the checkpoint (at v2), then a kill
    _flip_byte(version_dir(root, 2) / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="sluiceway"):
        settle_versions(root, 2)  # the trainer loaded the checkpoint at v2
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"{version_dir(root, 2)}/model.safetensors does not match the sha256" in warning
    assert "writing v2 again from the checkpoint's weights" in warning
    assert sorted(p.name for p in root.iterdir()) == ["v000001"]  # v3's step is trained again; v2 is rewritten
    path = write_weight_version(states[2], model_dir, root, 2)  # the resume's sync, from the checkpoint's weights
    assert (path / "model.safetensors").read_bytes() == good and checksums_problem(path) is None
    caplog.clear()
    settle_versions(root, 2)  # an intact version stays
    assert (path / "model.safetensors").read_bytes() == good and not caplog.records


def test_a_version_nothing_vouches_for_is_rebuilt(model_dir, tmp_path, caplog):
    """Issue 40 point 4's last gap: checksums.json and the run's record both deleted, plus a flipped byte, had
    loaded unchecked ("written by an older build"); with nothing to check it against it is written again."""

    def damage(root):
        (version_dir(root, 2) / CHECKSUMS).unlink()
        published_path(root).unlink()
        _flip_byte(version_dir(root, 2) / "model.safetensors")

    warning = _resume_at_v2(model_dir, tmp_path / "weights", damage, caplog)
    assert "no checksums.json and no entry in the run's record" in warning and "older build" not in warning


def _resume_at_v2(model_dir, root, damage, caplog) -> str:
    """v1 and v2 written, v2 damaged by `damage(root)`, then a resume at v2: its one warning."""
    base = load_hf_state_dict(model_dir)
    for v in (1, 2):
        write_weight_version(perturbed(base, v), model_dir, root, v)
    assert version_problem(version_dir(root, 2), 2) is None
    damage(root)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sluiceway"):
        settle_versions(root, 2)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "writing v2 again from the checkpoint's weights" in warning
    assert not version_dir(root, 2).exists() and version_dir(root, 1).is_dir()  # rebuilt by the resume's sync
    return warning


def test_a_version_is_checked_against_the_runs_record_not_only_its_own(model_dir, tmp_path):
    """The run records each version it publishes beside its weights directory, as the version's checksums.json."""
    root = tmp_path / "weights"
    base = load_hf_state_dict(model_dir)
    for v in (1, 2, 3):
        write_weight_version(perturbed(base, v), model_dir, root, v)
    record = json.loads(published_path(root).read_text())
    assert published_path(root) == tmp_path / "weights.published.json"
    assert sorted(record["versions"]) == ["2", "3"]  # the versions on disk (keep 2)
    for v in (2, 3):
        own = json.loads((version_dir(root, v) / CHECKSUMS).read_text())
        assert record["versions"][str(v)] == own and own["weight_version"] == v
        assert version_problem(version_dir(root, v), v) is None
    # The version number is in what is checked: each version's model file says which it is.
    assert (
        record["versions"]["2"]["files"]["model.safetensors"] != record["versions"]["3"]["files"]["model.safetensors"]
    )
    published_path(root).write_text('{"versions": {"3": ')
    assert version_problem(version_dir(root, 3), 3).startswith("../weights.published.json is unreadable")


def test_an_emptied_checksums_json_and_a_flipped_byte_are_rebuilt(model_dir, tmp_path, caplog):
    """Issue 40 point 4: checksums.json with no files listed, plus a flipped byte, passed as intact."""

    def damage(root):
        path = version_dir(root, 2)
        (path / CHECKSUMS).write_text(json.dumps({"weight_version": 2, "files": {}}))
        _flip_byte(path / "model.safetensors")
        assert checksums_problem(path) == "checksums.json lists no files"  # it had passed as intact

    warning = _resume_at_v2(model_dir, tmp_path / "weights", damage, caplog)
    assert f"{version_dir(tmp_path / 'weights', 2)}/model.safetensors does not match the sha256" in warning


def test_an_emptied_checksums_json_alone_is_named(model_dir, tmp_path):
    """Without the run's record too: a record listing no files is damage, not a version with nothing to check."""
    root = tmp_path / "weights"
    path = write_weight_version(load_hf_state_dict(model_dir), model_dir, root, 2)
    published_path(root).unlink()
    (path / CHECKSUMS).write_text(json.dumps({"weight_version": 2, "files": {}}))
    assert checksums_problem(path) == "checksums.json lists no files"
    assert version_problem(path, 2) == "checksums.json lists no files"


def test_a_deleted_checksums_json_and_a_flipped_byte_are_rebuilt(model_dir, tmp_path, caplog):
    """Issue 40 point 4: with checksums.json deleted the log said 'written by an older build' and loaded it."""

    def damage(root):
        (version_dir(root, 2) / CHECKSUMS).unlink()
        _flip_byte(version_dir(root, 2) / "model.safetensors")

    warning = _resume_at_v2(model_dir, tmp_path / "weights", damage, caplog)
    assert f"{version_dir(tmp_path / 'weights', 2)}/model.safetensors does not match the sha256" in warning
    assert "older build" not in warning


def test_a_deleted_checksums_json_alone_is_rebuilt(model_dir, tmp_path, caplog):
    def damage(root):
        (version_dir(root, 2) / CHECKSUMS).unlink()

    warning = _resume_at_v2(model_dir, tmp_path / "weights", damage, caplog)
    assert warning.endswith("v000002/checksums.json is missing (the run recorded v2 with one); writing v2 again "
                            "from the checkpoint's weights")  # fmt: skip


def test_version_1_copied_over_version_2_is_rebuilt(model_dir, tmp_path, caplog):
    """Issue 40 point 4: v1's directory copied over v2's passed (its files match its own checksums.json)."""
    import shutil

    def damage(root):
        shutil.rmtree(version_dir(root, 2))
        shutil.copytree(version_dir(root, 1), version_dir(root, 2))
        assert checksums_problem(version_dir(root, 2)) is None  # consistent in itself
        assert version_problem(version_dir(root, 1), 1) is None

    warning = _resume_at_v2(model_dir, tmp_path / "weights", damage, caplog)
    assert "v000002/checksums.json is weight version 1's, not v2's (another version's directory copied" in warning


def test_version_1s_files_under_version_2s_checksums_are_rebuilt(model_dir, tmp_path, caplog):
    """v1's model file (and the rest) copied into v2 with v2's checksums.json kept, or rewritten to claim v2: the
    run's record of v2 has v2's digest."""
    import shutil

    def damage(root):
        src, dst = version_dir(root, 1), version_dir(root, 2)
        shutil.copy2(src / "model.safetensors", dst / "model.safetensors")
        own = json.loads((src / CHECKSUMS).read_text())
        (dst / CHECKSUMS).write_text(json.dumps({**own, "weight_version": 2}))
        assert checksums_problem(dst, 2) is None  # its own record agrees with it now

    warning = _resume_at_v2(model_dir, tmp_path / "weights", damage, caplog)
    assert "v000002/model.safetensors does not match the sha256" in warning


def test_an_adapter_version_records_its_checksums(model_dir, tmp_path):
    from sluiceway.models.lora import LoraSpec

    spec = LoraSpec(rank=2, alpha=4.0, dropout=0.0, targets=("q_proj",))
    adapter = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 8)}
    path = write_adapter_version(adapter, spec, model_dir, tmp_path, 5)
    assert set(json.loads((path / CHECKSUMS).read_text())["files"]) == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    _flip_byte(path / "adapter_model.safetensors", at=-1)
    assert checksums_problem(path).startswith("adapter_model.safetensors does not match")


def test_checksums_are_not_published_to_the_weight_store(model_dir, tmp_path):
    """checksums.json differs in every version: as a config file it would make every version a full one."""
    from sluiceway.storage.object_store import ObjectStore
    from sluiceway.storage.weights.materialize import materialize
    from sluiceway.storage.weights.publish import WeightPublisher
    from sluiceway.storage.weights.store import WeightStore

    base = load_hf_state_dict(model_dir)
    pub = WeightPublisher(WeightStore(ObjectStore.from_uri(str(tmp_path / "store"))), float_dtype="BF16")
    for v in (1, 2):
        sd = {k: t + 1e-3 * v if k.endswith("norm.weight") else t for k, t in base.items()}
        m = pub.publish(v, write_weight_version(sd, model_dir, tmp_path / "weights", v, dtype="bfloat16"))
        assert CHECKSUMS not in m.files
    assert m.kind == "delta"
    out = materialize(pub.wstore, 2, None, tmp_path / "pulled")
    assert checksums_problem(out) is None and json.loads((out / CHECKSUMS).read_text())["weight_version"] == 2
