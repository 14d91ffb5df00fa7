"""OpenEnv's wire protocol, spoken from the run's own interpreter (openenv itself is not imported here: it cannot
share a venv with verifiers, docs/environments.md).

An OpenEnv environment server (openenv 0.10's `create_app`) keeps an episode only over its WebSocket, `/ws`: each
connection gets its own environment instance, made when the connection opens and closed with it (its HTTP `/step`
makes a new one every call). Messages are JSON text frames, one answer per message:

    -> {"type": "reset", "data": {"seed": 3, ...}}        <- {"type": "observation", "data": PAYLOAD}
    -> {"type": "step", "data": ACTION}                   <- {"type": "observation", "data": PAYLOAD}
    -> {"type": "state"}                                  <- {"type": "state", "data": {...}}
    -> {"type": "close"}                                  (the server ends the session)
    any                                                   <- {"type": "error", "data": {"message", "code", ...}}

PAYLOAD is `{"observation": {...the observation's fields...}, "reward": x | null, "done": bool, "metadata"?: {}}`.
A connection refused for capacity gets one error frame (code CAPACITY_REACHED) and is closed. An action that does
not fit the environment's action model is an error with code VALIDATION_ERROR; an exception in the environment's
`reset` or `step` one with code EXECUTION_ERROR.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI


class EnvironmentFailed(Exception):
    """The environment (its server, or its code) failed: the sample fails with this reason."""


class ActionRefused(Exception):
    """The server refused an action as not fitting its action model: the model's mistake, told to the model."""


class CapacityReached(EnvironmentFailed):
    """The server holds as many sessions as it allows."""


class AnswerTimeout(EnvironmentFailed):
    """The server did not answer within the session's timeout (the environment hangs)."""


@dataclass
class StepResult:
    observation: dict
    reward: Any = None
    done: bool = False
    metadata: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, data: Any, what: str) -> StepResult:
        if not isinstance(data, dict) or not isinstance(data.get("observation"), dict):
            raise EnvironmentFailed(f"the environment's answer to {what} is not an observation: {_short(data)}")
        meta = data.get("metadata")
        return cls(data["observation"], data.get("reward"), bool(data.get("done", False)), meta or {})


# The largest answer read from an environment server (an observation with images fits; 100 MB had been read
# whole, and a failure while reading it named no environment).
MAX_MESSAGE_BYTES = 16 << 20


def http_url(url: str) -> str:
    """The server's base URL as http(s)://host:port[/path], without a trailing slash."""
    url = url.rstrip("/")
    for a, b in (("ws://", "http://"), ("wss://", "https://")):
        if url.startswith(a):
            return b + url[len(a) :]
    return url


def ws_url(url: str) -> str:
    url = http_url(url)
    if url.startswith("https://"):
        return "wss://" + url[len("https://") :] + "/ws"
    return "ws://" + url.removeprefix("http://") + "/ws"


def _short(x: Any, n: int = 200) -> str:
    s = x if isinstance(x, str) else json.dumps(x, default=str)
    return s if len(s) <= n else s[:n] + "..."


def _no_proxy(url: str) -> dict:
    host = http_url(url).split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
    return {"proxy": None} if host in ("127.0.0.1", "localhost", "[::1]") else {}


class OpenEnvSession:
    """One episode's connection: `async with OpenEnvSession(url, timeout_s) as env: await env.reset(...)`.

    Every answer must come within `timeout_s` (an environment that hangs fails the sample rather than the run);
    a closed connection, a refused one, an error frame other than VALIDATION_ERROR are `EnvironmentFailed`."""

    def __init__(self, url: str, timeout_s: float = 60.0, connect_timeout_s: float = 10.0):
        self.url = ws_url(url)
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._ws = None

    async def __aenter__(self) -> OpenEnvSession:
        await self.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def open(self) -> None:
        try:
            self._ws = await connect(
                self.url, open_timeout=self.connect_timeout_s, max_size=MAX_MESSAGE_BYTES, ping_interval=None,
                close_timeout=2, **_no_proxy(self.url),
            )  # fmt: skip
        except (OSError, InvalidHandshake, InvalidURI, TimeoutError) as e:
            raise EnvironmentFailed(f"cannot connect to the environment server at {self.url}: {_short(str(e))}") from e

    async def close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is None:
            return
        try:
            await asyncio.wait_for(ws.send(json.dumps({"type": "close"})), 2)
        except (ConnectionClosed, OSError, TimeoutError):
            pass
        try:
            await asyncio.wait_for(ws.close(), 3)
        except (ConnectionClosed, OSError, TimeoutError):
            pass

    async def _call(self, message: dict, what: str) -> dict:
        if self._ws is None:
            raise EnvironmentFailed(f"{what}: the connection to the environment server is closed")
        try:
            try:
                await self._ws.send(json.dumps(message))
            except ConnectionClosed:
                pass  # a refused session sends its error frame and closes: read it below
            raw = await asyncio.wait_for(self._ws.recv(), self.timeout_s)
        except TimeoutError:
            await self._drop()
            raise AnswerTimeout(f"the environment did not answer {what} within {self.timeout_s:g} s") from None
        except ConnectionClosed as e:
            self._ws = None
            if e.sent is not None and e.sent.code == 1009:  # we closed it: the frame was over max_size
                raise EnvironmentFailed(f"the environment's answer to {what} is over {MAX_MESSAGE_BYTES} bytes; "
                                        "it was not read") from None  # fmt: skip
            raise EnvironmentFailed(
                f"the environment server closed the connection during {what} "
                f"({f'close code {e.rcvd.code}' if e.rcvd else 'no close frame'})"
            ) from None
        except OSError as e:
            self._ws = None
            raise EnvironmentFailed(f"the connection to the environment server failed during {what}: {e}") from None
        try:
            answer = json.loads(raw)
        except RecursionError:
            raise EnvironmentFailed(f"the environment's answer to {what} is JSON nested too deeply") from None
        except (TypeError, ValueError):
            raise EnvironmentFailed(f"the environment's answer to {what} is not JSON: {_short(str(raw))}") from None
        if not isinstance(answer, dict):
            raise EnvironmentFailed(f"the environment's answer to {what} is not a JSON object: {_short(answer)}")
        if answer.get("type") == "error":
            data = answer.get("data") if isinstance(answer.get("data"), dict) else {}
            code, msg = data.get("code", "UNKNOWN"), _short(str(data.get("message", "")), 300)
            if code == "VALIDATION_ERROR" and message.get("type") == "step":
                errors = [
                    f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}"
                    for e in data.get("errors") or []
                    if isinstance(e, dict)
                ]
                raise ActionRefused("; ".join(errors) or msg)
            cls = CapacityReached if code == "CAPACITY_REACHED" else EnvironmentFailed
            raise cls(f"the environment answered {what} with an error ({code}): {msg}")
        return answer

    async def _drop(self) -> None:
        """After a lost answer the connection is out of step with its requests: it is closed, not reused."""
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                await asyncio.wait_for(ws.close(), 2)
            except (ConnectionClosed, OSError, TimeoutError):
                pass

    async def reset(self, **kwargs) -> StepResult:
        answer = await self._call({"type": "reset", "data": kwargs}, "reset")
        return StepResult.parse(answer.get("data"), "reset")

    async def step(self, action: dict, n: int | None = None) -> StepResult:
        what = "step" if n is None else f"step {n}"
        answer = await self._call({"type": "step", "data": action}, what)
        return StepResult.parse(answer.get("data"), what)

    async def state(self) -> dict:
        answer = await self._call({"type": "state"}, "state")
        data = answer.get("data")
        return data if isinstance(data, dict) else {}


def fetch_schema(url: str, timeout_s: float = 10.0) -> dict:
    """GET /schema: {"action": ..., "observation": ..., "state": ...} (JSON schemas of the environment's models)."""
    base = http_url(url)
    try:
        with httpx.Client(timeout=timeout_s, trust_env=not _no_proxy(url)) as c:
            r = c.get(base + "/schema")
    except httpx.HTTPError as e:
        raise EnvironmentFailed(f"no OpenEnv server answers at {base}: {e}") from None
    if r.status_code != 200:
        raise EnvironmentFailed(f"{base}/schema answered {r.status_code}: is it an OpenEnv environment server?")
    try:
        schema = r.json()
    except ValueError:
        raise EnvironmentFailed(f"{base}/schema did not answer JSON: is it an OpenEnv environment server?") from None
    if not isinstance(schema, dict) or not isinstance(schema.get("action"), dict):
        raise EnvironmentFailed(f"{base}/schema has no action schema: is it an OpenEnv environment server?")
    return schema
