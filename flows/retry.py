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


def call_retrying(fn: Callable[..., T], *args, retries: int, backoff_s: float, what: str) -> T:
    """`fn(*args)` with the stages' retry policy, for the writes a flow makes outside a task (a step's metrics):
    a transient failure is retried after backoff_s, 2 x backoff_s, ...; anything else raises at once."""
    for attempt in range(retries + 1):
        try:
            return fn(*args)
        except Exception as e:
            if attempt == retries or not is_transient(e):
                raise
            delay = backoff_s * 2**attempt
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            log.warning("%s failed (%s); retry %d of %d in %.0f s", what, first, attempt + 1, retries, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")
