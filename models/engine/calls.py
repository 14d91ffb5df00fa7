"""What the embedded engine (models/engine/core.py) takes and gives: sampling parameters, a request, its output and
the chunks it streams, the handle `submit` returns; and its error for a request it cannot serve."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


class EngineError(ValueError):
    """A request or control the engine refuses (the server maps it to HTTP 400)."""


INT32_MAX = 2**31 - 1  # SGLang's bound for top_k and max_new_tokens (int32); larger top_k overflowed a tensor
SEED_MAX = 2**63 - 1  # torch generators take a 64-bit seed; SGLang's sampling_seed is a non-negative int64
GREEDY_BELOW = 1e-6  # SGLang's _SAMPLING_EPS: a smaller temperature is greedy (logits / T would overflow)


@dataclass
class SamplingParams:
    """SGLang's sampling fields that the embedded engine implements (same names and defaults)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    # A detokenizer option, passed to the tokenizer's decode as SGLang does: transformers 4's slow tokenizers read
    # it (to join kept special tokens with spaces); fast ones, which the zoo's models load, and every tokenizer under
    # transformers 5 ignore it, so it changes no text here (nor in SGLang with a fast tokenizer).
    spaces_between_special_tokens: bool = True
    sampling_seed: int | None = None

    def validate(self, vocab_size: int) -> None:
        """Raise EngineError naming the first field out of its range (the types are the server's to check)."""
        # Not bounded by max_total_len: a request that asks for more ends there, with finish_reason length.
        if not isinstance(self.max_new_tokens, int) or not 1 <= self.max_new_tokens <= INT32_MAX:
            raise EngineError(
                f"sampling_params.max_new_tokens must be an integer in [1, 2**31-1], got {self.max_new_tokens!r}"
            )
        if not (self.temperature >= 0.0 and self.temperature != float("inf")):
            raise EngineError(f"sampling_params.temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise EngineError(f"sampling_params.top_p must be in (0, 1], got {self.top_p!r}")
        if not (self.top_k == -1 or 1 <= self.top_k <= INT32_MAX):
            raise EngineError(f"sampling_params.top_k must be -1 (disabled) or in [1, 2**31-1], got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise EngineError(f"sampling_params.min_p must be in [0, 1], got {self.min_p!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not 0 <= t < vocab_size:
                raise EngineError(f"sampling_params.stop_token_ids: {t!r} is not a token id in [0, {vocab_size})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise EngineError("sampling_params.stop must be a non-empty string or a list of non-empty strings")
        if self.sampling_seed is not None and not 0 <= self.sampling_seed <= SEED_MAX:
            raise EngineError(f"sampling_params.sampling_seed must be in [0, 2**63-1], got {self.sampling_seed!r}")


@dataclass
class GenerateRequest:
    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str | None = None


@dataclass
class GenerateOutput:
    rid: str
    prompt_tokens: int
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: dict[str, Any]
    weight_version: str
    text: str | None = None  # None when the engine has no tokenizer
    e2e_latency: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose KV was copied from another request's (SGLang's prefix-cache hit)


@dataclass
class StreamChunk:
    """New tokens of one request since the previous chunk; the last chunk carries the full output."""

    rid: str
    token_ids: list[int]
    logprobs: list[float]
    output: GenerateOutput | None = None  # set on the final chunk


class RequestHandle:
    """What `submit` returns: a concurrent Future of the output, plus incremental chunks on request."""

    def __init__(self, rid: str, on_chunk: Callable[[StreamChunk], None] | None):
        self.rid = rid
        self.future: Future[GenerateOutput] = Future()
        self._on_chunk = on_chunk

    def result(self, timeout: float | None = None) -> GenerateOutput:
        return self.future.result(timeout)

    def _emit(self, chunk: StreamChunk) -> None:
        if self._on_chunk is not None:
            try:
                self._on_chunk(chunk)
            except Exception:  # noqa: BLE001 (a listener that went away, e.g. a closed event loop)
                # Must not reach the scheduler loop, which would abort every running request.
                self._on_chunk = None
