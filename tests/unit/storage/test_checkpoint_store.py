"""Checkpoints on the object store (local and a real S3 server): the pointer is written last, old steps pruned."""

import json

from sluiceway.storage.checkpoints import download_checkpoint, latest_checkpoint_step, upload_checkpoint


def fake_checkpoint(path, step):
    """A directory shaped like the trainer's `save` output (contents are opaque to the store)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "meta.json").write_text(json.dumps({"step": step, "weight_version": step + 1, "tensor_parallel": 2}))
    for r in range(2):
        (path / f"tp{r}.pt").write_bytes(bytes([step, r]) * 1000)
    return path


def test_upload_then_download_round_trip(store, tmp_path):
    assert latest_checkpoint_step(store, "r1") is None
    assert download_checkpoint(store, "r1", tmp_path / "dl") is None
    for step in range(4):
        uri = upload_checkpoint(store, "r1", fake_checkpoint(tmp_path / f"c{step}", step), step, keep=2)
        assert uri.endswith(f"checkpoints/r1/step_{step:06d}")
    assert latest_checkpoint_step(store, "r1") == 3
    fs = store.filesystem()
    base = store.join("checkpoints", "r1").removeprefix("s3://")
    fs.invalidate_cache()
    # Files, not listings: SeaweedFS (like a file system) may keep an emptied directory entry for a while.
    files = sorted(p.removeprefix(base + "/") for p in fs.find(base))
    steps = [f"step_00000{s}/{n}" for s in (2, 3) for n in ("meta.json", "tp0.pt", "tp1.pt")]
    assert files == ["latest.json", *steps]  # older steps pruned
    (tmp_path / "dl").mkdir()
    (tmp_path / "dl" / "stale.pt").write_bytes(b"old")  # replaced, not merged
    assert download_checkpoint(store, "r1", tmp_path / "dl") == 3
    got = {p.name: p.read_bytes() for p in (tmp_path / "dl").iterdir()}
    want = {p.name: p.read_bytes() for p in (tmp_path / "c3").iterdir()}
    assert got == want


def test_a_half_uploaded_step_is_not_the_latest(store, tmp_path):
    upload_checkpoint(store, "r2", fake_checkpoint(tmp_path / "c0", 0), 0)
    # A crash after some files of step 1 went up, before the pointer moved:
    fs = store.filesystem()
    partial = store.join("checkpoints", "r2", "step_000001").removeprefix("s3://")
    fs.makedirs(partial, exist_ok=True)
    fs.put_file(str(fake_checkpoint(tmp_path / "c1", 1) / "tp0.pt"), f"{partial}/tp0.pt")
    assert latest_checkpoint_step(store, "r2") == 0
    assert download_checkpoint(store, "r2", tmp_path / "dl") == 0
    assert json.loads((tmp_path / "dl" / "meta.json").read_text())["step"] == 0


def signed_checkpoint(path, step):
    """A fake checkpoint whose meta.json records its files' sizes and digests, as the trainer's save does."""
    from sluiceway.storage.digests import file_digests

    fake_checkpoint(path, step)
    meta = json.loads((path / "meta.json").read_text()) | {"files": file_digests(path)}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_a_damaged_checkpoint_is_named_and_never_loaded(tmp_path):
    import pytest

    from sluiceway.infra.errors import Fault
    from sluiceway.storage.checkpoints import checkpoint_problem, load_checkpoint

    class Trainer:
        def load(self, path):
            raise AssertionError("a damaged checkpoint must not reach the trainer")

    ckpt = signed_checkpoint(tmp_path / "latest", 3)
    assert checkpoint_problem(ckpt) is None
    data = bytearray((ckpt / "tp1.pt").read_bytes())
    data[10] ^= 1
    (ckpt / "tp1.pt").write_bytes(bytes(data))
    assert "tp1.pt does not match the sha256" in checkpoint_problem(ckpt)
    (ckpt / "tp1.pt").write_bytes(bytes(data[:100]))
    assert "tp1.pt has 100 bytes, 2000 were written" in checkpoint_problem(ckpt)
    (ckpt / "tp1.pt").unlink()
    assert checkpoint_problem(ckpt) == "tp1.pt is missing"
    (ckpt / "meta.json").write_text('{"step": 3, "fil')
    with pytest.raises(Fault, match="checkpoint .*latest is damaged: meta.json is unreadable"):
        load_checkpoint(Trainer(), ckpt)


def test_an_interrupted_local_save_is_settled(tmp_path):
    from sluiceway.storage.checkpoints import settle_checkpoint_dir

    latest = tmp_path / "latest"
    tmp, old = tmp_path / "latest.tmp", tmp_path / "latest.old"
    # Killed while writing the new one: the previous checkpoint stays, the partial one goes.
    fake_checkpoint(latest, 1)
    tmp.mkdir()
    (tmp / "tp0.pt").write_bytes(b"partial")
    settle_checkpoint_dir(latest)
    assert json.loads((latest / "meta.json").read_text())["step"] == 1 and not tmp.exists()
    # Killed between moving the old one aside and moving the complete new one in: the new one is taken.
    latest.rename(old)
    fake_checkpoint(tmp, 2)
    settle_checkpoint_dir(latest)
    assert json.loads((latest / "meta.json").read_text())["step"] == 2 and not old.exists() and not tmp.exists()
    # Killed after moving the old one aside, the new one incomplete (no meta.json yet): the old one comes back.
    latest.rename(old)
    tmp.mkdir()
    settle_checkpoint_dir(latest)
    assert json.loads((latest / "meta.json").read_text())["step"] == 2 and not tmp.exists()
