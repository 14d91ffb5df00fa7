"""Shared fixtures. Servers are owned by the fixture that starts them and stopped by pid at teardown."""

from __future__ import annotations

import re
import uuid

import pytest

from sluiceway.infra.s3_server import SeaweedS3
from sluiceway.models.zoo import load_tokenizer, resolve_checkpoint
from sluiceway.storage.object_store import ObjectStore

# `make test` runs the suite on two pytest-xdist workers (`--dist loadgroup`). A file's tests stay on one worker
# (their module fixtures are made once), and the files that share a session fixture's run (tests/integration/
# conftest.py: two_step_run, dp2_cli_run) go to the same worker, so each shared run is made once.
SHARED_RUNS = ("two_step_run", "dp2_cli_run")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    group: dict[str, str] = {}
    for item in items:
        shared = next((name for name in SHARED_RUNS if name in getattr(item, "fixturenames", ())), None)
        if shared is not None or str(item.path) not in group:
            group[str(item.path)] = shared or group.get(str(item.path)) or item.path.name
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group[str(item.path)]))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """One real SeaweedFS S3 server for the session (started only if a test asks for it; never skipped)."""
    with SeaweedS3(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path, monkeypatch: pytest.MonkeyPatch) -> ObjectStore:
    """An ObjectStore on a local directory or on the S3 server, under a prefix no other test uses.

    For S3 the credentials reach the store the way they reach users' code: through AWS_* variables.
    """
    if request.param == "local":
        return ObjectStore.from_uri(str(tmp_path / "store"))
    server: SeaweedS3 = request.getfixturevalue("s3_server")
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    prefix = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name)[:60] + "-" + uuid.uuid4().hex[:8]
    return ObjectStore.from_uri(f"s3://{server.bucket}/{prefix}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny-llama checkpoint built into a fresh cache, and its tokenizer (once per module that asks)."""
    path = resolve_checkpoint("tiny-llama", cache_dir=tmp_path_factory.mktemp("cache"))
    return path, load_tokenizer(path)
