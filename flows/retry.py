"""Which stage failures Prefect retries: transient ones (an engine restarting, a dropped connection, an S3 hiccup,
a Delta commit race), never a user's mistake or a bug, which would fail the same way again."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import TypeVar

import httpx

from sluiceway.infra.errors import UserError

log = logging.getLogger("sluiceway")
T = TypeVar("T")

# Failures of the environment rather than of the inputs.
_TRANSIENT: tuple[type[BaseException], ...] = (httpx.TransportError, ConnectionError, TimeoutError)
try:
    from deltalake.exceptions import CommitFailedError

    _TRANSIENT += (CommitFailedError,)
except ImportError:  # pragma: no cover - deltalake always ships it today
    pass
try:
    from botocore.exceptions import ConnectionError as BotoConnectionError

    _TRANSIENT += (BotoConnectionError,)
except ImportError:  # pragma: no cover - s3fs brings botocore
    pass


# deltalake reports an object store it could not reach as a plain OSError saying "Generic S3 error"
# (Rust's object_store, after its own retries); a client error (403 bad credentials, 404 no such bucket) will
# fail the same way again, and a local disk's failures ("Generic LocalFileSystem error": disk full) are not
# passing either.
_OBJECT_STORE_DOWN = re.compile(r"\bGeneric (S3|GCS|MicrosoftAzure|HTTP) error")
_CLIENT_ERROR = re.compile(r"status:? 4(?!08|29)\d\d")


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, UserError):
        return False
    if type(exc) is OSError and _OBJECT_STORE_DOWN.search(str(exc)):
        return not _CLIENT_ERROR.search(str(exc))
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code >= 500 or exc.response.status_code == 429
    if isinstance(exc, _TRANSIENT):
        return True
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and is_transient(cause)


def retry_transient(task, task_run, state) -> bool:
    """Prefect's `retry_condition_fn`: retry when the failure is transient."""
    exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return isinstance(exc, BaseException) and is_transient(exc)


MAX_RETRY_DELAY_S = 30.0  # doubling stops here: an outage's end is noticed within this long


def retry_delays(durability) -> list[float]:
    """The waits before each retry of a run's `durability` settings (flows/config/durability.py)."""
    return backoff_delays(durability.retry_backoff_s, durability.stage_retries, durability.retry_budget_s)


def backoff_delays(backoff_s: float, retries: int | None, budget_s: float) -> list[float]:
    """backoff_s, 2 x backoff_s, ... (each at most MAX_RETRY_DELAY_S, or backoff_s if larger): `retries` of them,
    or, when retries is None, as many as it takes for the waits to add up to `budget_s` (issue 30: three retries
    of 2 + 4 + 8 s gave up on an object store down for 30 s). A zero backoff retries at once, `retries` times or
    not at all."""
    cap = max(MAX_RETRY_DELAY_S, backoff_s)
    delays: list[float] = []
    while (len(delays) < retries) if retries is not None else (sum(delays) < budget_s and backoff_s > 0):
        delays.append(min(backoff_s * 2 ** len(delays), cap))
    return delays


def call_retrying(fn: Callable[..., T], *args, delays: list[float], what: str) -> T:
    """`fn(*args)` with the stages' retry policy, for the writes a flow makes outside a task (a step's metrics):
    a transient failure is retried after each of `delays`; anything else raises at once. One warning line for
    the first retry of the call; the later ones go to the run's log file only (flows/run.py)."""
    for attempt in range(len(delays) + 1):
        try:
            return fn(*args)
        except Exception as e:
            if attempt == len(delays) or not is_transient(e):
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            level = logging.WARNING if attempt == 0 else logging.DEBUG
            log.log(level, "%s failed (%s); retrying for up to %.0f s", what, first, sum(delays[attempt:]))
            time.sleep(delays[attempt])
    raise AssertionError("unreachable")
