"""`sluiceway ckpt` inspects and repairs a weight store, on a local directory and on S3."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from weight_helpers import assert_holds, publish_run

from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.weights.store import WeightStore

# -- corruption: each error names the version and the tensor --------------------------------------------------


# -- the CLI ---------------------------------------------------------------------------------------------------


def ckpt(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sluiceway.flows.cli", "ckpt", *args],
        capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=120,
    )  # fmt: skip


def test_cli_ls_diff_verify_apply(tmp_path):
    store = ObjectStore.from_uri(str(tmp_path / "s"))
    wstore = WeightStore(store)
    states = publish_run(wstore, tmp_path, 3, full_every=10, keep=5)
    root = str(tmp_path / "s")
    r = ckpt("ls", "--store", root)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("version") and len(lines) == 4
    assert lines[1].split()[:2] == ["v000001", "full"] and lines[3].split()[:3] == ["v000003", "delta", "v2"]
    r = ckpt("diff", "2", "3", "--store", root)
    assert r.returncode == 0, r.stderr
    assert "~ model.embed_tokens.weight" in r.stdout and "elements changed" in r.stdout
    assert r.stdout.splitlines()[-1].startswith("v2 -> v3: 3 of 5 tensors changed")  # embed, up_proj, step
    r = ckpt("verify", "latest", "--store", root)
    assert r.returncode == 0 and r.stdout.startswith("v3 ok: 5 tensors and 2 files") and "v1 -> v2 -> v3" in r.stdout
    r = ckpt("apply", "1", "--to", str(tmp_path / "model"), "--store", root)
    assert r.returncode == 0, r.stderr
    r = ckpt("apply", "v000003", "--to", str(tmp_path / "model"), "--store", root)
    assert r.returncode == 0 and "receiver held v1" in r.stdout, r.stderr
    assert_holds(tmp_path / "model", states[2])
    # A corrupted delta: one line, version and tensor named, exit 1; the model directory keeps v3.
    data = bytearray(Path(wstore.version_path(3, "delta.bin")).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(wstore.version_path(3, "delta.bin")).write_bytes(bytes(data))
    r = ckpt("verify", "3", "--store", root)
    assert r.returncode == 1 and r.stderr.startswith("error: weights v3 tensor '") and len(r.stderr.splitlines()) == 1
    # User mistakes: one line, exit 2.
    for args in (
        ("verify", "9", "--store", root),
        ("verify", "nine", "--store", root),
        ("ls", "--store", str(tmp_path / "nowhere")),
        ("apply", "1", "--store", root),
        ("ls", "--store", "s3://bucket/p"),
    ):
        r = ckpt(*args, env={"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""})
        assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.splitlines()) == 1, (args, r)


def test_cli_on_s3(s3_server, tmp_path, monkeypatch):
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    store = ObjectStore.from_uri(f"s3://{s3_server.bucket}/cli-{uuid.uuid4().hex[:8]}")
    wstore = WeightStore(store)
    states = publish_run(wstore, tmp_path, 2, full_every=10, keep=5)
    r = ckpt("apply", "latest", "--to", str(tmp_path / "m"), "--store", store.root)  # credentials from AWS_* env
    assert r.returncode == 0, r.stderr
    assert_holds(tmp_path / "m", states[1])
    r = ckpt("ls", "--store", store.root)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 3
