"""Which failures Prefect retries, and the progress line (drawn only on a terminal)."""

import httpx
import pyarrow as pa
import pytest
from deltalake import write_deltalake

from sluiceway.flows.retry import is_transient
from sluiceway.infra.errors import UserError
from sluiceway.infra.proc import free_port


def test_which_failures_are_retried():
    assert is_transient(httpx.ConnectError("refused"))
    assert is_transient(ConnectionResetError())
    request = httpx.Request("POST", "http://127.0.0.1:1/generate")
    assert is_transient(httpx.HTTPStatusError("503", request=request, response=httpx.Response(503, request=request)))
    bad_request = httpx.Response(400, request=request)
    assert not is_transient(httpx.HTTPStatusError("400", request=request, response=bad_request))
    assert not is_transient(UserError("bad data file"))
    assert not is_transient(ValueError("a bug"))
    try:
        try:
            raise TimeoutError("engine slow")
        except TimeoutError as e:
            raise RuntimeError("rollout failed") from e
    except RuntimeError as wrapped:
        assert is_transient(wrapped)  # the cause decides


def test_an_unreachable_object_store_inside_a_delta_write_is_retried(tmp_path):
    """deltalake's own error for an S3 endpoint that does not answer (issue 20: a 20 s outage ended the run)."""
    options = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",  # nothing listens there
        "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true", "max_retries": "1", "retry_timeout": "2s",
    }  # fmt: skip
    with pytest.raises(OSError) as down:
        write_deltalake("s3://bucket/table", pa.table({"x": [1]}), storage_options=options)
    assert "Generic S3 error" in str(down.value)
    assert is_transient(down.value)
    # a client error fails the same way again; a local disk's error is not an outage
    assert not is_transient(OSError("Generic S3 error: Client error with status 403 Forbidden: InvalidAccessKeyId"))
    assert is_transient(OSError("Generic S3 error: Server error with status 503 Service Unavailable"))
    assert not is_transient(OSError("Generic LocalFileSystem error: No space left on device (os error 28)"))
    assert not is_transient(FileNotFoundError("Generic S3 error"))  # only deltalake's plain OSError


def test_progress_line_draws_only_on_a_terminal():
    import io

    from sluiceway.flows.console import ProgressLine

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, pipe = Tty(), io.StringIO()
    ProgressLine(tty).update("rollout step 2", 3, 4)
    ProgressLine(pipe).update("rollout step 2", 3, 4)
    ProgressLine(Tty(), enabled=False).update("x", 1, 2)
    assert "[##################......] 3/4" in tty.getvalue() and pipe.getvalue() == ""


def test_retry_delays_span_the_budget_and_the_lease_outlives_them():
    """Issue 30: retries of 2 + 4 + 8 s gave up on an object store down for 30 s. By default the waits double from
    --retry-backoff-s up to 30 s each until they add up to --retry-budget-s; --stage-retries gives an exact count."""
    from sluiceway.flows.config import DurabilityConfig
    from sluiceway.flows.retry import backoff_delays, retry_delays
    from sluiceway.storage.run_lock import LEASE_TTL_S

    assert backoff_delays(2.0, None, 90.0) == [2, 4, 8, 16, 30, 30]  # 90 s: a minute-long outage is ridden out
    assert backoff_delays(2.0, 3, 90.0) == [2, 4, 8]
    assert backoff_delays(45.0, None, 60.0) == [45, 45]  # a first delay above the cap is kept, never shortened
    assert backoff_delays(0.0, None, 60.0) == [] and backoff_delays(0.0, 2, 60.0) == [0, 0]
    default = retry_delays(DurabilityConfig())
    assert sum(default) >= 60 and sum(default) < LEASE_TTL_S  # the run keeps its lease while it retries


def test_call_retrying_warns_once_then_logs_quietly(caplog, monkeypatch):
    from sluiceway.flows import retry

    monkeypatch.setattr(retry.time, "sleep", lambda s: None)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 4:
            raise ConnectionError("store down")
        return "ok"

    with caplog.at_level("DEBUG", logger="sluiceway"):
        assert retry.call_retrying(flaky, delays=[1, 2, 4, 8], what="storing metrics") == "ok"
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(calls) == 4 and len(warnings) == 1 and "retrying for up to 15 s" in warnings[0].getMessage()
