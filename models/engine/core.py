"""The embedded rollout engine: continuous batching over a slot KV cache, one scheduler thread.

Every iteration of the scheduler loop
  1. applies queued controls (abort, pause/continue, weight update, flush, version) -- between steps, never
     inside one, so a step always runs on one set of weights;
  2. unless paused, admits waiting requests while slots are free (prefill each, sample its first token);
  3. runs one decode step for the whole running batch and retires the rows that finished, moving the last
     running row into the freed slot so the batch stays in slots 0..n-1.
A long request therefore never holds up short ones, and a finished row stops costing compute at once
(transformers' `generate` keeps finished rows in the batch until the longest one ends).

Sampling follows `sampling.py` (per-row seeded Gumbel-max; log-probs of logits / T before truncation).
Weight versions are strings, as in SGLang's API (`meta_info.weight_version`); sluiceway writes integers.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sluiceway.models.engine.calls import (
    GREEDY_BELOW,
    EngineError,
    GenerateOutput,
    GenerateRequest,
    RequestHandle,
    SamplingParams,
    StreamChunk,
)
from sluiceway.models.engine.kv_cache import SlotKVCache
from sluiceway.models.engine.llama import LlamaRunner
from sluiceway.models.engine.sampling import sample


def stream(engine: Engine, request: GenerateRequest, timeout: float | None = None) -> Iterator[StreamChunk]:
    """Submit `request` and yield its chunks as they are produced (blocking iterator for plain threads)."""
    import queue

    q: queue.Queue[StreamChunk] = queue.Queue()
    engine.submit(request, on_chunk=q.put)
    while True:
        chunk = q.get(timeout=timeout)
        yield chunk
        if chunk.output is not None:
            return


@dataclass
class _Seq:
    """A request inside the engine."""

    req: GenerateRequest
    handle: RequestHandle
    generator: torch.Generator
    stop_ids: frozenset[int]
    t0: float
    out_ids: list[int] = field(default_factory=list)
    out_lps: list[float] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    streamed: int = 0
    cached_tokens: int = 0
    # The next-token logits at the prompt's end (fp32 [vocab]): a later request with the same prompt copies the
    # prompt's KV from this row's slot and samples its first token from these, without a prefill of its own.
    prompt_logits: torch.Tensor | None = None

    @property
    def length(self) -> int:  # tokens whose K/V are (or will be, for the pending one) in the cache
        return len(self.req.input_ids) + len(self.out_ids)


class Engine:
    """Continuous-batching generation from a Llama-family HF checkpoint (see the module doc)."""

    def __init__(
        self,
        model_path: str | Path,
        max_running_requests: int = 64,
        max_total_len: int = 1024,
        dtype: torch.dtype = torch.float32,
        weight_version: str = "0",
        seed: int | None = None,
        tokenizer: Any = None,
        load_tokenizer: bool = True,
        prefill_batch: int = 8,
    ):
        from transformers import AutoConfig

        from sluiceway.models.zoo import load_hf_state_dict, validate_model_dir
        from sluiceway.models.zoo import load_tokenizer as zoo_tokenizer

        self.model_path = validate_model_dir(model_path)
        self.config = AutoConfig.from_pretrained(str(self.model_path), local_files_only=True)
        self.dtype = dtype
        self.runner = LlamaRunner(self.config, load_hf_state_dict(self.model_path), dtype=dtype)
        self.vocab_size = self.runner.vocab_size
        self.max_running_requests = max_running_requests
        self.max_total_len = max_total_len
        self.prefill_batch = prefill_batch  # prompts per prefill forward (bounds the padded batch's memory)
        self.cache = SlotKVCache(
            self.runner.n_layers, max_running_requests, self.runner.n_kv, max_total_len, self.runner.head_dim, dtype
        )
        self.tokenizer = (
            tokenizer if tokenizer is not None else (zoo_tokenizer(self.model_path) if load_tokenizer else None)
        )
        self.eos_token_ids = self._eos_ids()
        self.weight_version = str(weight_version)
        self.lora_name: str | None = None  # the LoRA adapter merged into the weights (load_lora_adapter)
        self.lora_names: set[str] = set()  # every adapter name loaded and not unloaded
        self._seed = seed
        self._rid_counter = itertools.count()

        self._cv = threading.Condition()
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []  # row i lives in KV slot i
        self._rids: set[str] = set()
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self._paused = False
        self._stopped = False
        self.stats = {
            "max_running_requests_seen": 0,
            "decode_steps": 0,
            "generated_tokens": 0,
            "prefill_tokens": 0,
            "shared_prefill_tokens": 0,  # prompt tokens whose KV was copied from a row with the same prompt
            "finished_requests": 0,
            "scored_requests": 0,  # `score` calls (input-token log-probs: the OPD teacher's work)
            "scored_tokens": 0,
        }
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._thread.start()

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()

        def add(v: Any) -> None:
            if isinstance(v, int):
                ids.add(v)
            elif isinstance(v, (list, tuple)):
                ids.update(x for x in v if isinstance(x, int))

        add(getattr(self.config, "eos_token_id", None))
        gen_cfg = self.model_path / "generation_config.json"
        if gen_cfg.is_file():
            import json

            add(json.loads(gen_cfg.read_text()).get("eos_token_id"))
        if self.tokenizer is not None:
            add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # ------------------------------------------------------------------------------------------ public API
    def check_request(self, request: GenerateRequest) -> None:
        """Raise EngineError if the engine would refuse `request` (lets a server reject a batch atomically)."""
        ids = request.input_ids
        if not ids:
            raise EngineError("empty input: give a non-empty text or input_ids")
        bad = next(
            (t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size), None
        )
        if bad is not None:
            raise EngineError(f"input_ids: {bad!r} is not a token id in [0, {self.vocab_size})")
        if len(ids) >= self.max_total_len:
            raise EngineError(f"input of {len(ids)} tokens does not fit max_total_len={self.max_total_len}")
        sp = request.sampling
        sp.validate(self.vocab_size)
        if sp.stop and self.tokenizer is None:
            raise EngineError("sampling_params.stop needs a tokenizer; this engine runs without one")

    def submit(self, request: GenerateRequest, on_chunk: Callable[[StreamChunk], None] | None = None) -> RequestHandle:
        """Queue a request (thread-safe). `on_chunk` is called from the scheduler thread with new tokens."""
        self.check_request(request)
        sp = request.sampling
        seed = sp.sampling_seed
        if seed is None:
            seed = secrets.randbits(63) if self._seed is None else (self._seed * 1_000_003 + next(self._rid_counter))
        stop_ids = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stop_ids |= self.eos_token_ids
        with self._cv:
            if self._stopped:
                raise EngineError("engine is shut down")
            rid = request.rid if request.rid is not None else f"req-{secrets.token_hex(8)}"
            if rid in self._rids:
                raise EngineError(f"rid {rid!r} is already in use by a running request")
            request.rid = rid
            handle = RequestHandle(rid, on_chunk)
            seq = _Seq(
                req=request,
                handle=handle,
                generator=torch.Generator().manual_seed(int(seed) % (1 << 63)),
                stop_ids=frozenset(stop_ids),
                t0=time.perf_counter(),
            )
            self._rids.add(rid)
            self._waiting.append(seq)
            self._cv.notify_all()
        return handle

    def score(self, input_ids: list[int], start: int = 0) -> list[float | None]:
        """Log-probs of the given tokens under the model: entry j is log p(input_ids[start + j] | the tokens before
        it), None for position 0 (nothing before it). SGLang's `input_token_logprobs` for `logprob_start_len`
        start: the unscaled distribution (temperature 1, no truncation), one forward pass over the sequence.

        Runs on the scheduler thread between two steps, so it sees one set of weights (as a decode step does).
        """
        if not input_ids:
            raise EngineError("empty input: give a non-empty text or input_ids")
        self.check_request(GenerateRequest(list(input_ids), SamplingParams(max_new_tokens=1)))
        if not 0 <= start < len(input_ids):
            raise EngineError(f"logprob_start_len {start} is outside the input's {len(input_ids)} tokens")

        def do() -> list[float | None]:
            ids = torch.tensor([input_ids], dtype=torch.long)
            logits = self.runner.forward_full(ids)[0, :-1].float()  # position t predicts token t+1
            lps = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
            self.stats["scored_requests"] += 1
            self.stats["scored_tokens"] += len(input_ids)
            return ([None] + lps)[start:]

        return self._control(do)

    def generate(self, requests: list[GenerateRequest], timeout: float | None = None) -> list[GenerateOutput]:
        """Blocking convenience: submit all, wait for all (order preserved)."""
        handles = [self.submit(r) for r in requests]
        return [h.result(timeout) for h in handles]

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "Aborted by request.") -> int:
        """Finish `rid` (or every request) with finish_reason abort, returning tokens so far. -> how many."""

        def do() -> int:
            targets = [s for s in itertools.chain(self._waiting, self._running) if abort_all or s.req.rid == rid]
            for s in targets:
                s.finish = {"type": "abort", "message": message}
            self._retire_finished()
            return len(targets)

        return self._control(do)

    def pause(self) -> None:
        """Running requests keep their KV cache and stop advancing; new ones queue until `resume`."""
        self._control(lambda: setattr(self, "_paused", True))

    def resume(self) -> None:
        self._control(lambda: setattr(self, "_paused", False))

    @property
    def paused(self) -> bool:
        return self._paused

    def update_weights_from_disk(self, model_path: str | Path, weight_version: str | None = None) -> str:
        """Load a model directory's safetensors and swap them in between two decode steps.

        The files are read and checked in the caller's thread; a missing path or a tensor that does not fit
        raises EngineError and leaves the old weights serving. Running requests continue on the new weights.
        A LoRA adapter directory (peft's, as `--lora-sync adapter` publishes) is merged into the weights the engine
        started from (its base model), never into the current ones, so versions do not compound.
        """
        from sluiceway.models.lora import is_adapter_dir

        if is_adapter_dir(model_path):
            name = "adapter" if weight_version is None else f"v{weight_version}"
            return self.load_lora_adapter(name, model_path, weight_version, what="update_weights_from_disk")
        return self._swap_weights(lambda: self._read_weights(model_path), weight_version, "update_weights_from_disk")

    def load_lora_adapter(
        self, name: str, path: str | Path, weight_version: str | None = None, what: str = "load_lora_adapter"
    ) -> str:
        """SGLang's dynamic LoRA loading, for one adapter at a time: merge the adapter at `path` into the base
        weights and serve it under `name`. Requests naming an adapter (`lora_path`) must name one this engine
        has loaded; all are served by the newest (an SGLang engine keeps each until unloaded)."""

        def read():
            from sluiceway.models.lora import merge_into_hf, read_adapter_dir

            spec, adapter = read_adapter_dir(path)
            # The base at the serving dtype first, as the trainer holds it: the merge then rounds once, to
            # the bits of the trainer's merged version (--lora-sync merged), not to those of an fp32 merge.
            return merge_into_hf(self._base_weights(), adapter, spec)

        version = self._swap_weights(read, weight_version, what)
        self.lora_names.add(name)
        self.lora_name = name
        return version

    def unload_lora_adapter(self, name: str) -> None:
        """Unload `name`: the base weights serve again if it is the one merged in; an adapter a newer one already
        replaced is just forgotten. Raises EngineError for a name never loaded."""
        if name not in self.lora_names:
            raise EngineError(f"unload_lora_adapter: no adapter named {name!r} is loaded")
        self.lora_names.discard(name)
        if name == self.lora_name:
            self._swap_weights(self._base_weights, None, "unload_lora_adapter")
            self.lora_name = None

    def _base_weights(self) -> dict:
        from sluiceway.models.zoo import load_hf_state_dict

        return {k: v.to(self.runner.dtype) if v.is_floating_point() else v
                for k, v in load_hf_state_dict(self.model_path).items()}  # fmt: skip

    @staticmethod
    def _read_weights(model_path: str | Path) -> dict:
        from sluiceway.models.zoo import load_hf_state_dict

        return load_hf_state_dict(model_path)

    def _swap_weights(self, read: Callable[[], dict], weight_version: str | None, what: str) -> str:
        from sluiceway.infra.errors import UserError

        try:
            sd = read()
            self.runner.check_state_dict(sd)
        except (UserError, ValueError, OSError) as e:
            raise EngineError(f"{what}: {e}") from None

        def do() -> str:
            self.runner.load_state_dict(sd)
            for s in self._running:  # their prompts' KV and logits are the old weights': no longer shareable
                s.prompt_logits = None
            if weight_version is not None:
                self.weight_version = str(weight_version)
            return self.weight_version

        return self._control(do)

    def update_weight_version(self, new_version: str) -> None:
        self._control(lambda: setattr(self, "weight_version", str(new_version)))

    def flush_cache(self) -> bool:
        """SGLang semantics: succeeds only when nothing is running or waiting (then clears the KV cache)."""

        def do() -> bool:
            if self._running or self._waiting:
                return False
            self.cache.clear()
            return True

        return self._control(do)

    def load(self) -> dict[str, Any]:
        with self._cv:
            return {
                "num_running_reqs": len(self._running),
                "num_waiting_reqs": len(self._waiting),
                "paused": self._paused,
                **self.stats,
            }

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=10)
        with self._cv:
            for s in list(self._waiting) + self._running:
                s.finish = {"type": "abort", "message": "engine shut down"}
            self._retire_finished()

    # ------------------------------------------------------------------------------------------ scheduler
    def _control(self, fn: Callable[[], Any]) -> Any:
        if threading.current_thread() is self._thread:
            return fn()
        fut: Future = Future()
        with self._cv:
            if self._stopped:
                raise EngineError("engine is shut down")
            self._commands.append((fn, fut))
            self._cv.notify_all()
        return fut.result()

    def _run_commands(self) -> None:
        while self._commands:
            fn, fut = self._commands.popleft()
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 (the caller gets it)
                fut.set_exception(e)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while (
                    not self._stopped and not self._commands and (self._paused or not (self._waiting or self._running))
                ):
                    self._cv.wait()
                if self._stopped:
                    return
                self._run_commands()
                if self._paused:
                    continue
                admit = []
                while self._waiting and len(self._running) + len(admit) < self.max_running_requests:
                    admit.append(self._waiting.popleft())
            # Model work runs outside the lock so submit/abort never wait for a step.
            try:
                for group in self._prefill_groups(admit):
                    group = self._prefill(group)
                    with self._cv:
                        self._running.extend(group)
                        self._retire_finished()
                with self._cv:
                    self.stats["max_running_requests_seen"] = max(
                        self.stats["max_running_requests_seen"], len(self._running)
                    )
                    batch = [s for s in self._running if s.finish is None]
                if batch:
                    self._decode()
            except Exception as e:  # noqa: BLE001 (a model error must not kill the scheduler silently)
                # A failed forward pass belongs to the whole batch; one request's errors are caught per row.
                with self._cv:
                    for s in self._running + admit:
                        if s.finish is None:
                            s.finish = _engine_error(e)
                    for s in admit:
                        if s not in self._running:
                            self._running.append(s)
                    self._retire_finished()
            with self._cv:
                self._retire_finished()

    def _prefill_groups(self, admit: list[_Seq]) -> list[list[_Seq]]:
        """Admitted requests in groups of at most prefill_batch distinct prompts (repeats ride along free)."""
        groups: list[list[_Seq]] = []
        distinct: set[tuple[int, ...]] = set()
        for s in admit:
            key = tuple(s.req.input_ids)
            if not groups or (key not in distinct and len(distinct) >= self.prefill_batch):
                groups.append([])
                distinct = set()
            groups[-1].append(s)
            distinct.add(key)
        return groups

    def _prefill(self, group: list[_Seq]) -> list[_Seq]:
        """Prefill `group` into the slots after the running rows; returns it in slot order.

        Distinct new prompts are prefilled as one batch (one set of large GEMMs instead of many). A prompt that
        a running row or an earlier member of the group already has -- the n samples of one question in RL --
        is not prefilled again: its KV is copied from that row's slot and its first token is sampled from the
        shared prompt logits (each request still draws from its own generator).
        """
        base = len(self._running)
        have = {tuple(s.req.input_ids): (i, s) for i, s in enumerate(self._running) if s.prompt_logits is not None}
        fresh: list[_Seq] = []
        repeats: list[_Seq] = []
        for s in group:
            key = tuple(s.req.input_ids)
            if key in have or any(tuple(f.req.input_ids) == key for f in fresh):
                repeats.append(s)
            else:
                fresh.append(s)
        if fresh:
            prompts = [torch.tensor(s.req.input_ids, dtype=torch.long) for s in fresh]
            logits = self.runner.prefill(self.cache, base, prompts)
            self.stats["prefill_tokens"] += sum(len(p) for p in prompts)
            for i, s in enumerate(fresh):
                s.prompt_logits = logits[i]
                have[tuple(s.req.input_ids)] = (base + i, s)
        for j, s in enumerate(repeats):
            src_slot, src = have[tuple(s.req.input_ids)]
            self.cache.move(src_slot, base + len(fresh) + j, len(s.req.input_ids))
            s.prompt_logits = src.prompt_logits
            s.cached_tokens = len(s.req.input_ids)
            self.stats["shared_prefill_tokens"] += len(s.req.input_ids)
        ordered = fresh + repeats
        self._sample_and_append(ordered, torch.stack([s.prompt_logits for s in ordered]))
        return ordered

    def _decode(self) -> None:
        rows = self._running
        tokens = torch.tensor([s.out_ids[-1] for s in rows], dtype=torch.long)
        positions = torch.tensor([s.length - 1 for s in rows], dtype=torch.long)
        logits = self.runner.decode(self.cache, tokens, positions)
        self.stats["decode_steps"] += 1
        self._sample_and_append(rows, logits)

    def _row_sampling(self, sp: SamplingParams) -> tuple[float, int, float, float]:
        """One row's (temperature, top_k, top_p, min_p) as numbers the batch's tensors can hold."""
        t, k = float(sp.temperature), int(sp.top_k)
        if t < GREEDY_BELOW:
            t = 0.0
        if not 0 < k < self.vocab_size:  # -1 (whole vocabulary) or more tokens than it has
            k = self.vocab_size
        return t, k, float(sp.top_p), float(sp.min_p)

    def _sample_and_append(self, rows: list[_Seq], logits: torch.Tensor) -> None:
        # Settings are converted row by row: a request whose settings cannot be used (submit validates them, but
        # an in-process caller can change them later) fails alone instead of failing the step for the batch.
        keep, params = [], []
        for i, s in enumerate(rows):
            try:
                params.append(self._row_sampling(s.req.sampling))
                keep.append(i)
            except Exception as e:  # noqa: BLE001 (reported to that request)
                with self._cv:
                    s.finish = _engine_error(e)
        if len(keep) < len(rows):
            rows, logits = [rows[i] for i in keep], logits[keep]
        if not rows:
            return
        temperature, top_k, top_p, min_p = zip(*params)
        toks, lps = sample(
            logits,
            torch.tensor(temperature, dtype=torch.float32),
            torch.tensor(top_k, dtype=torch.long),
            torch.tensor(top_p, dtype=torch.float32),
            torch.tensor(min_p, dtype=torch.float32),
            [s.generator for s in rows],
        )
        with self._cv:
            for s, t, lp in zip(rows, toks.tolist(), lps.tolist(), strict=True):
                if s.finish is not None:  # aborted while the step ran: drop the token
                    continue
                s.out_ids.append(t)
                s.out_lps.append(lp)
                self.stats["generated_tokens"] += 1
                try:
                    s.finish = self._finish_reason(s, t)
                except Exception as e:  # noqa: BLE001 (e.g. its stop strings: this request's alone)
                    s.finish = _engine_error(e)
                if s.finish is None and s.streamed < len(s.out_ids):
                    s.handle._emit(StreamChunk(s.req.rid, s.out_ids[s.streamed :], s.out_lps[s.streamed :]))
                    s.streamed = len(s.out_ids)

    def _finish_reason(self, s: _Seq, token: int) -> dict[str, Any] | None:
        sp = s.req.sampling
        if token in s.stop_ids:
            return {"type": "stop", "matched": token}
        if sp.stop:
            # Decode only a tail long enough to contain any stop string that the newest token completes.
            tail = self.tokenizer.decode(s.out_ids[-(max(len(x) for x in sp.stop) + 8) :], skip_special_tokens=False)
            for stop in sp.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        n = len(s.out_ids)
        if n >= sp.max_new_tokens or s.length >= self.max_total_len:
            return {"type": "length", "length": n}
        return None

    def _retire_finished(self) -> None:
        """(Under the lock.) Complete finished requests; keep the running ones packed into slots 0..n-1."""
        for s in [s for s in self._waiting if s.finish is not None]:
            self._waiting.remove(s)
            self._complete(s)
        i = 0
        while i < len(self._running):
            s = self._running[i]
            if s.finish is None:
                i += 1
                continue
            last = len(self._running) - 1
            if i != last:
                moved = self._running[last]
                self.cache.move(last, i, moved.length)
                self._running[i] = moved
            self._running.pop()
            self._complete(s)

    def _complete(self, s: _Seq) -> None:
        self._rids.discard(s.req.rid)
        self.stats["finished_requests"] += 1
        out = GenerateOutput(
            rid=s.req.rid,
            prompt_tokens=len(s.req.input_ids),
            output_ids=list(s.out_ids),
            output_logprobs=list(s.out_lps),
            finish_reason=s.finish,
            weight_version=self.weight_version,
            text=self._text(s),
            e2e_latency=time.perf_counter() - s.t0,
            cached_tokens=s.cached_tokens,
        )
        s.handle._emit(StreamChunk(s.req.rid, s.out_ids[s.streamed :], s.out_lps[s.streamed :], output=out))
        s.streamed = len(s.out_ids)
        if not s.handle.future.done():
            s.handle.future.set_result(out)

    def decode(self, ids: list[int], sp: SamplingParams) -> str:
        """`ids` as text under the request's detokenizer options (SGLang's skip_special_tokens and
        spaces_between_special_tokens; the latter is passed only when off, so a tokenizer that lacks it is not
        handed an unknown argument at the default)."""
        extra = {} if sp.spaces_between_special_tokens else {"spaces_between_special_tokens": False}
        return self.tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens, **extra)

    def _text(self, s: _Seq) -> str | None:
        """Decoded output; a matched stop string or stop token is trimmed unless no_stop_trim (as SGLang)."""
        if self.tokenizer is None:
            return None
        sp = s.req.sampling
        ids = s.out_ids
        fin = s.finish or {}
        if fin.get("type") == "stop" and isinstance(fin.get("matched"), int) and not sp.no_stop_trim:
            ids = ids[:-1]
        text = self.decode(ids, sp)
        if fin.get("type") == "stop" and isinstance(fin.get("matched"), str) and not sp.no_stop_trim:
            cut = text.find(fin["matched"])
            if cut >= 0:
                text = text[:cut]
        return text


def _engine_error(e: Exception) -> dict[str, Any]:
    return {"type": "abort", "message": f"engine error: {type(e).__name__}: {e}"}


def dtype_from_name(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise EngineError(f"dtype {name!r}: expected float32 or bfloat16")
    return table[name]
