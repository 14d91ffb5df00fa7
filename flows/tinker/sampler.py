"""Sampling for Tinker's sampling clients on embedded engines (models/engine/core.py's `Engine`, in this
process): one engine per model directory in use (the base model, or a directory `save_weights_for_sampler`
wrote), the least recently used closed past `max_engines`, so a client always samples the weights its
sampler was saved with."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

from sluiceway.flows.tinker.futures import TinkerUserError, not_implemented
from sluiceway.flows.tinker.wire import SequenceOut

DEFAULT_MAX_TOKENS = 128  # what a request without max_tokens gets (Tinker's own default is not documented)


class Samplers:
    """An engine's KV cache is allocated whole when it starts: `max_running` rows of `max_total_len` positions
    (SmolLM2-135M: 94 MB a row in fp32, so 1.5 GB for 16), and at most `max_engines` of them exist at once. An RL
    loop saves new sampler weights every step (the cookbook's do), so engines come and go all the time."""

    def __init__(self, max_engines: int = 2, max_total_len: int = 2048, max_running: int = 16) -> None:
        self.max_engines, self.max_total_len, self.max_running = max_engines, max_total_len, max_running
        self._engines: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def engine(self, model_dir: Path):
        from sluiceway.models.engine.core import Engine

        key = str(model_dir)
        with self._lock:
            if key in self._engines:
                self._engines.move_to_end(key)
                return self._engines[key]
            while len(self._engines) >= self.max_engines:  # room first: never one cache more than max_engines
                _, old = self._engines.popitem(last=False)
                old.shutdown()  # requests still running on it end with finish_reason abort
            engine = Engine(model_dir, max_total_len=self.max_total_len, max_running_requests=self.max_running)
            self._engines[key] = engine
            return engine

    def drop(self, model_dir: Path) -> None:
        """Close the engine on `model_dir`, if one is open (its weights were deleted)."""
        with self._lock:
            engine = self._engines.pop(str(model_dir), None)
        if engine is not None:
            engine.shutdown()

    def close(self) -> None:
        with self._lock:
            for e in self._engines.values():
                e.shutdown()
            self._engines.clear()

    def sample(self, model_dir: Path, request: dict) -> tuple[list[SequenceOut], list[float | None] | None]:
        """A SampleRequest (its JSON, as the SDK sends it) -> the sequences and, if asked, the prompt's log-probs."""
        from sluiceway.models.engine.calls import EngineError, GenerateRequest

        for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if request.get(name):
                raise not_implemented(f"sampling with {name}")
        for name in ("target_prompt_logprobs", "prompt_logprobs_last_n", "record_stability_info"):
            if request.get(name):
                raise not_implemented(f"sampling with {name}")
        prompt = prompt_tokens(request.get("prompt") or {})
        n = int(request.get("num_samples", 1))
        if n < 1:
            raise TinkerUserError(f"num_samples must be at least 1, got {n}")
        engine = self.engine(model_dir)
        params = request.get("sampling_params") or {}
        try:
            reqs = [GenerateRequest(list(prompt), engine_sampling(params, i)) for i in range(n)]
            outs = engine.generate(reqs)
            prompt_lps = engine.score(list(prompt)) if request.get("prompt_logprobs") else None
        except EngineError as e:
            raise TinkerUserError(f"sample: {e}") from e
        seqs = []
        for o in outs:
            kind = o.finish_reason.get("type")
            if kind == "abort":
                raise RuntimeError(f"the engine aborted the sample: {o.finish_reason.get('message')}")
            seqs.append(SequenceOut(o.output_ids, o.output_logprobs, "length" if kind == "length" else "stop"))
        return seqs, prompt_lps


def prompt_tokens(model_input: dict) -> list[int]:
    tokens: list[int] = []
    for chunk in model_input.get("chunks", []):
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise not_implemented(f"{chunk.get('type')} chunks in a sampling prompt (only token chunks)")
        tokens.extend(int(t) for t in chunk.get("tokens", []))
    if not tokens:
        raise TinkerUserError("sample: the prompt has no tokens")
    return tokens


def engine_sampling(params: dict, index: int):
    """Tinker's SamplingParams as the engine's: `stop` strings or token ids (None keeps EOS; [] disables every
    stop, EOS included); sample `index` of a request gets seed + index, so the samples differ but repeat."""
    from sluiceway.models.engine.calls import SamplingParams

    stop = params.get("stop")
    sp = SamplingParams(
        max_new_tokens=int(params.get("max_tokens") or DEFAULT_MAX_TOKENS),
        temperature=float(params.get("temperature", 1.0)),
        top_p=float(params.get("top_p", 1.0)),
        top_k=int(params.get("top_k", -1)),
        skip_special_tokens=False,
    )
    if isinstance(stop, str):
        sp.stop = [stop]
    elif isinstance(stop, list) and not stop:
        sp.ignore_eos = True
    elif isinstance(stop, list) and all(isinstance(s, int) for s in stop):
        sp.stop_token_ids = list(stop)
    elif isinstance(stop, list):
        sp.stop = [str(s) for s in stop]
    if params.get("seed") is not None:
        sp.sampling_seed = int(params["seed"]) + index
    return sp
