"""The embedded rollout engine: continuous batching on CPU (or one GPU) behind SGLang's native HTTP API."""

from sluiceway.models.engine.calls import (
    EngineError,
    GenerateOutput,
    GenerateRequest,
    RequestHandle,
    SamplingParams,
    StreamChunk,
)
from sluiceway.models.engine.core import Engine

__all__ = [
    "Engine",
    "EngineError",
    "GenerateOutput",
    "GenerateRequest",
    "RequestHandle",
    "SamplingParams",
    "StreamChunk",
]
