"""What one Tinker request may ask of the server, and the readers that hold a request to it before anything else
runs: a body read as it streams and counted (a 600 MB chunked body had been read whole), a zstd body inflated up to
the same bound (98 kB had inflated to 3 GB), JSON that must be one object (lists and 100k-deep nesting had been
500s with a traceback), and the sampling request's sizes (num_samples=10**400 had taken the server to 23.9 GB).

Every refusal is a `TinkerUserError`: the route answers it 400 (413 for a body over the bound) naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from sluiceway.flows.tinker.futures import TinkerUserError

MAX_BODY_BYTES = 64 << 20  # a request body, as sent and once inflated: a forward_backward of ~8M tokens
MAX_NUM_SAMPLES = 512  # sequences one asample asks for (tinker-cookbook's recipes ask for 4-64)


class BodyTooLarge(TinkerUserError):
    status = 413


async def read_body(request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request's body, refused past `limit` bytes as it streams (a Content-Length over it before any byte)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"{request.url.path}: a body of {int(declared)} bytes; at most {limit} are taken")
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"{request.url.path}: the body passed {limit} bytes; at most {limit} are taken")
        parts.append(chunk)
    return b"".join(parts)


def inflate(body: bytes, encoding: str | None, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body as the SDK compressed it (zstd) or as sent; a corrupt frame, or one inflating past `limit`, is the
    caller's error."""
    if not encoding or encoding == "identity":
        return body
    if encoding != "zstd":
        raise TinkerUserError(f"Content-Encoding {encoding!r} is not supported (zstd or none)")
    import zstandard

    try:
        # A streaming reader: the SDK's one-shot compressor writes the content size, other writers may not.
        with zstandard.ZstdDecompressor().stream_reader(body) as reader:
            out = reader.read(limit + 1)
    except zstandard.ZstdError as e:
        raise TinkerUserError(f"the zstd body cannot be decompressed: {e}") from None
    if len(out) > limit:
        raise BodyTooLarge(f"the zstd body inflates past {limit} bytes; at most {limit} are taken")
    return out


def json_object(raw: bytes, path: str) -> dict[str, Any]:
    """The body as one JSON object, or the caller's error naming the route."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise TinkerUserError(f"{path}: the body's JSON is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise TinkerUserError(f"{path}: the body is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise TinkerUserError(f"{path}: the body must be a JSON object, got {type(value).__name__}")
    return value


def check_sample_sizes(num_samples: int, max_tokens: int | None) -> None:
    """An asample's sizes, before it is queued."""
    if not 1 <= num_samples <= MAX_NUM_SAMPLES:
        shown = num_samples if abs(num_samples) < 10**12 else f"a number of {len(str(abs(num_samples)))} digits"
        raise TinkerUserError(f"num_samples must be between 1 and {MAX_NUM_SAMPLES}, got {shown}")
    if max_tokens is not None and max_tokens < 1:
        raise TinkerUserError(f"sampling_params.max_tokens must be at least 1, got {max_tokens}")
