"""The writer's side: publish each new weight version as a full copy or as a delta against the previous one.

The publisher keeps the last version it published in memory (one CPU copy of the weights) and encodes the next
one against it. A new publisher (a restarted trainer) has nothing to diff against, so its first version is full;
after that every ``full_every``-th version is full, which bounds the chain a new receiver has to apply. A delta
that would not be much smaller than the tensors themselves is written as a full version instead.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sluiceway.storage.weights import safetensors_raw as st
from sluiceway.storage.weights.codec import ZSTD_LEVEL, encode
from sluiceway.storage.weights.manifest import (
    DELTA_FILE,
    FULL_FILE,
    FileEntry,
    Manifest,
    TensorEntry,
    now,
)
from sluiceway.storage.weights.model_dir import aux_files, config_with_dtype, read_model_dir
from sluiceway.storage.weights.store import WeightStore

if TYPE_CHECKING:
    import torch


def sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


# Floating dtypes a publisher may cast between (the fp8 formats are left as they are).
_FLOATS = {"F16", "BF16", "F32", "F64"}


def cast_float(t: st.RawTensor, dtype: str) -> st.RawTensor:
    """``t`` converted to the floating ``dtype`` (round to nearest even, as torch and engines cast) if it is a
    floating tensor of another dtype; other tensors unchanged. The one place the publisher computes with values."""
    if t.dtype not in _FLOATS or t.dtype == dtype:
        return t
    import torch

    to = getattr(torch, {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}[dtype])
    return st.from_torch(st.to_torch(t).to(to))


@dataclass
class _Held:
    version: int
    tensors: dict[str, st.RawTensor]
    sha: dict[str, str]
    files: dict[str, FileEntry]
    full_version: int
    chain: int  # deltas since full_version


class WeightPublisher:
    """Publishes versions to a :class:`WeightStore`; keep one per writer process."""

    def __init__(
        self,
        wstore: WeightStore,
        *,
        full_every: int = 10,
        keep: int = 3,
        max_delta_ratio: float = 0.5,
        zstd_level: int = ZSTD_LEVEL,
        float_dtype: str | None = None,
    ) -> None:
        if full_every < 1 or keep < 1:
            raise ValueError("full_every and keep must be >= 1")
        if float_dtype is not None and float_dtype not in _FLOATS:
            raise ValueError(f"float_dtype {float_dtype!r}: one of {sorted(_FLOATS)} or None")
        self.wstore = wstore
        self.full_every, self.keep = full_every, keep
        self.max_delta_ratio, self.zstd_level = max_delta_ratio, zstd_level
        # Cast floating tensors to this safetensors dtype (e.g. "BF16": what a --bf16 run's engines serve, while
        # the trainer writes its fp32 masters) before anything is hashed or encoded; None keeps them as given.
        self.float_dtype = float_dtype
        self._held: _Held | None = None

    def publish(
        self,
        version: int,
        weights: Mapping[str, torch.Tensor | st.RawTensor] | Path,
        model_dir: Path | None = None,
    ) -> Manifest:
        """Store ``version`` (a state dict, or an HF model directory) with ``model_dir``'s config/tokenizer files.

        A retried publish of a stored version with the same tensors returns its manifest; different tensors under
        an existing version number are refused.
        """
        if isinstance(weights, (str, Path)):
            model_dir = Path(weights) if model_dir is None else model_dir
            tensors = read_model_dir(Path(weights))
        else:
            tensors = {k: v if isinstance(v, st.RawTensor) else st.from_torch(v) for k, v in weights.items()}
        if self.float_dtype is not None:
            tensors = {k: cast_float(t, self.float_dtype) for k, t in tensors.items()}
        sha = {k: sha256(t.data) for k, t in tensors.items()}
        with tempfile.TemporaryDirectory(prefix="sluiceway-weights-") as tmp:
            aux = aux_files(model_dir)
            if self.float_dtype is not None and "config.json" in aux:
                aux["config.json"] = config_with_dtype(aux["config.json"], self.float_dtype, Path(tmp))
            files = {n: FileEntry(sha256=sha256(p.read_bytes()), size=p.stat().st_size) for n, p in aux.items()}
            latest = self.wstore.latest()
            if latest is not None and version <= latest:
                return self._existing(version, tensors, sha, files, latest)
            held = self._held
            delta_ok = (
                held is not None
                and held.version == latest  # still the newest on the store (no other writer went in between)
                and held.chain + 1 < self.full_every
                and held.files == files
            )
            manifest = self._delta(version, tensors, sha, files, Path(tmp)) if delta_ok else None
            if manifest is None:
                manifest = self._full(version, tensors, sha, files, Path(tmp), model_dir)
            local = {manifest.data_file: Path(tmp) / manifest.data_file}
            if manifest.kind == "full":
                local.update(aux)
            self.wstore.write_version(manifest, local)
        chain = 0 if manifest.kind == "full" else held.chain + 1
        self._held = _Held(version, tensors, sha, files, manifest.full_version, chain)
        self.wstore.prune(self.keep)
        return manifest

    def _existing(self, version, tensors, sha, files, latest) -> Manifest:
        if version not in self.wstore.versions():
            raise ValueError(f"weights v{version}: the store already holds v{latest}; versions must increase")
        manifest = self.wstore.manifest(version)
        if {k: e.sha256 for k, e in manifest.tensors.items()} != sha:
            raise ValueError(f"weights v{version} is already stored with different tensors")
        if version == latest:  # the retried publish of the newest version: continue the chain from it
            chain = len(self.wstore.chain(version)) - 1
            self._held = _Held(version, tensors, sha, files, manifest.full_version, chain)
        return manifest

    def _metadata(self, version: int) -> dict[str, str]:
        return {"format": "pt", "weight_version": str(version)}

    def _full(self, version, tensors, sha, files, tmp: Path, model_dir) -> Manifest:
        st.write(tmp / FULL_FILE, tensors, self._metadata(version))
        entries = {
            k: TensorEntry(dtype=t.dtype, shape=list(t.shape), nbytes=t.nbytes, sha256=sha[k])
            for k, t in tensors.items()
        }
        return Manifest(
            version=version, kind="full", full_version=version, data_file=FULL_FILE,
            data_size=(tmp / FULL_FILE).stat().st_size, raw_size=sum(t.nbytes for t in tensors.values()),
            metadata=self._metadata(version), files=files, tensors=entries, created=now(),
        )  # fmt: skip

    def _delta(self, version, tensors, sha, files, tmp: Path) -> Manifest | None:
        held = self._held
        entries: dict[str, TensorEntry] = {}
        offset = 0
        raw_size = sum(t.nbytes for t in tensors.values())
        with open(tmp / DELTA_FILE, "wb") as out:
            for k, t in tensors.items():
                base = held.tensors.get(k)
                same_layout = base is not None and (base.dtype, base.shape) == (t.dtype, t.shape)
                width = st.DTYPE_WIDTH[t.dtype]
                if same_layout and held.sha[k] == sha[k]:
                    encoding, payload, changed = "same", b"", 0  # equal hashes: skip the XOR pass
                else:
                    encoding, payload, changed = encode(base.data if same_layout else None, t.data, width,
                                                        self.zstd_level)  # fmt: skip
                out.write(payload)
                entries[k] = TensorEntry(
                    dtype=t.dtype, shape=list(t.shape), nbytes=t.nbytes, sha256=sha[k], encoding=encoding,
                    base_sha256=held.sha[k] if same_layout else None, offset=offset, length=len(payload),
                    changed=changed,
                )  # fmt: skip
                offset += len(payload)
                if offset > self.max_delta_ratio * raw_size:
                    return None  # not worth a delta: a full version also restarts the chain
        return Manifest(
            version=version, kind="delta", base_version=held.version, full_version=held.full_version,
            data_file=DELTA_FILE, data_size=offset, raw_size=raw_size, metadata=self._metadata(version),
            files=files, tensors=entries, created=now(),
        )  # fmt: skip
