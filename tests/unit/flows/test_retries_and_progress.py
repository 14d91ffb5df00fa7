"""Which failures Prefect retries, and the progress line (drawn only on a terminal)."""

import httpx

from sluiceway.flows.retry import is_transient
from sluiceway.infra.errors import UserError


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
