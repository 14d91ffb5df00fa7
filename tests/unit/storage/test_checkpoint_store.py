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
