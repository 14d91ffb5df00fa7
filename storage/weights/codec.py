"""The lossless per-tensor delta codec: new bytes from base bytes and a small zstd payload, bit for bit.

Encodings (the manifest records which one each tensor got):
- ``same``: not one bit changed; no payload.
- ``xor``: new XOR base over the raw bytes, split into byte planes (all first bytes, then all second bytes, ...)
  and zstd-compressed. With small updates the high bytes (sign, exponent) of most elements do not change, so
  their planes are long runs of zeros that compress far better than the interleaved bytes would.
- ``sparse``: the indices of the changed elements (as gaps from the previous index) and their new raw values,
  zstd-compressed; chosen where it is smaller than ``xor``.
- ``raw``: the new bytes alone, for a tensor the base lacks or whose dtype or shape changed.

Everything works on unsigned-int views of the bytes, so NaN payloads, -0.0, infinities and denormals are just
bit patterns; no value is ever computed with.
"""

from __future__ import annotations

import struct

import numpy as np
import zstandard

from sluiceway.storage.weights.errors import CorruptWeights

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
ZSTD_LEVEL = 3


def _compress(data: bytes | memoryview, level: int) -> bytes:
    # The frame checksum lets zstd itself notice a flipped byte before the sha256 check does.
    return zstandard.ZstdCompressor(level=level, write_checksum=True).compress(data)


def _decompress(payload: bytes | memoryview, size: int, version: int, tensor: str) -> bytes:
    try:
        out = zstandard.ZstdDecompressor().decompress(payload, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise CorruptWeights(version, tensor, f"payload does not decompress ({exc})") from None
    return out


def _planes(x: np.ndarray, width: int) -> bytes:
    return x.view(np.uint8).reshape(-1, width).T.tobytes()


def _unplanes(buf: bytes, width: int) -> np.ndarray:
    return np.ascontiguousarray(np.frombuffer(buf, np.uint8).reshape(width, -1).T).view(_UINT[width]).reshape(-1)


def _index_dtype(n: int) -> type:
    return np.uint32 if n < 2**32 else np.uint64


def encode(base: bytes | memoryview | None, new: bytes | memoryview, width: int, level: int = ZSTD_LEVEL):
    """(encoding, payload, changed elements) turning ``base`` into ``new``; ``base`` None means ``raw``."""
    n = len(new) // width
    if base is None:
        return "raw", _compress(new, level), n
    a = np.frombuffer(new, _UINT[width])
    x = a ^ np.frombuffer(base, _UINT[width])
    changed_at = np.flatnonzero(x)
    changed = len(changed_at)
    if changed == 0:
        return "same", b"", 0
    best = ("xor", _compress(_planes(x, width), level))
    idx_w = np.dtype(_index_dtype(n)).itemsize
    if changed * (idx_w + width) < len(new):  # sparse can only win where its raw form is smaller
        gaps = np.diff(changed_at, prepend=0).astype(_index_dtype(n))
        body = struct.pack("<Q", changed) + gaps.tobytes() + _planes(a[changed_at], width)
        sparse = _compress(body, level)
        if len(sparse) < len(best[1]):
            best = ("sparse", sparse)
    return best[0], best[1], changed


def decode(
    encoding: str, payload: bytes | memoryview, base: bytes | memoryview | None, nbytes: int, width: int,
    *, version: int, tensor: str,
) -> bytes:  # fmt: skip
    """The new tensor's bytes; a payload that does not fit its shape raises CorruptWeights naming the tensor."""
    if encoding == "same":
        return bytes(base)
    if encoding == "raw":
        out = _decompress(payload, nbytes, version, tensor)
    elif encoding == "xor":
        x = _decompress(payload, nbytes, version, tensor)
        if len(x) != nbytes:
            raise CorruptWeights(version, tensor, f"xor payload decodes to {len(x)} bytes, expected {nbytes}")
        out = (np.frombuffer(base, _UINT[width]) ^ _unplanes(x, width)).tobytes()
    elif encoding == "sparse":
        out = _decode_sparse(payload, base, nbytes, width, version, tensor)
    else:
        raise CorruptWeights(version, tensor, f"unknown encoding {encoding!r}")
    if len(out) != nbytes:
        raise CorruptWeights(version, tensor, f"payload decodes to {len(out)} bytes, expected {nbytes}")
    return out


def _decode_sparse(payload, base, nbytes: int, width: int, version: int, tensor: str) -> bytes:
    n = nbytes // width
    idx_dtype = _index_dtype(n)
    idx_w = np.dtype(idx_dtype).itemsize
    body = _decompress(payload, 8 + n * (idx_w + width), version, tensor)
    (changed,) = struct.unpack("<Q", body[:8]) if len(body) >= 8 else (-1,)
    if changed < 0 or changed > n or len(body) != 8 + changed * (idx_w + width):
        raise CorruptWeights(version, tensor, "sparse payload has the wrong length for its element count")
    idx = np.cumsum(np.frombuffer(body, idx_dtype, changed, 8).astype(np.uint64))
    if changed and idx[-1] >= n:
        raise CorruptWeights(version, tensor, f"sparse index {int(idx[-1])} is out of range for {n} elements")
    values = _unplanes(body[8 + changed * idx_w :], width) if changed else np.empty(0, _UINT[width])
    out = np.frombuffer(base, _UINT[width]).copy()
    out[idx] = values
    return out.tobytes()
