"""One async client for rollout engines: generation through sglang-router, control calls to every engine.

The same client talks to the embedded engine, real SGLang servers, or a single engine with no router (pass
its URL as ``router_url`` too): all speak SGLang's native HTTP API.

Who retries what:
- the router retries a ``/generate`` on another engine when the chosen one refuses the connection, drops it
  mid-request (crash, SIGKILL) or answers 5xx, re-sending the same body, hence the same ``rid``;
- this client retries only what the router cannot: the router itself unreachable (restarting), or answering
  5xx because every attempt failed or no engine was available (503 while a pool is being replaced). It
  re-sends the same ``rid`` too. A read timeout is not retried: the request may still be running and a
  second copy would double the work; it raises.
Either way an engine may have seen a request twice, and the caller gets one result per call: keep results
keyed by ``rid``. 4xx answers (a bad request) raise :class:`EngineCallError` at once; a 409 refusing a request
pinned to weight versions the engine does not serve raises its subclass :class:`WeightVersionRefused`.

The router does not forward ``/abort_request``, ``/pause_generation``, ``/continue_generation``,
``/update_weights_from_disk`` or ``/model_info``: those go to each engine in ``engine_urls`` directly, which
:meth:`add_engine`/:meth:`remove_engine` keep in step with the pool.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from sluiceway.infra.router import ROUTING_KEY_HEADER
from sluiceway.infra.weight_pin import WEIGHT_VERSION_MISMATCH, pin_body
from sluiceway.tasks.rollout.generation import GenerationDefaults


class EngineCallError(RuntimeError):
    """A generate call failed for good, or an engine refused a control call (the message names the engine)."""


class WeightVersionRefused(EngineCallError):
    """A pinned generate call refused by the engine it reached: it serves a version outside [min, max].
    Not retried: the same router would send it to engines serving the same version."""

    def __init__(self, message: str, serving: int | None, min_version: int | None, max_version: int | None):
        super().__init__(message)
        self.serving = serving  # the engine's version; None when it is not an integer (SGLang's "default")
        self.min_version = min_version
        self.max_version = max_version


@dataclass
class GenerateResult(GenerationDefaults):
    """One engine answer, a `Generation` (tasks/rollout/generation.py) without the optional parts."""

    rid: str
    token_ids: list[int]
    logprobs: list[float]  # one per token when asked for, else empty
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int
    prompt_tokens: int
    latency_s: float  # wall time of the call, retries included


def parse_weight_version(value: Any) -> int:
    """SGLang reports the version as a string ("default" before any update): ints pass, anything else is 0."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def parse_generate_response(body: Any, rid: str, prompt_len: int, latency_s: float) -> GenerateResult:
    """A ``GenerateResult`` from SGLang's ``/generate`` JSON (one request, not a batch, not streamed). An answer
    of another shape (a remote pool's router may be anything behind a URL) raises EngineCallError, as a failed
    call does: the dispatcher benches the pool and the group goes elsewhere."""
    try:
        return _parse_generate(body, rid, prompt_len, latency_s)
    except (TypeError, ValueError, AttributeError, IndexError, KeyError, RecursionError) as exc:
        raise EngineCallError(f"rid {rid}: the answer is not a /generate answer ({type(exc).__name__}: "
                              f"{str(exc)[:200]})") from None  # fmt: skip


MAX_TOKEN_ID = 2**31 - 1  # token ids are int32 in the tables and the trainer


def _parse_generate(body: Any, rid: str, prompt_len: int, latency_s: float) -> GenerateResult:
    if isinstance(body, list):  # a batch answer; we always send one request
        body = body[0]
    meta = body.get("meta_info") or {}
    token_ids = [int(t) for t in body.get("output_ids") or []]
    if any(not 0 <= t <= MAX_TOKEN_ID for t in token_ids):
        raise ValueError("a token id out of range")
    pairs = meta.get("output_token_logprobs") or []  # [[logprob, token_id, text-or-null], ...]
    logprobs = [float(p[0]) for p in pairs]
    if pairs and len(pairs) != len(token_ids):
        raise EngineCallError(f"rid {rid}: {len(token_ids)} output ids but {len(pairs)} logprobs")
    reason = meta.get("finish_reason")
    if isinstance(reason, dict):
        reason = reason.get("type")
    return GenerateResult(
        rid=rid,
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=str(reason or "abort"),  # no reason: the engine cut it off without saying why
        weight_version=parse_weight_version(meta.get("weight_version")),
        prompt_tokens=int(meta.get("prompt_tokens", prompt_len)),
        latency_s=latency_s,
    )


def _refusal(r: httpx.Response, rid: str, url: str) -> WeightVersionRefused | None:
    """The WeightVersionRefused a 409 carries (infra/weight_pin.py), or None for any other answer. Read from the
    body whatever its Content-Type: through the router a refused streamed request comes back as event-stream."""
    if r.status_code != 409:
        return None
    try:
        err = r.json().get("error")
    except (ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(err, dict) or err.get("type") != WEIGHT_VERSION_MISMATCH:
        return None
    serving = err.get("serving")
    try:
        version = None if isinstance(serving, bool) else int(serving)
    except (TypeError, ValueError):
        version = None
    message = f"rid {rid}: {url}/generate refused it (409): {err.get('message') or 'weight version mismatch'}"
    return WeightVersionRefused(message, version, err.get("min"), err.get("max"))


def _rid_in_use(answer: str) -> bool:
    """Whether an engine refused a request because its rid is running already (the embedded engine says "already
    in use by a running request"; a server that words it "duplicate request id" is read the same)."""
    text = answer.lower()
    return "already in use" in text or "duplicate request id" in text


def _error_text(r: httpx.Response) -> str:
    try:
        body = r.json()
    except (ValueError, RecursionError):
        return r.text[:500]
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)
        return str(body.get("message") or body.get("detail") or err)
    return str(body)[:500]


class EngineClient:
    def __init__(
        self,
        router_url: str,
        engine_urls: list[str],
        timeout_s: float = 600,
        max_connections: int = 256,
        max_retries: int = 4,
        retry_backoff_s: float = 0.5,
    ) -> None:
        self.router_url = router_url.rstrip("/")
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        # LoRA adapters loaded with load_lora_adapter, newest last; requests name the newest (SGLang's lora_path).
        self.lora_names: list[str] = []
        self._http = httpx.AsyncClient(
            # pool=None: calls beyond max_connections queue for a connection instead of timing out there.
            timeout=httpx.Timeout(timeout_s, connect=10.0, pool=None),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            trust_env=False,  # loopback and cluster addresses: never through an HTTP proxy
        )

    # --- generation ----------------------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict,
        rid: str,
        return_logprob: bool = True,
        routing_key: str | None = None,
        min_weight_version: int | None = None,
        max_weight_version: int | None = None,
    ) -> GenerateResult:
        """One request through the router. Requests with one `routing_key` (a GRPO group's samples) go to one
        engine, where they share their prompt's prefill (infra/router.py: the manual policy).

        `min_weight_version` / `max_weight_version` pin the request: an engine serving a version outside them
        refuses it before generating (WeightVersionRefused). The embedded engine enforces this; real SGLang
        engines ignore the pin (docs/weight_sync.md), so the result's weight_version stays the check that counts."""
        body = {"input_ids": list(input_ids), "sampling_params": sampling_params, "rid": rid}
        body |= pin_body(min_weight_version, max_weight_version)
        if self.lora_names:
            body["lora_path"] = self.lora_names[-1]
        keyed = {ROUTING_KEY_HEADER: routing_key} if routing_key else None
        if return_logprob:
            body["return_logprob"] = True
        start = time.monotonic()
        # Retries go without the key: the router keeps a key on its engine until health checks mark that engine
        # down, so a dead engine would take every retry; unkeyed, it picks (and retries) anew.
        answer = await self._post_generate(body, rid, lambda attempt: keyed if attempt == 0 else None)
        return parse_generate_response(answer, rid, len(input_ids), time.monotonic() - start)

    async def score(self, input_ids: list[int], start: int, rid: str) -> list[float]:
        """Log-probs the engine's model gives the tokens ``input_ids[start:]`` (each after the tokens before it):
        SGLang's scoring call, ``max_new_tokens`` 0 with ``logprob_start_len`` 0, of which the entries from
        ``start`` on are kept (the on-policy distillation teacher scoring a response: ``start`` = prompt length).
        Asking from position 0 works the same on every SGLang version (the first entry, position 0, is null).
        Retried as `generate` is; raises EngineCallError if the answer does not cover the tokens."""
        if not 1 <= start < len(input_ids):
            raise ValueError(f"score: start {start} must be in [1, {len(input_ids)})")
        body = {
            "input_ids": list(input_ids),
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "rid": rid,
        }
        answer = await self._post_generate(body, rid, lambda attempt: None, what="/generate (scoring)")
        want = [int(t) for t in input_ids[start:]]
        try:
            meta = (answer[0] if isinstance(answer, list) else answer).get("meta_info") or {}
            # The scored span is the tail: [[logprob, token id, text], ...] (slime reads it the same way, which
            # does not depend on whether a server lists position 0).
            tail = (meta.get("input_token_logprobs") or [])[-len(want) :]
            scored = [int(p[1]) for p in tail] == want and all(p[0] is not None for p in tail)
            logprobs = [float(p[0]) for p in tail] if scored else []
        except (TypeError, ValueError, AttributeError, IndexError, KeyError, RecursionError):
            scored = False
        if not scored:
            raise EngineCallError(
                f"rid {rid}: {self.router_url} did not score the {len(want)} tokens from position {start} "
                f"(input_token_logprobs ends with other token ids or nulls)"
            )
        return logprobs

    async def _post_generate(
        self, body: dict, rid: str, headers: Callable[[int], dict | None], what: str = "/generate"
    ) -> Any:
        """POST `body` to the router's /generate and return its JSON answer. Transport errors and 5xx are retried
        with exponential backoff (the same rid again; `headers(attempt)` gives each try's headers); a read or
        write timeout or a 4xx raises EngineCallError at once."""
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(min(self.retry_backoff_s * 2 ** (attempt - 1), 10.0))
            try:
                r = await self._http.post(f"{self.router_url}/generate", json=body, headers=headers(attempt))
            except (httpx.ReadTimeout, httpx.WriteTimeout) as e:
                raise EngineCallError(f"rid {rid}: no answer from {self.router_url} in time ({e!r})") from e
            except (httpx.InvalidURL, httpx.UnsupportedProtocol) as e:  # a pool's record or flag: never retried
                raise EngineCallError(f"rid {rid}: {self.router_url} is no address a request can go to "
                                      f"({type(e).__name__})") from None  # fmt: skip
            except httpx.TransportError as e:
                # Router unreachable or connection dropped (connect/pool timeouts included): same rid again.
                last = f"{type(e).__name__}: {e}"
                continue
            except httpx.HTTPError as e:  # an answer httpx cannot decode (a bad Content-Encoding), say
                raise EngineCallError(f"rid {rid}: {self.router_url}{what} answered what is no HTTP answer "
                                      f"({type(e).__name__}: {e})") from None  # fmt: skip
            if r.status_code >= 500:
                last = f"{r.status_code} {_error_text(r)}"
                continue
            if r.status_code >= 400:
                refused = _refusal(r, rid, self.router_url)
                if refused is not None:
                    raise refused
                answer = f"{r.status_code}: {_error_text(r)}"
                if r.status_code == 400 and _rid_in_use(answer) and self.engine_urls and attempt < self.max_retries:
                    # A killed run's request under this rid still runs (a resume sends the same rids): nobody will
                    # read its answer. Abort it on every engine and send this one again.
                    await self.abort(rid)
                    last = answer
                    continue
                raise EngineCallError(f"rid {rid}: {self.router_url}/generate answered {answer}")
            try:
                return r.json()
            except (ValueError, RecursionError):  # HTML from a proxy or a login page, say: not the API's answer
                kind = r.headers.get("content-type", "no content type")[:80]
                raise EngineCallError(f"rid {rid}: {self.router_url}{what} answered {r.status_code} with a body "
                                      f"that is not JSON ({kind!r}, {len(r.content)} bytes)") from None  # fmt: skip
        tries = self.max_retries + 1
        raise EngineCallError(f"rid {rid}: {self.router_url}{what} failed {tries} times; last: {last}")

    # --- control: each engine --------------------------------------------------------------------------------

    async def _call(self, method: str, url: str, path: str, json: dict | None, timeout: float | None) -> Any:
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        if json is not None:
            kwargs["json"] = json
        try:
            r = await self._http.request(method, f"{url}{path}", **kwargs)
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            raise EngineCallError(f"{url}{path}: {type(e).__name__}: {e}") from e
        if r.status_code >= 400:
            raise EngineCallError(f"{url}{path} answered {r.status_code}: {_error_text(r)}")
        try:
            body = r.json()
        except (ValueError, RecursionError):
            return r.text
        # SGLang reports some failures as 200 with success=false.
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineCallError(f"{url}{path} failed: {body.get('message', body)}")
        return body

    async def _broadcast(
        self, method: str, path: str, json: dict | None = None, timeout: float | None = None, strict: bool = True
    ) -> dict[str, Any]:
        """The call on every engine at once; ``strict``: one error naming every engine that failed."""
        urls = list(self.engine_urls)
        results = await asyncio.gather(
            *(self._call(method, u, path, json, timeout) for u in urls), return_exceptions=True
        )
        failed = [str(r) for r in results if isinstance(r, BaseException)]
        if strict and failed:
            raise EngineCallError(f"{len(failed)} of {len(urls)} engines failed: " + "; ".join(failed))
        return {u: r for u, r in zip(urls, results, strict=True) if not isinstance(r, BaseException)}

    async def abort(self, rid: str) -> None:
        """Abort ``rid`` wherever it runs (best effort: an engine that died has nothing to abort)."""
        await self._broadcast("POST", "/abort_request", {"rid": rid}, strict=False)

    async def abort_all(self) -> None:
        """Abort every request in flight; each returns its tokens so far with finish reason "abort"."""
        await self._broadcast("POST", "/abort_request", {"rid": "", "abort_all": True}, strict=False)

    async def pause(self, mode: str | None = None) -> None:
        """Stop scheduling on every engine (SGLang's ``mode``: "abort" | "retract" | "in_place")."""
        await self._broadcast("POST", "/pause_generation", {} if mode is None else {"mode": mode})

    async def resume(self) -> None:
        await self._broadcast("POST", "/continue_generation", {})

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> None:
        """Every engine loads ``model_path`` and reports ``weight_version``; raises if any engine fails."""
        await self._broadcast(
            "POST",
            "/update_weights_from_disk",
            {"model_path": str(model_path), "weight_version": str(weight_version)},
        )

    async def load_lora_adapter(self, adapter_dir: str, weight_version: int, keep: int = 2) -> None:
        """Every engine loads the LoRA adapter directory as adapter ``v<weight_version>`` (SGLang's dynamic LoRA
        loading) and reports the version; from then on requests name it. Adapters older than the newest ``keep``
        are unloaded (requests still running may name the one before)."""
        name = f"v{weight_version}"
        await self._broadcast("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dir)})
        await self._broadcast(
            "POST", "/update_weight_version", {"new_version": str(weight_version), "abort_all_requests": False}
        )
        self.lora_names = [n for n in self.lora_names if n != name] + [name]
        while len(self.lora_names) > keep:
            await self._broadcast("POST", "/unload_lora_adapter", {"lora_name": self.lora_names.pop(0)}, strict=False)

    async def flush_cache(self) -> None:
        await self._broadcast("POST", "/flush_cache")

    async def _model_info(self, url: str) -> dict:
        try:
            return await self._call("GET", url, "/model_info", None, 30.0)
        except EngineCallError:  # older SGLang only has the get_ name
            return await self._call("GET", url, "/get_model_info", None, 30.0)

    async def weight_versions(self) -> dict[str, int]:
        urls = list(self.engine_urls)
        infos = await asyncio.gather(*(self._model_info(u) for u in urls))
        return {u: parse_weight_version(i.get("weight_version")) for u, i in zip(urls, infos, strict=True)}

    async def health(self, timeout_s: float = 5.0) -> dict[str, bool]:
        async def ok(url: str) -> bool:
            try:
                return (await self._http.get(f"{url}/health", timeout=timeout_s)).status_code == 200
            except httpx.HTTPError:
                return False

        urls = list(self.engine_urls)
        return dict(zip(urls, await asyncio.gather(*(ok(u) for u in urls)), strict=True))

    # --- membership ------------------------------------------------------------------------------------------

    def add_engine(self, url: str) -> None:
        url = url.rstrip("/")
        if url not in self.engine_urls:
            self.engine_urls.append(url)

    def remove_engine(self, url: str) -> None:
        url = url.rstrip("/")
        if url in self.engine_urls:
            self.engine_urls.remove(url)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
