"""The one place a failed command becomes one line: what failed, where, and how to recover.

The CLI (flows/cli/main.py) calls `explain` with whatever ended the command. A user's mistake (`UserError`) exits 2; a
fault of the machine or a service exits 1. Known faults (a full disk, an object store that stayed down, a Delta
table that cannot be read, a damaged checkpoint) get a message written for them; anything else is named by its
type and first line. The full traceback goes to the run's log file (flows/run.py `configure_logging`), never to
the terminal: deltalake's messages carry Rust backtraces and Prefect's task failures are logged with their own.
"""

from __future__ import annotations

import errno
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sluiceway.infra.errors import Fault, UserError


@dataclass
class Explained:
    message: str
    exit_code: int  # 2: the user's input; 1: a fault


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0].strip() if text else type(exc).__name__


_NO_SPACE = re.compile(r"No space left on device|os error 28|ENOSPC", re.I)
_STORE_DOWN = re.compile(r"\bGeneric (S3|GCS|MicrosoftAzure|HTTP) error|Could not connect to the endpoint", re.I)
_MISSING_OBJECT = re.compile(r"Object at location (\S+) not found")
_DELTA_LOG = re.compile(r"Kernel error|Json error|Invalid JSON|Failed to parse|log segment|_delta_log", re.I)


# Below this much free space a failure is reported as a full disk, whatever it surfaced as (the embedded
# Prefect server's database lives in the run directory: a full disk often shows first as its HTTP 500).
LOW_SPACE_BYTES = 16 << 20


def explain(exc: BaseException, run_dir: Path | None = None) -> Explained:
    """One line for `exc` and its exit code; `run_dir` is the run's output directory, if a run was started."""
    resume = f"sluiceway resume {run_dir}" if run_dir else "sluiceway resume OUTPUT_DIR"
    chain = list(_chain(exc))
    for e in chain:
        if isinstance(e, UserError):
            return Explained(str(e), 2)
    for e in chain:
        if isinstance(e, Fault):
            return Explained(str(e), 1)
    full = next(
        (e for e in chain if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or _NO_SPACE.search(str(e))), None
    )
    if full is None and run_dir is not None and _free_bytes(run_dir) < LOW_SPACE_BYTES:
        full = exc
    if full is not None:
        # A copy or a rename names two files: the write that failed was to the second (shutil.copy's target).
        where = getattr(full, "filename2", None) or getattr(full, "filename", None) or run_dir or ""
        return Explained(
            f"disk full{' at ' + str(where) if where else ''} ({first_line(full)}). Every commit before it is "
            f"intact; free space, then `{resume}` continues from the last checkpoint",
            1,
        )
    for e in chain:
        text = str(e)
        if m := _MISSING_OBJECT.search(text):
            return Explained(
                f"a table references {m.group(1)}, which no longer exists: its rows are lost. Restore the file "
                f"from a copy, or remove it from the table (deltalake: DeltaTable(TABLE).repair()), see "
                f"docs/reliability.md",
                1,
            )
        if _STORE_DOWN.search(text):
            return Explained(
                f"the object store did not answer after the retries ({first_line(e)}). Nothing committed is lost; "
                f"once the store is back, `{resume}` continues",
                1,
            )
    for e in chain:
        if type(e).__name__ == "DeltaError" and _DELTA_LOG.search(str(e)):
            return Explained(
                f"a Delta table's log cannot be read ({first_line(e)}). If its newest _delta_log/*.json was cut "
                f"short by a crash or a full disk, move that one file away (the table rolls back one version; "
                f"a resume redoes that write), see docs/reliability.md",
                1,
            )
    return Explained(f"{type(exc).__name__}: {first_line(exc)}", 1)


def _free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return LOW_SPACE_BYTES  # unknown: do not claim a full disk
