"""Where sluiceway keeps what it builds once per machine (models, a migrated Prefect database): light to import."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SLUICEWAY_CACHE"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """`cache_dir` if given, else `$SLUICEWAY_CACHE`, else ~/.cache/sluiceway."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "sluiceway"
