"""SGLang's native HTTP API in front of the embedded engine, so it, a real SGLang server and sglang-router
are interchangeable behind one client (docs/design.md, Contracts).

Field names, response shapes and status codes follow sglang's `http_server.py` / `io_struct.py`:
`/generate` (text or input_ids, single or batched; SSE streaming with cumulative `text`/`output_ids`, as
SGLang streams by default; `return_logprob` with `logprob_start_len` adds `meta_info.input_token_logprobs`, and
`max_new_tokens` 0 only scores the input: on-policy distillation's teacher call), `/health`, `/health_generate`,
`/model_info`, `/server_info` (+ `/get_` aliases),
`/flush_cache`, `/abort_request`, `/pause_generation`, `/continue_generation`, `/update_weights_from_disk`,
`/update_weight_version`, `/load_lora_adapter`, `/unload_lora_adapter` (with `lora_path` naming the adapter on
`/generate`), and OpenAI's `/v1/models`, `/v1/chat/completions` (non-streaming).

Differences, on purpose: `/pause_generation` defaults to mode "in_place" (requests keep their KV cache and
resume on `/continue_generation`; "abort" aborts them first); LoRA adapters are merged into the weights, one at a
time: every loaded name is served by the newest adapter (SGLang serves each its own until unloaded); sampling
fields SGLang knows but this engine does not implement are accepted only at their defaults (`custom_params`
is accepted and ignored: no custom logit processor runs here; requests.py); any input the engine
cannot honour is a 400 with one message, numbers outside SGLang's ranges and bodies that are not UTF-8 JSON
objects of valid text included (a Content-Type other than JSON is a 415). Added: a /generate pinned to weight
versions (``min_weight_version``/``max_weight_version``, infra/weight_pin.py) that this engine does not serve is
refused with a 409 (SGLang has no such field and ignores it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sluiceway.models.engine.calls import (
    EngineError,
    GenerateOutput,
    GenerateRequest,
    SamplingParams,
    StreamChunk,
)
from sluiceway.models.engine.core import Engine
from sluiceway.models.engine.requests import (
    GENERATE_DEFAULT_ONLY,
    GENERATE_FIELDS,
    BadRequest,
    parse_json_body,
    parse_sampling_params,
    parse_weight_pin,
    per_item,
    weight_pin_refusal,
)

log = logging.getLogger(__name__)


def _error(message: str, status: int = 400) -> JSONResponse:
    # SGLang's ErrorResponse shape.
    body = {"object": "error", "message": message, "type": "BadRequest", "param": None, "code": status}
    return JSONResponse(body, status_code=status)


REQUEST_LOG_ENV = "SLUICEWAY_ENGINE_REQUEST_LOG"
# How often a running non-streamed request asks whether its client is still there (a cheap receive check).
DISCONNECT_POLL_S = 0.25


def _log_request(req: GenerateRequest, out: GenerateOutput) -> None:
    """Opt-in ($SLUICEWAY_ENGINE_REQUEST_LOG=path): one JSON line per finished non-streamed /generate request,
    the ids the engine took in and gave out with their log-probs (what tests compare stored trajectories with).
    Engines sharing the file append whole lines (one write each)."""
    import os

    path = os.environ.get(REQUEST_LOG_ENV)
    if not path:
        return
    line = json.dumps({
        "rid": out.rid, "input_ids": list(req.input_ids), "output_ids": list(out.output_ids),
        "output_logprobs": list(out.output_logprobs), "finish_reason": out.finish_reason,
        "weight_version": out.weight_version,
    })  # fmt: skip
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


class EngineServer:
    """The FastAPI app around one Engine."""

    def __init__(self, engine: Engine, served_model_name: str | None = None):
        self.engine = engine
        self.served_model_name = served_model_name or str(engine.model_path)
        self.tokenizer = engine.tokenizer
        self.app = self._build()

    def _check_lora_path(self, lora_path: Any) -> None:
        """SGLang's per-request adapter name (`lora_path`: a name, or one per request): each must be an adapter this
        engine loaded (it serves them all with the newest merged in); None is the weights as they are."""
        names = lora_path if isinstance(lora_path, list) else [lora_path]
        for name in names:
            if name is None:
                continue
            if not isinstance(name, str):
                raise BadRequest(f"lora_path must be an adapter name or a list of them, got {name!r}")
            if name not in self.engine.lora_names:
                raise BadRequest(f"lora_path {name!r}: no such adapter is loaded (load it with /load_lora_adapter)")

    # ------------------------------------------------------------------------------------------ /generate
    def _to_requests(
        self, body: dict[str, Any]
    ) -> tuple[list[GenerateRequest], list[bool], bool, list[int | None], list[bool]]:
        """(requests, return_logprob per request, batched?, logprob_start_len per request (None: no input-token
        log-probs), score only per request (max_new_tokens 0: the input's log-probs, nothing generated))."""
        for k, v in body.items():
            if k in GENERATE_FIELDS:
                continue
            if k == "custom_logit_processor" and v is not None:
                # Its own message: custom_params (this processor's argument) is accepted, so say nothing reads it.
                raise BadRequest(
                    "custom_logit_processor is not supported by the embedded engine: it runs no custom logit "
                    "processor (sampling_params.custom_params is accepted and ignored without one)"
                )
            if k in GENERATE_DEFAULT_ONLY:
                if v is not None and v != GENERATE_DEFAULT_ONLY[k]:
                    raise BadRequest(f"{k}={v!r} is not supported by the embedded engine")
                continue
            raise BadRequest(f"unknown field {k!r} in /generate request")
        self._check_lora_path(body.get("lora_path"))
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise BadRequest("give exactly one of text or input_ids")
        if text is not None:
            if isinstance(text, str):
                texts, batched = [text], False
            elif isinstance(text, list) and all(isinstance(t, str) for t in text):
                texts, batched = text, True
            else:
                raise BadRequest("text must be a string or a list of strings")
            if not texts or any(not t for t in texts):
                raise BadRequest("empty input: text must be non-empty")
            if self.tokenizer is None:
                raise BadRequest("this engine has no tokenizer: send input_ids")
            prompts = [self.tokenizer(t)["input_ids"] for t in texts]
        else:
            if isinstance(input_ids, list) and input_ids and all(isinstance(r, list) for r in input_ids):
                prompts, batched = input_ids, True
            elif isinstance(input_ids, list):
                prompts, batched = [input_ids], False
            else:
                raise BadRequest("input_ids must be a list of token ids or a list of such lists")
            for row in prompts:
                if not row:
                    raise BadRequest("empty input: input_ids must be non-empty")
                bad = next((t for t in row if not isinstance(t, int) or isinstance(t, bool)), None)
                if bad is not None:
                    raise BadRequest(f"input_ids must hold integers, got {bad!r}")
        n = len(prompts)
        sps = per_item(body.get("sampling_params"), n, "sampling_params", batched)
        rlp = per_item(body.get("return_logprob"), n, "return_logprob", batched)
        rid = body.get("rid")
        if rid is None:
            rids: list[str | None] = [None] * n
        elif isinstance(rid, str):
            rids = [rid] if not batched else [f"{rid}_{i}" for i in range(n)]
        elif isinstance(rid, list) and batched and len(rid) == n and all(isinstance(r, str) for r in rid):
            rids = rid
        else:
            raise BadRequest("rid must be a string, or a list of strings with one per request")
        if len({r for r in rids if r is not None}) != len([r for r in rids if r is not None]):
            raise BadRequest("rid: the same rid appears twice in one batch")
        reqs = []
        for i in range(n):
            where = (
                f"sampling_params[{i}]"
                if batched and isinstance(body.get("sampling_params"), list)
                else "sampling_params"
            )
            reqs.append(GenerateRequest(list(prompts[i]), parse_sampling_params(sps[i], where), rids[i]))
            if rlp[i] is not None and not isinstance(rlp[i], bool):
                raise BadRequest("return_logprob must be a boolean or a list of booleans")
        # max_new_tokens 0 (SGLang's way to score a given sequence): checked as a one-token request, never run.
        score_only = [r.sampling.max_new_tokens == 0 for r in reqs]
        for r, only in zip(reqs, score_only, strict=True):
            if only:
                r.sampling.max_new_tokens = 1
        for r in reqs:
            try:
                self.engine.check_request(r)
            except EngineError as e:
                raise BadRequest(str(e)) from None
        starts: list[int | None] = []
        for r, start, want in zip(reqs, per_item(body.get("logprob_start_len"), n, "logprob_start_len", batched),
                                  rlp, strict=True):  # fmt: skip
            if start is None or start == -1:
                starts.append(None)  # SGLang's default -1: output-token log-probs only
                continue
            if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start < len(r.input_ids):
                raise BadRequest(
                    f"logprob_start_len must be -1 or an integer in [0, {len(r.input_ids)}) for an input of "
                    f"{len(r.input_ids)} tokens, got {start!r}"
                )
            starts.append(start if want else None)  # without return_logprob nothing is returned
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("stream must be a boolean")
        if stream and any(score_only):
            raise BadRequest("max_new_tokens 0 (scoring the input) cannot be streamed")
        return reqs, [bool(x) for x in rlp], batched, starts, score_only

    def _meta(
        self,
        out: GenerateOutput | None,
        rid: str,
        prompt_tokens: int,
        ids: list[int],
        lps: list[float],
        return_logprob: bool,
        t0: float,
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": out.finish_reason if out is not None else None,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(ids),
            "cached_tokens": out.cached_tokens if out is not None else 0,
            "weight_version": out.weight_version if out is not None else self.engine.weight_version,
            "e2e_latency": time.perf_counter() - t0,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
        return meta

    def _item(self, out: GenerateOutput, return_logprob: bool, t0: float) -> dict[str, Any]:
        return {
            "text": out.text if out.text is not None else "",
            "output_ids": out.output_ids,
            "meta_info": self._meta(
                out, out.rid, out.prompt_tokens, out.output_ids, out.output_logprobs, return_logprob, t0
            ),
        }

    async def _input_logprobs(self, req: GenerateRequest, start: int) -> list[list[Any]]:
        """SGLang's meta_info.input_token_logprobs: [logprob, token id, None] from position `start` on."""
        lps = await asyncio.to_thread(self.engine.score, req.input_ids, start)
        return [[lp, t, None] for lp, t in zip(lps, req.input_ids[start:], strict=True)]

    async def generate(self, body: dict[str, Any], gone: Callable[[], Awaitable[bool]] | None = None):
        """SGLang's /generate. `gone` (the HTTP request's `is_disconnected`) is asked while a non-streamed request
        runs: a client that went away (killed, timed out) has its requests aborted, as SGLang does, so they stop
        spending compute and their rids are free for the run that resumes them."""
        t0 = time.perf_counter()
        reqs, rlp, batched, starts, score_only = self._to_requests(body)
        # A pinned request (infra/weight_pin.py) is checked against the version served when it is admitted here,
        # before it is queued, so before any of its tokens exist; a refusal is a 409 the client raises as
        # WeightVersionRefused. That is the whole guarantee: a weight update landing while it waits or runs
        # (/update_weight_version aborts what is in flight unless told not to; /update_weights_from_disk only
        # with abort_all_requests) can still give it tokens of a later version, and then meta_info.weight_version
        # (the version at completion, as today) says so and the rollout's staleness check still applies.
        refusal = weight_pin_refusal(self.engine.weight_version, *parse_weight_pin(body))
        if refusal is not None:
            return JSONResponse(refusal, status_code=409)
        loop = asyncio.get_running_loop()
        if not body.get("stream", False):
            handles = []
            try:
                for r, only in zip(reqs, score_only, strict=True):
                    handles.append(None if only else self.engine.submit(r))
            except EngineError as e:
                for h in handles:
                    if h is not None:
                        self.engine.abort(h.rid)
                raise BadRequest(str(e)) from None
            items = []
            for r, h, lp, start in zip(reqs, handles, rlp, starts, strict=True):
                if h is None:  # score only: nothing generated, finish_reason length 0 (as SGLang)
                    rid = r.rid or f"req-{uuid.uuid4().hex[:16]}"
                    out = GenerateOutput(rid, len(r.input_ids), [], [], {"type": "length", "length": 0},
                                         self.engine.weight_version, text="")  # fmt: skip
                else:
                    out = await self._unless_gone(h, handles, gone)
                    _log_request(r, out)
                item = self._item(out, lp, t0)
                if start is not None:
                    try:
                        item["meta_info"]["input_token_logprobs"] = await self._input_logprobs(r, start)
                    except EngineError as e:
                        raise BadRequest(str(e)) from None
                items.append(item)
            return items if batched else items[0]

        queue: asyncio.Queue[tuple[int, StreamChunk]] = asyncio.Queue()
        handles = []
        try:
            for i, r in enumerate(reqs):
                handles.append(
                    self.engine.submit(r, on_chunk=lambda c, i=i: loop.call_soon_threadsafe(queue.put_nowait, (i, c)))
                )
        except EngineError as e:
            for h in handles:
                self.engine.abort(h.rid)
            raise BadRequest(str(e)) from None

        async def events():
            ids: list[list[int]] = [[] for _ in reqs]
            lps: list[list[float]] = [[] for _ in reqs]
            left = len(reqs)
            try:
                while left:
                    i, chunk = await queue.get()
                    ids[i] += chunk.token_ids
                    lps[i] += chunk.logprobs
                    out = chunk.output
                    if out is not None:
                        left -= 1
                        text = out.text or ""
                    else:
                        text = self.engine.decode(ids[i], reqs[i].sampling) if self.tokenizer else ""
                    item = {
                        "text": text,
                        "output_ids": list(ids[i]),
                        "meta_info": self._meta(out, reqs[i].rid, len(reqs[i].input_ids), ids[i], lps[i], rlp[i], t0),
                    }
                    if batched:
                        item["index"] = i
                    yield f"data: {json.dumps(item)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                if left:  # the client went away: stop spending compute on it
                    for h in handles:
                        if not h.future.done():
                            await asyncio.to_thread(self.engine.abort, h.rid)

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _unless_gone(self, handle: Any, handles: list, gone: Callable[[], Awaitable[bool]] | None) -> Any:
        """The output of `handle`, asking `gone` every DISCONNECT_POLL_S meanwhile; when the client is gone, every
        unfinished request of the call is aborted (and its output, which nobody will read, returned)."""
        future = asyncio.wrap_future(handle.future)
        while gone is not None:
            done, _ = await asyncio.wait({future}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await gone():
                for h in handles:
                    if h is not None and not h.future.done():
                        await asyncio.to_thread(self.engine.abort, h.rid, False, "Aborted: the client went away.")
                break
        return await future

    # ------------------------------------------------------------------------------------------ OpenAI chat
    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("messages must be a non-empty list of {role, content} objects")
        if body.get("stream"):
            raise BadRequest("stream=true is not supported on /v1/chat/completions by the embedded engine")
        if body.get("n", 1) not in (1, None):
            raise BadRequest("n must be 1")
        if self.tokenizer is None:
            raise BadRequest("this engine has no tokenizer")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # noqa: BLE001 (template errors are the caller's input)
            raise BadRequest(f"messages: chat template failed: {e}") from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        sp: dict[str, Any] = {}
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None:
            sp["max_new_tokens"] = max_tokens
        for src, dst in (
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("top_k", "top_k"),
            ("min_p", "min_p"),
            ("seed", "sampling_seed"),
            ("stop", "stop"),
            ("stop_token_ids", "stop_token_ids"),
            ("ignore_eos", "ignore_eos"),
        ):
            if body.get(src) is not None:
                sp[dst] = body[src]
        req = GenerateRequest(list(ids), parse_sampling_params(sp, "request"), None)
        try:
            handle = self.engine.submit(req)
        except EngineError as e:
            raise BadRequest(str(e)) from None
        out = await asyncio.wrap_future(handle.future)
        fin = out.finish_reason
        logprobs = None
        if body.get("logprobs"):
            toks = [self.tokenizer.decode([t]) for t in out.output_ids]
            logprobs = {
                "content": [
                    {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                    for s, lp in zip(toks, out.output_logprobs, strict=True)
                ]
            }
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.served_model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": out.text or ""},
                    "logprobs": logprobs,
                    "finish_reason": fin["type"],
                    "matched_stop": fin.get("matched"),
                }
            ],
            "usage": {
                "prompt_tokens": out.prompt_tokens,
                "completion_tokens": len(out.output_ids),
                "total_tokens": out.prompt_tokens + len(out.output_ids),
            },
            "metadata": {"weight_version": out.weight_version},
        }

    # ------------------------------------------------------------------------------------------ app
    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": str(self.engine.model_path),
            "tokenizer_path": str(self.engine.model_path),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.engine.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(self.engine.config, "model_type", None),
            "architectures": getattr(self.engine.config, "architectures", None),
        }

    def server_info(self) -> dict[str, Any]:
        e = self.engine
        return {
            "model_path": str(e.model_path),
            "tokenizer_path": str(e.model_path),
            "served_model_name": self.served_model_name,
            "max_running_requests": e.max_running_requests,
            "max_total_num_tokens": e.max_running_requests * e.max_total_len,
            "context_length": e.max_total_len,
            "dtype": str(e.dtype).removeprefix("torch."),
            "weight_version": e.weight_version,
            "internal_states": [e.load()],
            "version": "sluiceway-embedded",
        }

    def _build(self):
        app = FastAPI(title="sluiceway embedded engine", openapi_url=None)

        async def json_body(request: Request, required: bool = True) -> dict[str, Any]:
            return parse_json_body(await request.body(), request.headers.get("content-type"), required)

        @app.exception_handler(BadRequest)
        async def _bad(_request: Request, exc: BadRequest):
            return _error(str(exc), exc.status)

        @app.exception_handler(EngineError)
        async def _engine_err(_request: Request, exc: EngineError):
            return _error(str(exc))

        @app.exception_handler(Exception)
        async def _internal(_request: Request, exc: Exception):
            # A bug, not the caller's input: SGLang's error shape rather than a plain-text 500 (Starlette still
            # logs the traceback).
            return _error(f"internal error: {type(exc).__name__}: {exc}", 500)

        @app.get("/health")
        async def health():
            ok = self.engine._thread.is_alive()
            return Response(status_code=200 if ok else 503)

        @app.get("/health_generate")
        async def health_generate():
            # As SGLang: if requests are in flight (or generation is paused) the engine is known to be alive.
            load = self.engine.load()
            if load["num_running_reqs"] or load["paused"]:
                return Response(status_code=200)
            req = GenerateRequest(
                [0], SamplingParams(max_new_tokens=1, temperature=0.0), f"HEALTH_CHECK_{uuid.uuid4().hex}"
            )
            handle = self.engine.submit(req)
            try:
                await asyncio.wait_for(asyncio.wrap_future(handle.future), timeout=20)
            except TimeoutError:
                return Response(status_code=503)
            return Response(status_code=200)

        @app.api_route("/generate", methods=["POST", "PUT"])
        async def generate(request: Request):
            return await self.generate(await json_body(request), request.is_disconnected)

        @app.get("/model_info")
        @app.get("/get_model_info")
        async def model_info():
            return self.model_info()

        @app.get("/server_info")
        @app.get("/get_server_info")
        async def server_info():
            return self.server_info()

        @app.get("/get_load")
        async def get_load():
            return self.engine.load()

        @app.get("/get_weight_version")
        async def get_weight_version():
            return {"weight_version": self.engine.weight_version}

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache():
            ok = await asyncio.to_thread(self.engine.flush_cache)
            return Response(
                content="Cache flushed.\n" if ok else "Cache not flushed: requests are running or waiting.\n",
                status_code=200 if ok else 400,
            )

        @app.post("/abort_request")
        async def abort_request(request: Request):
            body = await json_body(request)
            rid, abort_all = body.get("rid"), body.get("abort_all", False)
            if not isinstance(abort_all, bool) or (rid is not None and not isinstance(rid, str)):
                raise BadRequest('abort_request takes {"rid": str} or {"abort_all": true}')
            if not abort_all and not rid:
                raise BadRequest("abort_request needs a rid or abort_all=true")
            await asyncio.to_thread(self.engine.abort, rid, abort_all)
            return Response(status_code=200)

        @app.post("/pause_generation")
        async def pause_generation(request: Request):
            body = await json_body(request, required=False)
            mode = body.get("mode", "in_place")
            if mode not in ("in_place", "retract", "abort"):
                raise BadRequest(f"mode {mode!r}: expected in_place, retract or abort")
            if mode == "abort":
                await asyncio.to_thread(self.engine.abort, None, True)
            await asyncio.to_thread(self.engine.pause)
            return {"message": "Generation paused successfully.", "status": "ok"}

        @app.post("/continue_generation")
        async def continue_generation():
            await asyncio.to_thread(self.engine.resume)
            return {"message": "Generation continued successfully.", "status": "ok"}

        @app.post("/update_weights_from_disk")
        async def update_weights_from_disk(request: Request):
            body = await json_body(request)
            path = body.get("model_path")
            version = body.get("weight_version")
            if not isinstance(path, str) or not path:
                raise BadRequest("model_path must be a non-empty string")
            if version is not None and not isinstance(version, (str, int)):
                raise BadRequest("weight_version must be a string")
            if body.get("load_format") not in (None, "auto", "safetensors"):
                raise BadRequest(f"load_format={body['load_format']!r} is not supported (safetensors only)")
            if body.get("abort_all_requests"):
                await asyncio.to_thread(self.engine.abort, None, True)
            try:
                v = await asyncio.to_thread(
                    self.engine.update_weights_from_disk, path, None if version is None else str(version)
                )
            except EngineError as e:
                return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0}, status_code=400)
            msg = f"Succeeded to update model weights from {path}. Weight version updated to {v}."
            return {"success": True, "message": msg, "num_paused_requests": 0}

        @app.post("/load_lora_adapter")
        async def load_lora_adapter(request: Request):
            body = await json_body(request)
            name, path = body.get("lora_name"), body.get("lora_path")
            if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
                raise BadRequest("lora_name and lora_path must be non-empty strings")
            try:
                await asyncio.to_thread(self.engine.load_lora_adapter, name, path)
            except EngineError as e:
                return JSONResponse({"success": False, "error_message": str(e)}, status_code=400)
            return {"success": True, "error_message": "", "loaded_adapters": {name: path}}

        @app.post("/unload_lora_adapter")
        async def unload_lora_adapter(request: Request):
            body = await json_body(request)
            name = body.get("lora_name")
            if not isinstance(name, str) or not name:
                raise BadRequest("lora_name must be a non-empty string")
            try:
                await asyncio.to_thread(self.engine.unload_lora_adapter, name)
            except EngineError as e:
                return JSONResponse({"success": False, "error_message": str(e)}, status_code=400)
            return {"success": True, "error_message": ""}

        @app.post("/update_weight_version")
        async def update_weight_version(request: Request):
            body = await json_body(request)
            new = body.get("new_version")
            if not isinstance(new, (str, int)) or isinstance(new, bool) or new == "":
                raise BadRequest("new_version must be a non-empty string")
            if body.get("abort_all_requests", True):
                await asyncio.to_thread(self.engine.abort, None, True)
            await asyncio.to_thread(self.engine.update_weight_version, str(new))
            return {"success": True, "message": f"Weight version updated to {new}", "new_version": str(new)}

        @app.get("/v1/models")
        async def models():
            card = {
                "id": self.served_model_name,
                "object": "model",
                "created": 0,
                "owned_by": "sluiceway",
                "root": self.served_model_name,
                "max_model_len": self.engine.max_total_len,
            }
            return {"object": "list", "data": [card]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self.chat(await json_body(request))

        return app


def build_app(engine: Engine, served_model_name: str | None = None):
    return EngineServer(engine, served_model_name).app


def serve(
    model: str | Path,
    host: str = "127.0.0.1",
    port: int = 30000,
    max_running_requests: int = 64,
    max_total_len: int = 1024,
    dtype: str = "float32",
    weight_version: str = "0",
    seed: int | None = None,
    log_level: str = "warning",
    num_threads: int | None = None,
) -> None:
    """Resolve `model` (zoo name or directory), load it, and serve until interrupted (binds loopback by default).

    `num_threads`: torch's intra-op threads for this engine's forward passes. Engines that share a machine's
    cores run faster each on its own share than all on every core: a decode step is part matrix products and
    part single-threaded Python and small ops, and two one-thread engines fill both cores where one two-thread
    engine leaves one idle during the serial part (SmolLM2 on 2 cores, 32 requests: bf16 3.6 -> 1.9 s).
    """
    import uvicorn

    from sluiceway.models.engine.core import dtype_from_name
    from sluiceway.models.zoo import resolve_checkpoint

    if num_threads is not None:
        import torch

        torch.set_num_threads(num_threads)
    path = resolve_checkpoint(model)
    try:
        torch_dtype = dtype_from_name(dtype)
    except EngineError as e:
        from sluiceway.infra.errors import UserError

        raise UserError(f"--dtype: {e}") from None

    from sluiceway.infra.errors import UserError

    try:
        engine = Engine(
            path,
            max_running_requests=max_running_requests,
            max_total_len=max_total_len,
            dtype=torch_dtype,
            weight_version=str(weight_version),
            seed=seed,
        )
    except (ValueError, OSError, KeyError) as e:
        raise UserError(f"{path}: cannot serve this model: {e}") from None
    app = build_app(engine, served_model_name=str(model))
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)
    finally:
        engine.shutdown()
