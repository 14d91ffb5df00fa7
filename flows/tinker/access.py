"""Who may use what on the Tinker server (issue 52 point 11).

Without `--api-keys-file` the server is one user's (it binds loopback only: flows/cli/tinker.py refuses another
address without keys). With it, every request but the health check must carry one of the file's keys in the SDK's
`X-API-Key` header (401 otherwise), and everything belongs to the key that made it: a session records its key's
digest, a model is its session's (the SDK derives model ids `<session>:train:<n>`), saved states and sampler
weights are their model's (`tinker://<model id>/...`), a sampling session and a future their creator's. Another
key's request for any of them is answered as if it did not exist. Keys themselves are kept only as digests, and
never logged, stored or put in a row.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from sluiceway.flows.tinker.futures import TinkerUserError

HEADER = "x-api-key"


class NotAuthenticated(TinkerUserError):
    status = 401


class NotFound(TinkerUserError):
    """Something of another key's, answered as an unknown one: its existence is not told either."""

    status = 404


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def read_keys(path: str | Path) -> frozenset[str]:
    """The digests of the keys in `path`: one a line, blank lines and `#` comments skipped; none is an error."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"--api-keys-file {p}: cannot be read ({e.strerror})") from None
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ValueError(f"--api-keys-file {p}: holds no key (one a line)")
    return frozenset(digest(k) for k in keys)


def caller(keys: frozenset[str] | None, headers) -> str | None:
    """The digest of the request's key (None when the server has no keys); NotAuthenticated for a missing or
    unknown one."""
    if keys is None:
        return None
    given = headers.get(HEADER)
    if not given:
        raise NotAuthenticated("this server needs an API key (X-API-Key; the SDK sends TINKER_API_KEY)")
    d = digest(given)
    if not any(hmac.compare_digest(d, k) for k in keys):
        raise NotAuthenticated("the API key is not one of this server's")
    return d


def session_of(ident: str) -> str:
    """The session a model id, a `tinker://` path or a session id belongs to."""
    return ident.removeprefix("tinker://").split("/", 1)[0].split(":", 1)[0]
