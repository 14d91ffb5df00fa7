"""Weight versions on the object store (a local directory or s3://), one directory per version:

    <prefix>/v000010/{manifest.json, model.safetensors, config.json, tokenizer.json, ...}   a full version
    <prefix>/v000011/{manifest.json, delta.bin}                                           a delta against v10
    <prefix>/latest.json                                                                   {"version": 11, ...}
    <prefix>/pools/                 the pool registry beside the versions (storage/weights/pool_registry.py owns it)

A full version's directory is an HF model directory in itself. A version's files go up first and its manifest
last, then the `latest.json` hint: a version without a manifest does not exist (it is a crashed upload) and
listing ignores it. Retention keeps the newest `keep` versions plus every version their delta chains need.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from pydantic import ValidationError

from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.weights.errors import MissingVersion
from sluiceway.storage.weights.manifest import MANIFEST, Manifest

_VERSION_DIR = re.compile(r"^v(\d{6,})$")


def version_name(version: int) -> str:
    return f"v{version:06d}"


class WeightStore:
    """The weight versions under ``prefix`` of an object store."""

    def __init__(self, store: ObjectStore, prefix: str = "") -> None:
        self.store = store
        self.prefix = prefix.strip("/")
        self.fs = store.filesystem()

    def __repr__(self) -> str:
        return f"WeightStore({self.uri})"

    @property
    def uri(self) -> str:
        return self.store.join(self.prefix)

    def path(self, *parts: str) -> str:
        """A path for ``self.fs`` (no s3:// scheme)."""
        return self.store.join(self.prefix, *parts).removeprefix("s3://")

    def version_path(self, version: int, name: str = "") -> str:
        return self.path(version_name(version), name)

    # -- reading -----------------------------------------------------------------------------------------------

    def _version_dirs(self) -> list[int]:
        base = self.path()
        with self.store.redacting():
            self.fs.invalidate_cache(base)  # s3fs caches listings; versions come and go under this prefix
            if not self.fs.exists(base):
                return []
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(base, detail=False)]
        return sorted(int(m.group(1)) for n in names if (m := _VERSION_DIR.match(n)))

    def versions(self) -> list[int]:
        """Complete versions (those with a manifest), oldest first.

        The glob lists the version directories, then each: a version the writer prunes in between (a slow reader
        over a WAN, docs/weight_sync.md) makes it raise FileNotFoundError, so it is listed again."""
        for attempt in range(5):
            try:
                with self.store.redacting():
                    self.fs.invalidate_cache()
                    found = self.fs.glob(self.path("v*", MANIFEST))
                break
            except FileNotFoundError:
                if attempt == 4:
                    raise
        names = [p.rstrip("/").rsplit("/", 2)[-2] for p in found]
        return sorted(int(m.group(1)) for n in names if (m := _VERSION_DIR.match(n)))

    def latest(self) -> int | None:
        found = self.versions()
        return found[-1] if found else None

    def newest(self) -> int | None:
        """The newest version by the `latest.json` hint: one GET where `latest` lists every version directory (a
        poll over a WAN pays round trips, not bytes: docs/weight_sync.md). The hint is written after its version's
        manifest, so the version it names is complete; without a readable hint, the listing decides."""
        path = self.path("latest.json")
        with self.store.redacting():
            self.fs.invalidate_cache(path)
            try:
                return int(json.loads(self.fs.cat_file(path))["version"])
            except (FileNotFoundError, ValueError, KeyError, TypeError):
                pass
        return self.latest()

    def manifest(self, version: int) -> Manifest:
        path = self.version_path(version, MANIFEST)
        try:
            with self.store.redacting():
                text = self.fs.cat_file(path)
        except FileNotFoundError:
            raise MissingVersion(version, None, f"no manifest at {self.store.redact(path)}") from None
        try:
            manifest = Manifest.loads(text)
        except (ValueError, ValidationError) as exc:
            first = str(exc).splitlines()[0]
            raise MissingVersion(version, None, f"unreadable manifest ({first})") from None
        if manifest.version != version:
            raise MissingVersion(version, None, f"the manifest in {version_name(version)} says v{manifest.version}")
        return manifest

    def chain(self, version: int) -> list[Manifest]:
        """The manifests from the full version ``version`` depends on up to ``version`` itself."""
        chain = [self.manifest(version)]
        while chain[-1].kind == "delta":
            base = chain[-1].base_version
            if base is None or base >= chain[-1].version:
                raise MissingVersion(chain[-1].version, None, f"delta names base {base}, not an older version")
            chain.append(self.manifest(base))
        return chain[::-1]

    def read_file(self, version: int, name: str) -> bytes:
        path = self.version_path(version, name)
        try:
            with self.store.redacting():
                return self.fs.cat_file(path)
        except FileNotFoundError:
            raise MissingVersion(version, None, f"{name} is missing from the store") from None

    def get_file(self, version: int, name: str, local: Path) -> None:
        try:
            with self.store.redacting():
                self.fs.get_file(self.version_path(version, name), str(local))
        except FileNotFoundError:
            raise MissingVersion(version, None, f"{name} is missing from the store") from None

    # -- writing -----------------------------------------------------------------------------------------------

    def write_version(self, manifest: Manifest, local_files: dict[str, Path]) -> None:
        """Upload ``local_files`` (store name -> local path), then the manifest, then the latest hint."""
        v = manifest.version
        with self.store.redacting():
            self.fs.makedirs(self.version_path(v), exist_ok=True)
            for name, local in local_files.items():
                self.fs.put_file(str(local), self.version_path(v, name))
            self.put_text(self.version_path(v, MANIFEST), manifest.dumps())
            hint = {"version": v, "kind": manifest.kind, "full_version": manifest.full_version}
            self.put_text(self.path("latest.json"), json.dumps(hint))

    def put_text(self, path: str, text: str) -> None:
        """Write ``text`` at ``path`` (a path of ``self.fs``) whole: a reader sees the old text or the new, never
        part of it (a manifest, the latest hint, a pool's record)."""
        if self.store.is_s3:  # an S3 PUT is atomic
            self.fs.pipe_file(path, text.encode())
            return
        tmp = f"{path}.tmp-{os.getpid()}"  # a local reader must never see half a manifest
        Path(tmp).write_text(text)
        os.replace(tmp, path)

    def delete(self, version: int) -> None:
        """Manifest first, so a half-deleted version is never listed as complete."""
        path = self.version_path(version)
        with self.store.redacting():
            manifest = self.version_path(version, MANIFEST)
            if self.fs.exists(manifest):
                self.fs.rm_file(manifest)
            self.fs.invalidate_cache(path)  # a stale listing would make the recursive delete miss files
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)

    def retained(self, keep: int) -> set[int]:
        """The newest ``keep`` versions and every version their chains go through."""
        versions = self.versions()
        keep_set: set[int] = set()
        for v in versions[-keep:] if keep > 0 else []:
            keep_set.update(m.version for m in self.chain(v))
        return keep_set

    def prune(self, keep: int) -> list[int]:
        """Delete what retention does not keep, and crashed uploads older than the newest version; what went."""
        kept = self.retained(keep)
        if not kept:
            return []
        newest = max(kept)
        gone = [v for v in self._version_dirs() if v not in kept and v < newest]
        for v in gone:
            self.delete(v)
        return gone
