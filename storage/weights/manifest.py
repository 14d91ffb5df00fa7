"""The manifest of one weight version: what a receiver checks every byte against.

It is the last file written for a version, so its presence is what makes a version exist.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict

FORMAT = "sluiceway-weights/1"
MANIFEST = "manifest.json"
FULL_FILE = "model.safetensors"
DELTA_FILE = "delta.bin"


class TensorEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dtype: str  # safetensors name: BF16, F16, F32, I64, ...
    shape: list[int]
    nbytes: int
    sha256: str  # of the tensor's raw little-endian bytes in this version
    # Deltas only: how to get here from the base version's tensor of the same name.
    encoding: Literal["same", "xor", "sparse", "raw"] | None = None
    base_sha256: str | None = None  # what the receiver must hold (None for raw)
    offset: int | None = None  # payload position in delta.bin
    length: int | None = None
    changed: int | None = None  # elements whose bits differ from the base


class FileEntry(BaseModel):
    sha256: str
    size: int


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: str = FORMAT
    version: int
    kind: Literal["full", "delta"]
    base_version: int | None = None  # deltas: the version they apply to
    full_version: int  # the full version this one's chain starts from (itself for a full one)
    data_file: str  # model.safetensors (full) or delta.bin (delta)
    data_size: int  # bytes of data_file: what a receiver downloads
    raw_size: int  # bytes of all tensors: what a full copy weighs
    metadata: dict[str, str] = {}  # the safetensors __metadata__ of the materialized model file
    files: dict[str, FileEntry] = {}  # config, tokenizer, ...: stored with full_version
    tensors: dict[str, TensorEntry]
    created: str = ""

    def dumps(self) -> str:
        return self.model_dump_json(indent=1)

    @classmethod
    def loads(cls, text: str | bytes) -> Manifest:
        return cls.model_validate(json.loads(text))


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
