"""Embedded Prefect: its home lives inside the run directory, quiet and without telemetry.

Prefect reads its settings when first imported, so call `configure_prefect` before importing prefect.
A user who already points PREFECT_API_URL at a real server (for the UI) keeps it. Otherwise sluiceway starts
the embedded API server itself rather than leaving it to Prefect's ephemeral mode: Prefect's own subprocess
outlives a SIGKILLed flow, while ours is tied to it (infra/proc.py), and we choose how long a loaded machine
may take to start it.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from dataclasses import dataclass
from importlib.metadata import entry_points, version
from pathlib import Path

import httpx

from sluiceway.infra.cache import cache_root
from sluiceway.infra.proc import child_env, die_with_parent, free_port
from sluiceway.infra.router import stop_process_group

START_TIMEOUT_S = 180.0


def configure_prefect(run_dir: str | Path, wait: bool = True) -> ApiServer | None:
    """Prefect's settings for a run in `run_dir`, and the embedded API server unless one is configured (then
    None). With `wait` False the server starts while the caller goes on (imports, checks: it takes seconds to
    boot); its `wait` must come before the first flow."""
    home = Path(run_dir).resolve() / "prefect"
    home.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(home))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    # Results are small JSON-able summaries (table versions, counts); persisting them lets a retried
    # flow see what already ran.
    os.environ.setdefault("PREFECT_RESULTS_PERSIST_BY_DEFAULT", "true")
    os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH", str(home / "results"))
    if os.environ.get("PREFECT_API_URL"):
        return None
    server = start_api_server(home, wait=wait)
    os.environ["PREFECT_API_URL"] = server.url
    return server


@dataclass
class ApiServer:
    """An embedded Prefect API server this process started, and what `wait` needs to see it healthy."""

    proc: subprocess.Popen
    url: str
    log_name: str
    deadline: float  # time.monotonic() by which it must answer
    timeout_s: float
    save_template: Path | None  # its database, to keep as the template once it is up (a fresh home's first start)
    ready: bool = False

    def wait(self) -> None:
        """Block until the server answers its health check (once; later calls return at once)."""
        # One client for all polls: a new one per poll builds an SSL context each time, CPU the booting server needs.
        with httpx.Client(timeout=2.0) as http:
            while not self.ready:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"the embedded Prefect API server exited with {self.proc.returncode}; see {self.log_name}"
                    )
                try:
                    if http.get(f"{self.url}/health").status_code == 200:
                        self.ready = True
                        if self.save_template is not None:
                            _save_template(self.save_template)
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > self.deadline:
                    stop_process_group(self.proc)
                    raise RuntimeError(
                        f"the embedded Prefect API server did not start within {self.timeout_s:.0f}s; "
                        f"see {self.log_name}"
                    )
                time.sleep(0.2)


def start_api_server(home: Path, timeout_s: float = START_TIMEOUT_S, wait: bool = True) -> ApiServer:
    """Prefect's API (no UI) on a loopback port, as a child that dies with this process.

    A new home's database starts as a copy of a migrated one from the cache (see `_template_db`)."""
    template, db = _template_db(), home / "prefect.db"
    own_db = not {"PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL"} & set(os.environ)
    fresh = own_db and not db.exists()
    copied = fresh and template.exists()
    if copied:
        shutil.copyfile(template, db)
    port = free_port()
    # A server with one client, the run: Prefect's own ephemeral server's settings (the services such a server
    # needs: task runs, events and logs recorded; no scheduler, late-run or worker services).
    env = child_env(PREFECT_HOME=str(home), PREFECT_UI_ENABLED="0", PREFECT_SERVER_ANALYTICS_ENABLED="false",
                    PREFECT__SERVER_EPHEMERAL="1", PREFECT__SERVER_FINAL="1")  # fmt: skip
    if copied:
        # The template was migrated and had its block types registered by this Prefect, with these collections
        # (_template_db): checking both again on every start is about 1 s of a 5 s start's CPU here. A database
        # that was already there (a resumed run's, maybe of an older Prefect) is checked and migrated as before.
        env |= {"PREFECT_SERVER_DATABASE_MIGRATE_ON_START": "false", "PREFECT_SERVER_REGISTER_BLOCKS_ON_START": "false"}
    env.pop("PREFECT_API_URL", None)
    log = open(home / "api-server.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app",
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True, preexec_fn=die_with_parent,
    )  # fmt: skip
    atexit.register(stop_process_group, proc)
    save_template = fresh and not template.exists()
    server = ApiServer(proc, f"http://127.0.0.1:{port}/api", log.name, time.monotonic() + timeout_s, timeout_s,
                       db if save_template else None)  # fmt: skip
    if wait:
        server.wait()
    return server


def _template_db() -> Path:
    """A migrated, empty Prefect database for this Prefect version. Creating the schema and registering the
    block types takes a new server ~8 s of CPU (12 s to healthy vs 4 s on this 2-core machine); every run
    directory gets a new database, so the first server's is kept and copied. Its name holds what decides its
    schema and block types: Prefect's version and the Prefect collections installed (their blocks are registered
    too), so a copy needs neither checked again."""
    collections = sorted(f"{ep.name}={ep.value}@{ep.dist.version if ep.dist else ''}"
                         for ep in entry_points(group="prefect.collections"))  # fmt: skip
    suffix = "-" + hashlib.sha256("\n".join(collections).encode()).hexdigest()[:12] if collections else ""
    return cache_root() / "prefect" / f"template-{version('prefect')}{suffix}.db"


def _save_template(db: Path) -> None:
    """Copy a just-started server's database (nothing run yet) to the cache, consistently: SQLite's backup API
    reads it as one transaction, WAL included. A failure only costs the next run the slow start."""
    target = _template_db()
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with closing(sqlite3.connect(db)) as src, closing(sqlite3.connect(tmp)) as dst:
            src.backup(dst)
        tmp.replace(target)  # atomic: two runs starting at once each write their own tmp
    except (OSError, sqlite3.Error):
        tmp.unlink(missing_ok=True)
