"""Embedded Prefect: its home lives inside the run directory, quiet and without telemetry.

Prefect reads its settings when first imported, so call `configure_prefect` before importing prefect.
A user who already points PREFECT_API_URL at a real server (for the UI) keeps it.
"""

from __future__ import annotations

import os
from pathlib import Path


def configure_prefect(run_dir: str | Path) -> Path:
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
    return home
