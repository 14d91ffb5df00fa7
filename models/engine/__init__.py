"""The embedded rollout engine: continuous batching on CPU (or one GPU) behind SGLang's native HTTP API."""

from sluiceway.models.engine.core import (
    Engine,
    EngineError,
    GenerateOutput,
    GenerateRequest,
    RequestHandle,
    SamplingParams,
    StreamChunk,
)

__all__ = [
    "Engine",
    "EngineError",
    "GenerateOutput",
    "GenerateRequest",
    "RequestHandle",
    "SamplingParams",
    "StreamChunk",
]
