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
