"""A reward model served over HTTP: batched, timed-out, retried, never raising.

Protocol (one POST per batch of at most ``batch_size`` items)::

    POST <url>
    Content-Type: application/json
    Authorization: Bearer <key>          # only when api_key_env names a set environment variable
    {"items": [{"prompt": str, "response": str, "label": str | null, "metadata": dict}, ...]}

    200 {"rewards": [float, ...]}        # same length and order as "items"; a bare JSON list is accepted too

A reward may be ``null`` (the server declines that item): it comes back as ``(None, {"error": ...})``.

Failure handling: 5xx, 429, connection errors and timeouts are retried up to ``max_retries`` times with
exponential backoff (``backoff_s * 2**attempt``, plus jitter); other 4xx and malformed bodies are not retried.
Each attempt is bounded by ``timeout_s`` as a whole (not only per socket read), so a batch ends within about
``(max_retries + 1) * timeout_s + backoffs``. When a batch still fails, each of its items gets
``(None, {"error": "..."})``. ``score_batch`` never raises.

The API key is read from the environment at call time, sent only in the Authorization header, and scrubbed
from every error string; it is never put in details, logs or ``repr``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading

import httpx

log = logging.getLogger(__name__)


class _Retryable(Exception):
    pass


class _Fatal(Exception):
    pass


class RemoteRewardModel:
    def __init__(
        self,
        url: str,
        batch_size: int = 16,
        timeout_s: float = 30,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        api_key_env: str | None = None,
        max_concurrency: int = 4,
    ):
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.url = url
        self.batch_size = batch_size
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.api_key_env = api_key_env
        self.max_concurrency = max(1, int(max_concurrency))

    def __repr__(self) -> str:
        return f"RemoteRewardModel(url={self.url!r}, batch_size={self.batch_size}, api_key_env={self.api_key_env!r})"

    # -- helpers -------------------------------------------------------------------------------------------
    def _key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    def _scrub(self, text: str) -> str:
        key = self._key()
        if key:
            text = text.replace(key, "***")
        return text

    @staticmethod
    def _item(it: dict) -> dict:
        return {
            "prompt": it.get("prompt", ""),
            "response": it.get("response", ""),
            "label": it.get("label"),
            "metadata": it.get("metadata") or {},
        }

    # -- the work ------------------------------------------------------------------------------------------
    async def score_batch(self, items: list[dict]) -> list[tuple[float | None, dict]]:
        """Score ``items`` (dicts with prompt/response/label/metadata); one (reward|None, details) each, in order."""
        items = list(items)
        if not items:
            return []
        try:
            batches = [items[i : i + self.batch_size] for i in range(0, len(items), self.batch_size)]
            sem = asyncio.Semaphore(self.max_concurrency)
            headers = {"Content-Type": "application/json"}
            key = self._key()
            if key:
                headers["Authorization"] = f"Bearer {key}"
            timeout = httpx.Timeout(self.timeout_s)
            async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:

                async def one(batch):
                    async with sem:
                        return await self._score_one_batch(client, batch)

                parts = await asyncio.gather(*(one(b) for b in batches))
            return [r for part in parts for r in part]
        except Exception as e:  # noqa: BLE001 - never raise
            msg = self._scrub(f"{type(e).__name__}: {e}")
            return [(None, {"error": msg})] * len(items)

    async def _score_one_batch(self, client: httpx.AsyncClient, batch: list[dict]) -> list[tuple[float | None, dict]]:
        payload = {"items": [self._item(it) for it in batch]}
        last_err = "no attempt made"
        attempts = 0
        for attempt in range(self.max_retries + 1):
            attempts = attempt + 1
            try:
                rewards = await asyncio.wait_for(self._post(client, payload, len(batch)), timeout=self.timeout_s)
                out = []
                for r in rewards:
                    if r is None:
                        out.append((None, {"error": "the reward model returned null for this item"}))
                    else:
                        out.append((float(r), {"attempts": attempts}))
                return out
            except _Fatal as e:
                last_err = str(e)
                break
            except TimeoutError:
                last_err = f"timed out after {self.timeout_s}s"
            except _Retryable as e:
                last_err = str(e)
            except httpx.TimeoutException as e:
                last_err = f"timed out after {self.timeout_s}s ({type(e).__name__})"
            except httpx.TransportError as e:  # connection refused/reset, DNS, protocol errors
                last_err = f"connection error: {type(e).__name__}: {e}"
            except Exception as e:  # noqa: BLE001
                last_err = f"{type(e).__name__}: {e}"
                break
            if attempt < self.max_retries:
                delay = self.backoff_s * (2**attempt) * (1 + 0.25 * random.random())
                log.debug(
                    "remote reward model: attempt %d failed (%s); retrying in %.2fs",
                    attempts,
                    self._scrub(last_err),
                    delay,
                )
                await asyncio.sleep(delay)
        err = self._scrub(f"{last_err} (after {attempts} attempt{'s' if attempts != 1 else ''})")
        log.warning("remote reward model %s: %s", self.url, err)
        return [(None, {"error": err, "attempts": attempts}) for _ in batch]

    async def _post(self, client: httpx.AsyncClient, payload: dict, n: int) -> list:
        resp = await client.post(self.url, json=payload)
        if resp.status_code >= 500 or resp.status_code == 429:
            raise _Retryable(f"HTTP {resp.status_code}: {resp.text[:200]}")
        if resp.status_code >= 400:
            raise _Fatal(f"HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            body = resp.json()
        except ValueError as e:
            raise _Fatal(f"response is not JSON: {e}") from None
        rewards = body.get("rewards") if isinstance(body, dict) else body
        if not isinstance(rewards, list):
            raise _Fatal('response must be {"rewards": [...]} or a JSON list')
        if len(rewards) != n:
            raise _Fatal(f"got {len(rewards)} rewards for {n} items")
        for r in rewards:
            if r is not None and (isinstance(r, bool) or not isinstance(r, int | float)):
                raise _Fatal(f"reward {r!r} is not a number")
        return rewards

    # -- sync facades --------------------------------------------------------------------------------------
    def score(self, items: list[dict]) -> list[tuple[float | None, dict]]:
        """Blocking ``score_batch`` for callers without an event loop (works inside one too, via a thread)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.score_batch(items))
        box: list = []
        t = threading.Thread(target=lambda: box.append(asyncio.run(self.score_batch(items))), daemon=True)
        t.start()
        t.join()
        return box[0] if box else [(None, {"error": "scoring thread failed"})] * len(items)

    def __call__(self, response: str, label, sample: dict | None = None) -> tuple[float, dict]:
        """A per-sample scorer for the reward stage (``scorer(response, label, sample)``).

        A failed item raises RuntimeError (scrubbed text), so the stage records it as an error with reward 0.
        """
        sample = sample or {}
        meta = sample.get("metadata")
        item = {"prompt": sample.get("prompt", ""), "response": response, "label": label, "metadata": meta}
        if isinstance(meta, str):
            item["metadata"] = {"raw": meta}
        reward, details = self.score([item])[0]
        if reward is None:
            raise RuntimeError(f"remote reward model: {details.get('error')}")
        return reward, details
