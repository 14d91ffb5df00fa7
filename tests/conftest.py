"""Shared fixtures. Servers are owned by the fixture that starts them and stopped by pid at teardown."""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

import pytest

from sluiceway.infra.s3_server import SeaweedS3
from sluiceway.models.zoo import load_tokenizer, resolve_checkpoint
from sluiceway.storage.object_store import ObjectStore

# `make test` runs the suite on two pytest-xdist workers (`--dist loadgroup`). A file's tests stay on one worker
# (their module fixtures are made once), and the files that share a session fixture's run (tests/integration/
# conftest.py: two_step_run, dp2_cli_run, and the Prefect server prefect_server) go to the same worker, so each
# shared run (or server) is made once. A module marked `spread` (its tests share nothing costly) lets each test go
# to whichever worker is free: a file of long independent tests no longer runs on one worker while the other idles.
SHARED_RUNS = ("two_step_run", "dp2_cli_run", "prefect_server")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which appends the groups to the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    group: dict[str, str] = {}
    for item in items:
        shared = next((name for name in SHARED_RUNS if name in getattr(item, "fixturenames", ())), None)
        if shared is not None or str(item.path) not in group:
            group[str(item.path)] = shared or group.get(str(item.path)) or item.path.name
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            name = group[str(item.path)]
            if item.get_closest_marker("spread") is not None and name == item.path.name:
                name = f"{item.path.name}/{item.name}"  # a group of its own (one shared by files stays shared)
            item.add_marker(pytest.mark.xdist_group(name))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids) -> None:
    """On the xdist controller: every test has a group (above), so under --dist loadgroup every node id a worker
    sends must end in `@group`, the scheduler's only way to learn it. Where pytest and pytest-xdist disagree on how
    (pytest 9.2 with xdist 3.8: pytest-xdist issue 1386; pyproject.toml pins pytest below 9.2) every test would be
    scheduled on its own and both workers would build the same module and session runs: stop, naming the versions."""
    if node.config.getvalue("dist") != "loadgroup" or not ids:
        return
    ungrouped = [nodeid for nodeid in ids if "@" not in nodeid.rsplit("::", 1)[-1]]
    if ungrouped:
        import xdist

        pytest.exit(
            f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__} drops --dist loadgroup's groups "
            f"(e.g. {ungrouped[0]}): install the pytest that pyproject.toml's dev extra pins",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


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


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """A cache holding the tiny-llama build, made once per session from nothing (once for all its xdist workers: the
    first makes it under a lock, the others wait). Modules copy it rather than build tiny-llama each (2.5 s of CPU
    each, some 25 modules; the suite's budget, issue 39 point 6). Never written to after it is made."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the workers' common base directory
    cache, done = base / "tiny-cache", base / "tiny-cache.done"
    with FileLock(str(cache) + ".lock"):
        if not done.exists():
            shutil.rmtree(cache, ignore_errors=True)  # a half-made one, from a session that was killed
            resolve_checkpoint("tiny-llama", cache_dir=cache)
            done.touch()
    return cache


def tiny_cache_copy(tmp_path_factory: pytest.TempPathFactory, tiny_cache: Path) -> Path:
    """A module's own cache, starting as a copy of the session's tiny_cache."""
    cache = tmp_path_factory.mktemp("cache")
    shutil.copytree(tiny_cache, cache, dirs_exist_ok=True)
    return cache


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_cache):
    """The tiny-llama checkpoint in a cache of the module's own (a copy of the session's build), and its tokenizer
    (once per module that asks)."""
    path = resolve_checkpoint("tiny-llama", cache_dir=tiny_cache_copy(tmp_path_factory, tiny_cache))
    return path, load_tokenizer(path)
