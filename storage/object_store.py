"""Object-store settings in one place: a local directory or an ``s3://bucket/prefix`` root.

Every table and file the framework stores lives under one root. Delta (deltalake), polars and fsspec (s3fs)
each want the endpoint and credentials in their own shape; :class:`ObjectStore` derives all of them from one
set of settings so they can never disagree. Credentials are held privately and redacted from ``repr``/``str``
and from error messages (see :meth:`ObjectStore.redact`), so a store can be logged or put in a Prefect result.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from sluiceway.infra.errors import UserError

DEFAULT_REGION = "us-east-1"
S3_RETRY_TIMEOUT = "30s"
_REDACTED = "***"
# storage_options keys whose values are secrets (redacted wherever the options are shown).
_SECRET_KEYS = frozenset({"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"})


class StorageOptions(dict):
    """The dict deltalake wants, with a ``repr`` that hides the credentials (so logging it is safe)."""

    def __repr__(self) -> str:
        shown = {k: (_REDACTED if k in _SECRET_KEYS else v) for k, v in self.items()}
        return f"StorageOptions({shown!r})"

    __str__ = __repr__


class ObjectStore:
    """Where sluiceway keeps its tables and files; build it with :meth:`from_uri`.

    ``root`` is an absolute local path or ``s3://bucket/prefix`` (no trailing slash).
    """

    def __init__(
        self,
        root: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        session_token: str | None = None,
    ) -> None:
        self.root = root.rstrip("/") if root.startswith("s3://") else root
        self.is_s3 = root.startswith("s3://")
        self.endpoint_url = endpoint_url
        self.region = region
        # Private on purpose: nothing that prints the store may print these.
        self._access_key = access_key
        self._secret_key = secret_key
        self._session_token = session_token

    # -- construction ------------------------------------------------------------------------------------------

    @classmethod
    def from_uri(
        cls,
        uri: str,
        endpoint_url: str | None = None,
        region: str | None = None,
        *,
        access_key: str | None = None,
        secret_key: str | None = None,
    ) -> ObjectStore:
        """A store rooted at a local path (made absolute and created) or at ``s3://bucket/prefix``.

        For S3, arguments win over the environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
        ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``, default ``us-east-1``) — the same
        variables deltalake, polars and s3fs read, so a shell set up for one works for all.
        """
        uri = str(uri).strip()
        if not uri:
            raise UserError("storage: empty store URI; expected a local path or s3://bucket/prefix")
        parsed = urlparse(uri)
        if parsed.scheme in ("s3", "s3a"):
            if not parsed.netloc:
                raise UserError(f"storage: {uri!r} names no bucket; expected s3://bucket/prefix")
            prefix = parsed.path.strip("/")
            root = f"s3://{parsed.netloc}" + (f"/{prefix}" if prefix else "")
            access_key = access_key or os.environ.get("AWS_ACCESS_KEY_ID")
            secret_key = secret_key or os.environ.get("AWS_SECRET_ACCESS_KEY")
            if not access_key or not secret_key:
                missing = [
                    n for n, v in (("AWS_ACCESS_KEY_ID", access_key), ("AWS_SECRET_ACCESS_KEY", secret_key)) if not v
                ]
                raise UserError(f"storage: {root} needs S3 credentials; set {' and '.join(missing)} in the environment")
            return cls(
                root,
                endpoint_url=endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None,
                region=region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or DEFAULT_REGION,
                access_key=access_key,
                secret_key=secret_key,
                session_token=os.environ.get("AWS_SESSION_TOKEN") or None,
            )
        if parsed.scheme == "file":
            uri = parsed.path
        elif parsed.scheme and len(parsed.scheme) > 1:  # one letter: a Windows drive, not a scheme
            raise UserError(f"storage: unsupported store URI {uri!r}; expected a local path or s3://bucket/prefix")
        path = Path(uri).expanduser().resolve()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"storage: cannot create store directory {path}: {exc.strerror}") from None
        return cls(str(path))

    # -- what the libraries need -------------------------------------------------------------------------------

    @property
    def allow_http(self) -> bool:
        return bool(self.endpoint_url and self.endpoint_url.startswith("http://"))

    @property
    def storage_options(self) -> StorageOptions:
        """Options for deltalake (and polars' ``storage_options``); empty for a local store."""
        if not self.is_s3:
            return StorageOptions()
        opts = StorageOptions(
            AWS_ACCESS_KEY_ID=self._access_key,
            AWS_SECRET_ACCESS_KEY=self._secret_key,
            AWS_REGION=self.region,
        )
        if self._session_token:
            opts["AWS_SESSION_TOKEN"] = self._session_token
        if self.endpoint_url:
            opts["AWS_ENDPOINT_URL"] = self.endpoint_url
        if self.allow_http:
            opts["AWS_ALLOW_HTTP"] = "true"
        # deltalake's own retries of one request give up after this (its default is 3 minutes); the stages
        # then retry with backoff (--stage-retries), and a store that stays down is one line (docs/reliability.md).
        opts["retry_timeout"] = S3_RETRY_TIMEOUT
        return opts

    def env(self) -> dict[str, str]:
        """The same settings as ``AWS_*`` environment variables, for child processes (contains secrets)."""
        return {k: v for k, v in self.storage_options.items() if k.startswith("AWS_")}

    def join(self, *parts: str) -> str:
        """``root/part/part``; parts may not climb out of the root."""
        clean: list[str] = []
        for part in parts:
            for piece in str(part).strip("/").split("/"):
                if piece in ("", "."):
                    continue
                if piece == "..":
                    raise ValueError(f"storage path part {part!r} may not contain '..'")
                clean.append(piece)
        return "/".join([self.root, *clean]) if clean else self.root

    def table_uri(self, name: str) -> str:
        """Where the Delta table ``name`` lives (a nested name like ``runs/abc/metrics`` is allowed)."""
        if not name or not str(name).strip("/"):
            raise ValueError("table name must be non-empty")
        return self.join(name)

    def filesystem(self) -> Any:
        """An fsspec filesystem for the root: ``s3fs.S3FileSystem`` with our endpoint, or the local one.

        Paths for the S3 filesystem are ``bucket/key`` (``store.join(...)`` with the ``s3://`` stripped also works).
        """
        if not self.is_s3:
            import fsspec

            return fsspec.filesystem("file")
        import s3fs

        client_kwargs: dict[str, Any] = {"region_name": self.region}
        if self.endpoint_url:
            client_kwargs["endpoint_url"] = self.endpoint_url
        # No listings cache: deltalake writes under the same prefixes behind s3fs's back, and a cached listing
        # makes s3fs report a file written since as missing (fsspec shares one instance per process).
        return s3fs.S3FileSystem(
            key=self._access_key,
            secret=self._secret_key,
            token=self._session_token,
            client_kwargs=client_kwargs,
            use_listings_cache=False,
        )

    # -- keeping secrets out of output -------------------------------------------------------------------------

    def redact(self, text: str) -> str:
        """``text`` with every credential of this store replaced by ``***``."""
        for secret in (self._secret_key, self._session_token, self._access_key):
            if secret:
                text = text.replace(secret, _REDACTED)
        return text

    @contextlib.contextmanager
    def redacting(self) -> Iterator[None]:
        """Re-raise any exception whose message would leak a credential, with the credential redacted.

        Library errors (deltalake, botocore) sometimes echo the options they were given.
        """
        try:
            yield
        except Exception as exc:
            message = str(exc)
            cleaned = self.redact(message)
            if cleaned == message:
                raise
            raise type(exc)(cleaned) if _simple_ctor(type(exc)) else RuntimeError(cleaned) from None

    def __repr__(self) -> str:
        parts = [repr(self.root)]
        if self.is_s3:
            parts += [f"endpoint_url={self.endpoint_url!r}", f"region={self.region!r}", "credentials=***"]
        return f"ObjectStore({', '.join(parts)})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectStore) and (
            self.root,
            self.endpoint_url,
            self.region,
            self._access_key,
            self._secret_key,
        ) == (other.root, other.endpoint_url, other.region, other._access_key, other._secret_key)

    def __hash__(self) -> int:
        return hash((self.root, self.endpoint_url))

    def __reduce__(self):  # pickling keeps the credentials (a worker needs them) but never shows them
        return (
            _rebuild,
            (
                self.root,
                self.endpoint_url,
                self.region,
                self._access_key,
                self._secret_key,
                self._session_token,
            ),
        )


def _rebuild(root, endpoint_url, region, access_key, secret_key, session_token) -> ObjectStore:
    return ObjectStore(
        root,
        endpoint_url=endpoint_url,
        region=region,
        access_key=access_key,
        secret_key=secret_key,
        session_token=session_token,
    )


def _simple_ctor(cls: type) -> bool:
    """Whether ``cls(message)`` rebuilds an exception of the same type (true for most, not for OSError & co)."""
    try:
        cls("x")
    except Exception:  # noqa: BLE001 - any failure means "cannot rebuild", nothing more
        return False
    return not issubclass(cls, OSError)
