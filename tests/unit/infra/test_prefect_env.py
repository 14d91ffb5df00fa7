"""The embedded Prefect API server's settings: what a server started on a copy of the template database skips, and
what a server on a database that was already there (a resumed run's) still does."""

from __future__ import annotations

import sqlite3
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from sluiceway.infra import prefect_env
from sluiceway.infra.router import stop_process_group

SKIPPED_CHECKS = {
    "PREFECT_SERVER_DATABASE_MIGRATE_ON_START": "false",
    "PREFECT_SERVER_REGISTER_BLOCKS_ON_START": "false",
}


def _server_env(home: Path) -> dict[str, str]:
    """The environment the embedded server was started with (stopped at once: nothing here waits for it)."""
    server = prefect_env.start_api_server(home, wait=False)
    try:
        raw = Path(f"/proc/{server.proc.pid}/environ").read_bytes()
    finally:
        stop_process_group(server.proc)
    return dict(entry.split("=", 1) for entry in raw.decode().split("\0") if "=" in entry)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SLUICEWAY_CACHE", str(tmp_path / "cache"))
    for name in ("PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL", *SKIPPED_CHECKS):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "cache"


def _write_template(cache: Path) -> Path:
    template = prefect_env._template_db()
    assert template.is_relative_to(cache)
    template.parent.mkdir(parents=True)
    with sqlite3.connect(template) as db:  # the copy is only read by the server stopped at once
        db.execute("create table t (x)")
    return template


def test_a_copy_of_the_template_skips_migrations_and_block_registration(cache, tmp_path):
    _write_template(cache)
    home = tmp_path / "run" / "prefect"
    home.mkdir(parents=True)
    env = _server_env(home)
    assert (home / "prefect.db").read_bytes() == prefect_env._template_db().read_bytes()
    assert SKIPPED_CHECKS.items() <= env.items()
    assert env["PREFECT__SERVER_EPHEMERAL"] == "1" and env["PREFECT_HOME"] == str(home)


def test_a_database_that_was_there_or_a_first_start_is_checked_and_migrated(cache, tmp_path):
    home = tmp_path / "resumed" / "prefect"
    home.mkdir(parents=True)
    (home / "prefect.db").write_bytes(b"")  # a resumed run's, perhaps made by an older Prefect
    _write_template(cache)
    assert not SKIPPED_CHECKS.keys() & _server_env(home).keys()
    assert (home / "prefect.db").read_bytes() == b""  # not replaced by the template

    prefect_env._template_db().unlink()  # a first start: no template yet
    first = tmp_path / "first" / "prefect"
    first.mkdir(parents=True)
    assert not SKIPPED_CHECKS.keys() & _server_env(first).keys()


def test_the_template_is_per_prefect_version_and_collections(cache, monkeypatch):
    plain = prefect_env._template_db()
    assert plain.name == f"template-{prefect_env.version('prefect')}.db"
    collection = EntryPoint(name="prefect_aws", value="prefect_aws", group="prefect.collections")
    monkeypatch.setattr(prefect_env, "entry_points", lambda group: [collection])
    with_aws = prefect_env._template_db()
    assert with_aws.parent == plain.parent and with_aws.name.startswith(plain.stem + "-")
    assert with_aws != plain
